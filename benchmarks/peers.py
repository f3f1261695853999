"""Time other performance-model tools on the configurations of `bench_vmap.py`.

Run by `benchmarks/run.py` with the Python of the peers' own environment (never
perfmodel's: the peers are not its dependencies)::

    python -m venv /tmp/bench-peers
    /tmp/bench-peers/bin/pip install llm-analysis genz-llm aiconfigurator
    python benchmarks/peers.py < request.json      # what run.py sends; prints one JSON object

The request holds the configurations (concurrency, input and output lengths, spec scales),
the chip's numbers (SI units, from perfmodel's GB200 preset) and a time budget per tool. Each
tool evaluates one configuration per Python call, in order, until the budget is spent; its
rate is the configurations done over the wall time of those calls (set-up, such as loading a
performance database, is timed apart as `setup_s`). A tool that is not installed is
reported as absent with the command that installs it. This file imports nothing of perfmodel.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import logging
import sys
import time
import traceback
import warnings

#: DeepSeek-R1 (deepseek-ai/DeepSeek-R1 config.json): 61 layers, 128 heads, width 7168,
#: vocab 129280, 256 routed experts of width 2048, 8 per token. llm-analysis needs the expert
#: width to be a multiple of the model width, so 73 experts of width 7168, 2 per token: the
#: same expert weights (523k vs 524k rows x width) and 14336 vs 16384 active rows.
DEEPSEEK_R1 = dict(num_layers=61, n_head=128, hidden_dim=7168, vocab_size=129280,
                   max_seq_len=163840, moe_num_experts=73, moe_top_k=2, ffn_embed_dim=7168)


def _version(dist: str) -> str:
    return importlib.metadata.version(dist)


def _timed_loop(call, configs, budget_s: float, infeasible: tuple = ()) -> tuple:
    """Calls `call(cfg)` over `configs` until `budget_s` is spent: (count, seconds, last
    result, how many raised one of `infeasible`: the tool's answer "does not fit", which
    perfmodel gives as NaN metrics and `fits` False, counted as evaluated)."""
    with contextlib.suppress(*infeasible):
        call(configs[-1])   # warm-up, untimed: lazy imports and caches (perfmodel's compilation)
    start = time.perf_counter()
    count, last, rejected = 0, None, 0
    for cfg in configs:
        try:
            last = call(cfg)
        except infeasible:
            rejected += 1
        count += 1
        if time.perf_counter() - start > budget_s:
            break
    return count, time.perf_counter() - start, last, rejected


def llm_analysis(request) -> dict:
    from llm_analysis.analysis import LLMAnalysis
    from llm_analysis.config import (
        GPUConfig,
        ModelConfig,
        ParallelismConfig,
        get_dtype_config_by_name,
    )

    chip = request["chip"]
    model = ModelConfig(name="deepseek-r1", **DEEPSEEK_R1)
    dtype = get_dtype_config_by_name("w4a4e16")
    parallel = ParallelismConfig(tp_size=8, ep_size=8)

    def one(cfg):
        gpu = GPUConfig(name="gb200", mem_per_GPU_in_GB=chip["hbm_capacity"] / 1e9,
                        hbm_bandwidth_in_GB_per_sec=chip["hbm_bandwidth"] / 1e9
                        * cfg["bandwidth_scale"],
                        intra_node_bandwidth_in_GB_per_sec=chip["scale_up_bandwidth"] / 1e9
                        * cfg["link_scale"],
                        intra_node_min_message_latency=chip["scale_up_latency"],
                        peak_fp16_TFLOPS=chip["peak_flops_bf16"] / 1e12 * cfg["compute_scale"],
                        peak_i8_TFLOPS=chip["peak_flops_fp8"] / 1e12 * cfg["compute_scale"],
                        peak_i4_TFLOPS=chip["peak_flops_fp4"] / 1e12 * cfg["compute_scale"])
        analysis = LLMAnalysis(model, gpu, dtype, parallel)
        return analysis.inference(batch_size_per_gpu=max(1, round(cfg["concurrency"])),
                                  seq_len=int(cfg["input_len"]),
                                  num_tokens_to_generate=int(cfg["output_len"]))

    count, seconds, last, rejected = _timed_loop(one, request["configs"], request["budget_s"],
                                                 infeasible=(AssertionError,))
    return dict(version=_version("llm-analysis"), configs=count, seconds=seconds,
                configs_per_s=count / seconds, infeasible=rejected,
                sample={k: last[k] for k in ("prefill_latency", "decode_latency",
                                             "total_decode_tokens_per_s") if k in (last or {})},
                call="LLMAnalysis(ModelConfig(deepseek-r1 dims), GPUConfig(gb200 numbers x "
                     "scales), get_dtype_config_by_name('w4a4e16'), ParallelismConfig(tp_size=8,"
                     " ep_size=8)).inference(batch_size_per_gpu=round(concurrency), seq_len=isl,"
                     " num_tokens_to_generate=osl)",
                differs="DeepSeek-R1 built by hand as ModelConfig (MLA as multi-head attention, "
                        "no shared expert, no dense first layers, 73 experts of width 7168 top-2 "
                        "for 256 of width 2048 top-8); no DP attention; W4A4 for "
                        "every matmul; batch rounded to an integer; a GPUConfig per configuration")


def genz(request) -> dict:
    from GenZ import decode_moddeling, prefill_moddeling

    chip = request["chip"]

    def one(cfg):
        system = dict(real_values=True,
                      Flops=chip["peak_flops_fp4"] / 1e12 * cfg["compute_scale"] / 4,
                      Memory_size=chip["hbm_capacity"] / 2**30,
                      Memory_BW=chip["hbm_bandwidth"] / 1e9 * cfg["bandwidth_scale"],
                      ICN=chip["scale_up_bandwidth"] / 1e9 * cfg["link_scale"],
                      ICN_LL=chip["scale_up_latency"] * 1e6)
        batch = max(1, round(cfg["concurrency"]))
        common = dict(model="deepseek-ai/DeepSeek-V3-Base", batch_size=batch,
                      input_tokens=int(cfg["input_len"]), system_name=system, bits="fp4",
                      tensor_parallel=8, expert_parallel=8)
        prefill = prefill_moddeling(**common)
        decode = decode_moddeling(**common, output_tokens=int(cfg["output_len"]))
        return prefill, decode

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        count, seconds, last, _ = _timed_loop(one, request["configs"], request["budget_s"])
    prefill, decode = last
    return dict(version=_version("genz-llm"), configs=count, seconds=seconds,
                configs_per_s=count / seconds,
                sample=dict(ttft_ms=float(prefill["Latency"]), tpot_ms=float(decode["Latency"])),
                call="prefill_moddeling(model='deepseek-ai/DeepSeek-V3-Base', batch_size="
                     "round(concurrency), input_tokens=isl, system_name={real_values, Flops, "
                     "Memory_size, Memory_BW, ICN, ICN_LL from gb200 x scales}, bits='fp4', "
                     "tensor_parallel=8, expert_parallel=8) and decode_moddeling(the same, "
                     "output_tokens=osl)",
                differs="DeepSeek-V3-Base (the same architecture as R1); Flops given as BF16 "
                        "(GenZ scales by 4 for fp4); no DP attention; prefill and one decode step"
                        " at the given context (GenZ's decode is one step, not the whole output);"
                        " batch rounded")


def aiconfigurator(request) -> dict:
    from aiconfigurator.sdk import common, config
    from aiconfigurator.sdk.backends.factory import get_backend
    from aiconfigurator.sdk.errors import NoFeasibleConfigError
    from aiconfigurator.sdk.inference_session import InferenceSession
    from aiconfigurator.sdk.models import get_model
    from aiconfigurator.sdk.perf_database import get_database, get_latest_database_version

    start = time.perf_counter()
    version = get_latest_database_version("gb200", "trtllm")
    database = get_database("gb200", "trtllm", version)
    model_config = config.ModelConfig(tp_size=1, moe_tp_size=1, moe_ep_size=8,
                                      attention_dp_size=8,
                                      gemm_quant_mode=common.GEMMQuantMode.nvfp4,
                                      moe_quant_mode=common.MoEQuantMode.nvfp4,
                                      kvcache_quant_mode=common.KVCacheQuantMode.fp8,
                                      fmha_quant_mode=common.FMHAQuantMode.bfloat16)
    model = get_model("deepseek-ai/DeepSeek-R1", model_config, "trtllm")
    session = InferenceSession(model, database, get_backend("trtllm"))
    setup_s = time.perf_counter() - start

    def one(cfg):
        runtime = config.RuntimeConfig(batch_size=max(1, round(cfg["concurrency"] / 8)),
                                       isl=int(cfg["input_len"]), osl=int(cfg["output_len"]))
        return session.run_static(runtime, mode="static")

    count, seconds, last, rejected = _timed_loop(one, request["configs"], request["budget_s"],
                                                 infeasible=(NoFeasibleConfigError,))
    return dict(version=_version("aiconfigurator"), configs=count, seconds=seconds,
                configs_per_s=count / seconds, setup_s=setup_s, infeasible=rejected,
                database=f"gb200 trtllm {version}",
                call="InferenceSession(get_model('deepseek-ai/DeepSeek-R1', ModelConfig(tp_size=1,"
                     " moe_ep_size=8, attention_dp_size=8, nvfp4 GEMM and MoE, fp8 KV, bf16 FMHA),"
                     " 'trtllm'), get_database('gb200', 'trtllm', latest), get_backend('trtllm'))"
                     ".run_static(RuntimeConfig(batch_size=round(concurrency / 8), isl, osl), "
                     "mode='static')  # stride 32 over the output",
                differs="measured kernel tables of GB200 under TensorRT-LLM, not the chip's specs:"
                        " the bandwidth, compute and link scales of each configuration are not "
                        "applied; tp1 attention with DP 8 and EP 8 (perfmodel's tp8-ep8 with DP "
                        "attention); batch per rank rounded")


TOOLS = {"llm-analysis": ("llm_analysis", llm_analysis),
         "genz-llm": ("GenZ", genz),
         "aiconfigurator": ("aiconfigurator", aiconfigurator)}


def main() -> None:
    request = json.load(sys.stdin)
    logging.disable(logging.WARNING)   # the tools log per call; not part of their work
    result = {"python": sys.executable}
    for dist, (module, measure) in TOOLS.items():
        if dist not in request.get("tools", TOOLS):
            continue
        try:
            __import__(module)
        except ImportError:
            result[dist] = dict(absent=True, install=f"{sys.executable} -m pip install {dist}")
            continue
        try:
            result[dist] = measure(request)
        except Exception as error:   # a peer's failure is a figure, not a crash of the run
            result[dist] = dict(error=f"{type(error).__name__}: {error}",
                                traceback=traceback.format_exc(limit=3))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
