"""TensorRT-LLM Offline throughput check: `python calibration/trtllm_check.py` (a few
minutes on 2 cores). Writes `trtllm_check.json` (every row with its prediction), the
TRTLLM block of `calibration/README.md` and its parity plot `docs/trtllm_offline.png`.

NVIDIA's published `trtllm-bench` throughput tables (`data/benchmarks_trtllm.csv`, table
"throughput": output tokens/s of the whole TP group at an infinite request rate, fixed
input and output lengths) are an Offline capacity measurement on the same software as
the MLPerf TensorRT rows, for models, formats and chips the fit never saw: the ~v1.0
perf-overview (Llama-3.1-8B, Llama-3.3-70B, Llama-3.1-405B, Llama 4, Qwen3 in FP8 and FP4
on H100, H200, B200, GB200) and the v0.17 one (Llama-3.1, Mixtral in FP8 on H100, H200,
GH200 and L40S, in FP16 on A100; see `TABLES` for its metric). Each row is predicted as
MLPerf Offline is (`perfmodel.mlperf`): the table's own layout (tp, pp, ep; DP attention
off), TensorRT-LLM's fitted runtime, the best output throughput over batches that fit in
memory and within the batch cap and tokens per step that trtllm-bench builds its engine
with (`engine_limits`, the same rules assumed for v0.17; `--no-engine-limits` prints the
figures without them and writes nothing unless given `--json`). Nothing here is fitted and
no measured column is read before the comparison.

Beside the tables, the five DeepSeek-R1 runs of TensorRT-LLM's best-practice blog (the same
data file; `load_blog_rows`, `predict_blog_row`): two min-latency runs (one request, MTP)
and three max-throughput runs (DP attention, thousands of requests), each predicted at its
own concurrency, layout and formats.

`bench_rows` gives the same rows as fit rows (`datasets.BenchRow`), which
`python calibration/validate.py --trtllm` adds to every fit as an experiment (not the
shipped fit; calibration/README.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import re
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from perfmodel import datasets, fitted, mlperf  # noqa: E402
from perfmodel.design import Design, Layout, SliceMapping, SpecDecode, precision  # noqa: E402
from perfmodel.formats import COMPUTE_CLASSES  # noqa: E402
from perfmodel.presets import get_chip, get_model  # noqa: E402
from perfmodel.serving import predict  # noqa: E402
from perfmodel.sweep import batch_that_fits  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE / "data"
#: The tables' model names -> presets (Llama-3.3-70B runs as the llama-3.1-70b preset: the
#: same architecture; the v0.17 table's Mistral 7B has no preset and is left out).
MODELS = {"Llama 3.1 8B": "llama-3.1-8b", "Llama 3.3 70B": "llama-3.1-70b",
          "Llama 3.1 405B": "llama-3.1-405b", "Llama 4 Scout": "llama-4-scout",
          "Llama 4 Maverick": "llama-4-maverick", "Qwen3-235B-A22B": "qwen3-235b-a22b",
          "Qwen3-30B-A3B": "qwen3-30b-a3b", "LLaMA v3.1 8B": "llama-3.1-8b",
          "LLaMA v3.1 70B": "llama-3.1-70b", "LLaMA v3.1 405B": "llama-3.1-405b",
          "Mixtral 8x7B": "mixtral-8x7b", "Mixtral 8x22B": "mixtral-8x22b"}
#: The tables' systems -> presets (one GPU of each).
CHIPS = {"B200 180GB (DGX B200)": "b200", "GB200 192GB (GB200 NVL72)": "gb200",
         "H100 SXM 80GB (DGX H100)": "h100", "H200 SXM 141GB (DGX H200)": "h200",
         "H100 80GB HBM3": "h100", "H200 141GB HBM3": "h200", "GH200 480GB": "gh200",
         "A100-SXM4-80GB": "a100-80gb", "L40S": "l40s"}
#: The throughput tables read (`doc_version`, `metric`): perf-overview ~v1.0 (output
#: tokens/s of the group) and v0.17, whose metric the data file marks UNCERTAIN (output, or
#: input plus output tokens?). It is output tokens/s: at the 18 configurations both tables
#: hold for H100 (Llama-3.1-8B and 70B, FP8, same TP), v0.17 reads 0.93-1.04x of ~v1.0's
#: output tokens/s, where input plus output would read (ISL + OSL) / OSL = 1.03-17x
#: (`metric_check`).
TABLES = {"~v1.0": ("perf-overview ~v1.0", "output_tok_s_total"),
          "v0.17": ("perf-overview v0.17", "tok_s_total_group")}


def load_rows(path=DATA / "benchmarks_trtllm.csv", tables=tuple(TABLES)) -> list[dict]:
    """The Offline rows of `tables` (keys of `TABLES`) whose model and system have presets:
    table, model, chip, tp, pp, ep, precision, isl, osl and the measured output tokens/s
    per GPU."""
    wanted = {TABLES[t]: t for t in tables}
    out = []
    with open(path, newline="") as handle:
        for line, raw in enumerate(csv.DictReader(handle), start=2):
            table = wanted.get((raw["doc_version"], raw["metric"]))
            if raw["table"] != "throughput" or table is None:
                continue
            if raw["model"] not in MODELS or raw["hardware"] not in CHIPS:
                continue
            gpus = int(raw["num_gpus"])
            out.append(dict(line=line, table=table, model=MODELS[raw["model"]],
                            chip=CHIPS[raw["hardware"]], tp=int(raw["tp"]),
                            pp=int(raw["pp"] or 1), ep=int(raw["ep"] or 1), gpus=gpus,
                            precision=raw["precision"].lower(), isl=float(raw["isl"]),
                            osl=float(raw["osl"]), measured=float(raw["value"]) / gpus))
    return out


def metric_check(rows=None) -> list[tuple]:
    """(model, tp, isl, osl, v0.17 / ~v1.0) at every H100 configuration both tables hold:
    about 1 if v0.17 counts output tokens, (ISL + OSL) / OSL if it counts both."""
    rows = load_rows() if rows is None else rows
    h100 = {}
    for r in rows:
        if r["chip"] == "h100":
            key = (r["model"], r["tp"], r["precision"], r["isl"], r["osl"])
            h100.setdefault(key, {})[r["table"]] = r["measured"]
    return [(k[0], k[1], k[3], k[4], v["v0.17"] / v["~v1.0"])
            for k, v in sorted(h100.items()) if len(v) == 2]


#: trtllm-bench's bytes per weight and per KV value by quantization (its
#: `bench/build/tuning.py`, `BYTES_PER_ELEM`); the FP8 and FP4 checkpoints of the table
#: (ModelOpt's) keep an FP8 KV cache.
BENCH_BYTES = {"fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "fp4": 0.5}


def engine_limits(row: dict) -> tuple[int, int]:
    """(max batch size, max tokens per step) that `trtllm-bench throughput` builds for the
    row: its `calc_engine_setting` / `finetune_setting` (NVIDIA/TensorRT-LLM
    tensorrt_llm/bench/build/tuning.py), re-derived here: the requests whose KV at the full
    ISL + OSL fit in 95 % of the memory the weights leave (GiB, at least one KV head per
    TP rank), capped at 4,096 per pipeline stage and rounded up (to 64 at least); tokens
    per step the batch times 1 + ISL/OSL, capped at 32,768 and rounded up (2,048 at
    least)."""
    model, chip = get_model(row["model"]), get_chip(row["chip"], calibrated=False)
    gib = 1024.0 ** 3
    kv_bytes = 2.0 if row["precision"] in ("fp16", "bf16") else 1.0
    per_token = (2 * model.num_layers * max(row["tp"], model.num_kv_heads) * model.head_dim
                 * kv_bytes / gib)
    gpus = row["tp"] * row["pp"]
    available = float(chip.hbm_capacity) / gib * gpus \
        - model.total_params * BENCH_BYTES[row["precision"]] / gib
    requests = 0.95 * available / (per_token * (row["isl"] + row["osl"]))
    raw_bs = min(requests, 4096.0) / row["pp"]
    raw_tokens = min(raw_bs * (1.0 + row["isl"] / row["osl"]), 32768.0)
    return (_round_up(raw_bs, ((256, 32), (1024, 128), (math.inf, 256)), 64),
            _round_up(raw_tokens, ((4096, 256), (8192, 512), (math.inf, 1024)), 2048))


def _round_up(x: float, rungs, least: int) -> int:
    """`x` rounded up to the step of the first rung (below, step) with x < below, and at
    least `least`: trtllm-bench's `finetune_setting` ladders."""
    step = next(step for below, step in rungs if x < below)
    return max(least, step * math.ceil(x / step))


def _kv(chip) -> str | None:
    """The KV-cache format of the table's engines: FP8 where the chip computes FP8."""
    return "fp8" if "fp8" in chip.native_classes else None


def _engine(row: dict, engine: bool = True, calibrated: bool = True,
            attention_max: float | None = None):
    """(model, chip, precision, runtime, layout, batch that fits) of a row as trtllm-bench
    runs it: TensorRT-LLM's fitted runtime, the table's layout, and, with `engine`, the
    batch cap and tokens per step of `engine_limits`; the batch is what fits beside the
    weights at the fixed lengths' decode context (`Workload.decode_context`), capped."""
    model, chip = get_model(row["model"]), get_chip(row["chip"], calibrated=calibrated)
    if attention_max is not None:   # an experiment: every attention kernel's efficiency
        value = jnp.asarray(float(attention_max))
        chip = eqx.tree_at(lambda c: (c.efficiency.attention_max,
                                      c.efficiency.prefill_attention_max,
                                      c.efficiency.window_prefill_attention_max,
                                      c.efficiency.full_attention_max), chip,
                           (value, value, value, value))
    prec = precision(chip, model, row["precision"], kv=_kv(chip))
    runtime = fitted.runtime_for("trtllm-bench")
    cap = math.inf
    if engine:
        cap, tokens = engine_limits(row)
        runtime = eqx.tree_at(lambda r: r.max_batched_tokens, runtime,
                              jnp.asarray(float(tokens)))
    layout = Layout(tp=row["tp"], pp=row["pp"], ep=row["ep"])
    context = float(runtime.kv_context(mlperf.fixed_lengths(row["isl"], row["osl"])))
    fit = min(batch_that_fits(model, chip, prec, runtime, layout, context), cap)
    return model, chip, prec, runtime, layout, fit


#: `BenchRow.index` of the first table row as a fit row (after every InferenceMAX index).
INDEX_BASE = 1_000_000


def bench_rows(rows: list[dict]) -> list[datasets.BenchRow]:
    """The rows as fit rows (`datasets.BenchRow`, framework "trtllm-bench", which falls
    back to "trt" where it has no terms of its own: no HTTP server in the loop): total
    tokens/s per GPU measured (output tokens/s x (ISL + OSL) / OSL, the InferenceMAX
    metric), fixed lengths (range ratio 1, no opening burst), the engine's token budget,
    an FP8 KV cache where the chip has FP8, and the engine's batch as the concurrency: the
    largest that `trtllm-bench` admits (`engine_limits`) and that fits beside the weights
    (the chip's specs: memory decides it, not the fit). Pipeline-parallel rows and rows
    whose batch does not fit are left out (the fit's layouts carry no pipeline)."""
    out = []
    for k, row in enumerate(rows):
        if row["pp"] != 1:
            continue
        # Memory alone decides the batch: the chip's specs, not the shipped fit.
        _, chip, _, runtime, _, fit = _engine(row, calibrated=False)
        batch = math.floor(fit)
        if batch < 1:
            continue
        total = row["measured"] * (row["isl"] + row["osl"]) / row["osl"]
        out.append(datasets.BenchRow(
            index=INDEX_BASE + k, line=row["line"], model=row["model"], hardware=row["chip"],
            framework="trtllm-bench", precision=row["precision"], isl=row["isl"], osl=row["osl"],
            conc=float(batch), mtp=False,
            layout=datasets.PoolLayout(tp=row["tp"], ep=row["ep"], dp_attention=False),
            prefill=None, decode=None, measured={"tput_per_gpu": total}, range_ratio=1.0,
            first_wave=1e-6, max_batched_tokens=float(runtime.max_batched_tokens),
            kv=_kv(chip)))
    return out


def predict_row(row: dict, engine: bool = True, attention_max: float | None = None) -> dict:
    """Best output tokens/s per GPU of the row's layout over batches that fit (and, with
    `engine`, within `engine_limits`: the batch cap and the tokens per step), with the
    batch that reaches it; `error` when it does not fit."""
    model, chip, prec, runtime, layout, fit = _engine(row, engine=engine,
                                                      attention_max=attention_max)
    if fit < 1.0:
        return {"predicted": math.nan, "batch": math.nan,
                "error": "weights and one sequence do not fit"}
    grid = mlperf.batch_grid(fit)
    workload = mlperf.fixed_lengths(row["isl"], row["osl"])
    design = Design(concurrency=1.0, layout=layout, precision=prec, runtime=runtime,
                    mapping=SliceMapping())
    m = mlperf.over_concurrency(model, chip, workload, design, jnp.asarray(grid))
    out = np.where(np.asarray(m.fits), np.asarray(m.output_throughput_per_chip), np.nan)
    k = int(np.nanargmax(out))
    return {"predicted": float(out[k]), "batch": float(grid[k]), "error": ""}


#: The DeepSeek-R1 runs of TensorRT-LLM's best-practice blog (`data/benchmarks_trtllm.csv`,
#: table "deepseek_r1_blog"): one system of 8 GPUs each, fixed 1K / 2K lengths, a stated
#: concurrency (trtllm-bench's closed loop), layout and formats. Never fitted.
BLOG_CHIPS = {"B200": "b200", "H200": "h200"}


def load_blog_rows(path=DATA / "benchmarks_trtllm.csv") -> list[dict]:
    """The blog's rows with their configuration read from the row's own columns: weights
    FP4 where the precision names FP4 (else FP8), an FP8 KV cache where it names one,
    attention DP where it says so, MTP draft tokens from "MTP k layers", the concurrency
    from "concurrency N"; measured output tokens/s of the system."""
    out = []
    with open(path, newline="") as handle:
        for line, raw in enumerate(csv.DictReader(handle), start=2):
            if raw["doc_version"] != "DeepSeek-R1 best-practice blog":
                continue
            text = raw["precision"]
            mtp = re.search(r"MTP (\d+) layers", text)
            out.append(dict(
                line=line, label=raw["table"].split(":", 1)[1], model="deepseek-r1",
                chip=BLOG_CHIPS[raw["hardware"]], gpus=int(raw["num_gpus"]),
                tp=int(raw["tp"]), ep=int(raw["ep"]),
                weights="fp4" if "FP4" in text else "fp8",
                kv="fp8" if "FP8 KV" in text else "bf16",
                dp_attention="attention DP" in text,
                draft=float(mtp.group(1)) if mtp else 0.0,
                concurrency=float(re.search(r"concurrency (\d+)",
                                            raw["concurrency_or_qps"]).group(1)),
                isl=float(raw["isl"]), osl=float(raw["osl"]),
                measured=float(raw["output_tok_s"])))
    return out


def predict_blog_row(row: dict, mtp_acceptance: float | None = None) -> dict:
    """Output tokens/s of the system at the row's concurrency (steady state of the closed
    loop), with its ratio to the published one, whether it fits and the TPOT (ms):
    TensorRT-LLM's fitted runtime, the row's layout and formats, and TensorRT-LLM's fitted
    MTP acceptance, or `mtp_acceptance` where given (an experiment)."""
    model, chip = get_model(row["model"]), get_chip(row["chip"])
    runtime = fitted.runtime_for("trtllm-bench")
    acceptance = fitted.mtp_acceptance("trtllm-bench") if mtp_acceptance is None \
        else mtp_acceptance
    spec = SpecDecode(draft_tokens=row["draft"], acceptance=acceptance)
    design = Design(concurrency=row["concurrency"],
                    layout=Layout(tp=row["tp"], ep=row["ep"],
                                  dp_attention=row["dp_attention"]),
                    precision=precision(chip, model, row["weights"], kv=row["kv"]),
                    runtime=runtime, speculative=spec)
    m = predict(model, chip, mlperf.fixed_lengths(row["isl"], row["osl"]), design)
    system = float(m.output_throughput_per_chip) * row["gpus"]
    return {"predicted": system, "ratio": system / row["measured"],
            "fits": bool(m.fits), "tpot_ms": 1e3 * float(m.tpot)}


def blog_table(rows: list[dict]) -> str:
    lines = ["| run | layout | formats (weights / KV) | MTP | concurrency | measured | "
             "predicted | ratio |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        layout = f"tp{r['tp']} ep{r['ep']}" + (" DP attention" if r["dp_attention"] else "")
        lines.append(f"| {r['label']} | {layout} | "
                     f"{r['weights']} / {r['kv']} | {r['draft']:g} | {r['concurrency']:g} | "
                     f"{r['measured']:,.0f} | {r['predicted']:,.0f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def summarize(rows: list[dict]) -> dict:
    """Median ratio and median |error| overall, per table, per (table, chip) and per
    (table, model, chip, precision)."""
    ok = [r for r in rows if np.isfinite(r["predicted"])]

    def stats(group):
        ratio = np.array([r["predicted"] / r["measured"] for r in group])
        return {"n": len(group), "median_ratio": float(np.median(ratio)),
                "median_error": float(np.median(np.abs(ratio - 1.0)))}

    def by(key):
        groups = {}
        for r in ok:
            groups.setdefault(key(r), []).append(r)
        return sorted(groups.items())

    return {"all": stats(ok), "not_predicted": len(rows) - len(ok),
            "tables": [{"table": k, **stats(v)} for k, v in by(lambda r: r["table"])],
            "shapes": [{"isl": k[0], "osl": k[1], **stats(v)}
                       for k, v in by(lambda r: (r["isl"], r["osl"]))],
            "chips": [{"table": k[0], "chip": k[1], **stats(v)}
                      for k, v in by(lambda r: (r["table"], r["chip"]))],
            "groups": [{"table": k[0], "model": k[1], "chip": k[2], "precision": k[3],
                        **stats(v)}
                       for k, v in by(lambda r: (r["table"], r["model"], r["chip"],
                                                 r["precision"]))]}


def table(summary: dict) -> str:
    lines = ["| table | model | chip | format | rows | median ratio | median error |",
             "| --- | --- | --- | --- | ---: | ---: | ---: |"]
    for g in summary["groups"]:
        lines.append(f"| {g['table']} | {g['model']} | {g['chip']} | {g['precision']} | "
                     f"{g['n']} | {g['median_ratio']:.2f} | {100 * g['median_error']:.1f} % |")
    for g in summary["chips"]:
        lines.append(f"| {g['table']} | **all** | {g['chip']} | | {g['n']} | "
                     f"{g['median_ratio']:.2f} | {100 * g['median_error']:.1f} % |")
    for g in summary["tables"]:
        lines.append(f"| **{g['table']}** | | | | {g['n']} | {g['median_ratio']:.2f} | "
                     f"{100 * g['median_error']:.1f} % |")
    a = summary["all"]
    lines.append(f"| **all** | | | | {a['n']} | {a['median_ratio']:.2f} | "
                 f"{100 * a['median_error']:.1f} % |")
    lines += ["", "By input / output length, both tables:", "",
              "| ISL / OSL | rows | median ratio | median error |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {g['isl']:.0f} / {g['osl']:.0f} | {g['n']} | {g['median_ratio']:.2f} | "
              f"{100 * g['median_error']:.1f} % |" for g in summary["shapes"]]
    return "\n".join(lines)


def gemm_fractions(path=DATA / "benchmarks_aic_gemm.csv",
                   chips=("b200", "b300", "h200")) -> str:
    """Measured fraction of peak FLOP/s of large GEMMs per format (m >= 2048, n = k in
    {4096, 16384}; aiconfigurator's timings, the op-level data of the latency fit): the
    range and median per chip and dtype, against the preset's peak of the dtype's compute
    class (what `hardware.Efficiency.format_ceiling` describes)."""
    peaks = {c: np.asarray(get_chip(c, calibrated=False).peak_flops) for c in chips}
    fractions = {}
    for g in datasets.load_gemm(path):
        if g["chip"] not in chips or g["m"] < 2048 or g["n"] != g["k"] \
                or g["n"] not in (4096.0, 16384.0):
            continue
        peak = float(peaks[g["chip"]][COMPUTE_CLASSES.index(
            datasets.GEMM_DTYPES[g["dtype"]][2])])
        fractions.setdefault((g["chip"], g["dtype"]), []).append(
            2.0 * g["m"] * g["n"] * g["k"] / g["seconds"] / peak)
    return "; ".join(f"{chip} {dtype} {100 * min(f):.0f}-{100 * max(f):.0f} % (median "
                     f"{100 * np.median(f):.0f} %)"
                     for (chip, dtype), f in sorted(fractions.items()))


def gemm_ratios(path=DATA / "benchmarks_aic_gemm.csv",
                chips=("b200", "gb200", "b300", "gb300", "h100", "h200")) -> str:
    """Each narrow format's GEMM time over BF16's at the same large shapes, measured and as
    the shipped fit predicts it (`calibration.format_ratio`), with the format ceiling c the
    measured ratio implies alone (a class k times BF16's peak at k (1 + c) / (k + c) times
    its rate: `hardware.Efficiency.format_ceiling`)."""
    from perfmodel.calibration import format_ratio

    samples = datasets.load_gemm(path)
    out = []
    for name in chips:
        chip = get_chip(name)
        peaks = dict(zip(COMPUTE_CLASSES, np.asarray(chip.peak_flops), strict=True))
        for dtype in ("fp8", "nvfp4"):
            measured, predicted = format_ratio(chip, samples, dtype)
            if not math.isfinite(measured):
                continue
            times = peaks[datasets.GEMM_DTYPES[dtype][2]] / peaks["bf16"]
            speedup = 1.0 / measured
            implied = times * (speedup - 1.0) / (times - speedup)
            out.append(f"{name} {dtype} {measured:.2f} measured, {predicted:.2f} fitted "
                       f"(c {implied:.1f} alone)")
    return "; ".join(out)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Parity plot of output tokens/s per GPU, coloured by model, marker by format."""
    from matplotlib.figure import Figure

    from perfmodel.plots import save

    figure = Figure(figsize=(6.5, 6), layout="constrained")
    ax = figure.subplots()
    ok = [r for r in rows if np.isfinite(r["predicted"])]
    markers = {"fp8": "o", "fp4": "^", "fp16": "s", "bf16": "s"}
    for i, model in enumerate(sorted({r["model"] for r in ok})):
        for fmt, marker in markers.items():
            rs = [r for r in ok if r["model"] == model and r["precision"] == fmt]
            if rs:
                ax.scatter([r["measured"] for r in rs], [r["predicted"] for r in rs], s=16,
                           marker=marker, color=f"C{i}", alpha=0.8, label=f"{model} {fmt}")
    values = [v for r in ok for v in (r["measured"], r["predicted"])]
    low, high = 0.5 * min(values), 2.0 * max(values)
    ax.plot([low, high], [low, high], "k-", lw=0.8)
    for k in (0.8, 1.25):
        ax.plot([low, high], [k * low, k * high], "k:", lw=0.6)
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high),
           xlabel="measured output tokens/s per GPU (trtllm-bench, ~v1.0 and v0.17 tables)",
           ylabel="predicted", title="TensorRT-LLM Offline tables (never fitted)")
    ax.legend(fontsize=6, loc="upper left", ncol=2)
    save(figure, str(path))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="where to write every row with its prediction (default "
                             "calibration/trtllm_check.json, with the engine limits)")
    parser.add_argument("--no-engine-limits", action="store_true",
                        help="batches up to what fits in memory, no trtllm-bench batch cap "
                             "and the runtime's own tokens per step")
    parser.add_argument("--attention-max", type=float, default=None, metavar="FRACTION",
                        help="an experiment: every attention kernel's efficiency "
                             "(`hardware.Efficiency.attention_max`, `prefill_attention_max` and "
                             "`full_attention_max`) "
                             "set to FRACTION; prints, and writes only to --json")
    parser.add_argument("--blog-mtp-acceptance", type=float, default=None, metavar="FRACTION",
                        help="an experiment: the DeepSeek-R1 blog runs' per-token MTP "
                             "acceptance set to FRACTION (default TensorRT-LLM's fitted one); "
                             "prints, and writes only to --json")
    parser.add_argument("--no-readme", action="store_true",
                        help="print the table without rewriting calibration/README.md")
    args = parser.parse_args(argv)
    start = time.time()
    engine = not args.no_engine_limits
    experiment = args.attention_max is not None or args.blog_mtp_acceptance is not None
    rows = [dict(r, **predict_row(r, engine, args.attention_max)) for r in load_rows()]
    summary = summarize(rows)
    limits = ("within trtllm-bench's engine limits (`engine_limits`)" if engine
              else "batches up to what fits, no engine limits")
    ratios = [r[-1] for r in metric_check(rows)]
    blog = [dict(r, **predict_blog_row(r, args.blog_mtp_acceptance)) for r in load_blog_rows()]
    blog_ratios = sorted(r["ratio"] for r in blog)
    text = (f"TensorRT-LLM perf-overview Offline rows (~v1.0 and v0.17), shipped fit, never "
            f"fitted (`python calibration/trtllm_check.py`, {time.time() - start:.0f} s), "
            + (f"every attention kernel's efficiency set to {args.attention_max:g} (an "
               f"experiment, `--attention-max`), " if args.attention_max is not None
               else "") +
            f"{limits}: output tokens/s per GPU, predicted over measured, {len(rows)} rows "
            f"({summary['not_predicted']} not predicted). The v0.17 table counts output "
            f"tokens: at the {len(ratios)} H100 configurations both tables hold it reads "
            f"{min(ratios):.2f}-{max(ratios):.2f}x of ~v1.0's output tokens/s (`metric_check`)."
            f"\n\n{table(summary)}\n\n"
            f"Measured fraction of peak of large GEMMs (m >= 2048, n = k = 4096 or 16,384; "
            f"`benchmarks_aic_gemm.csv`, the latency fit's op-level data): "
            f"{gemm_fractions()}.\n\nNarrow formats' time over BF16's at the same large GEMM "
            f"shapes (m >= 4096, n, k >= 8192), measured and as the shipped fit predicts it: "
            f"{gemm_ratios()}.\n\n![TensorRT-LLM Offline parity](../docs/trtllm_offline.png)"
            f"\n\nDeepSeek-R1 on one 8-GPU node, the five runs of TensorRT-LLM's "
            f"best-practice blog (`load_blog_rows`: 1K / 2K tokens, each run's concurrency, "
            f"layout, formats and MTP draft length from its own row; TensorRT-LLM's fitted "
            f"runtime and "
            + (f"an MTP acceptance of {args.blog_mtp_acceptance:g} (an experiment, "
               f"`--blog-mtp-acceptance`)" if args.blog_mtp_acceptance is not None
               else "MTP acceptance")
            + f"; never fitted): output tokens/s of the system, "
            f"predicted over published {blog_ratios[0]:.2f}-{blog_ratios[-1]:.2f}x.\n\n"
            f"{blog_table(blog)}")
    print(text)
    out = args.json or (HERE / "trtllm_check.json" if engine and not experiment else None)
    if out is not None:
        out.write_text(json.dumps({"summary": summary, "rows": rows, "engine_limits": engine,
                                   "deepseek_blog": blog}, indent=1))
    if not args.no_readme and engine and not experiment:
        plot(rows, HERE.parent / "docs" / "trtllm_offline.png")
        sys.path.insert(0, str(HERE))
        from validate import replace_section
        replace_section(HERE / "README.md", text, tag="TRTLLM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
