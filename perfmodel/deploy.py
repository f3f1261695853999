"""Launch commands of serving engines for a chosen design: what to run so that vLLM, SGLang
or TensorRT-LLM serve the way the model was evaluated.

`launch(engine, design, model, chip)` turns a design as the search reports it
(`OptimizeResult.design`: layout, chips, deployment concurrency, formats, placements, power
cap) into one engine instance's command line, plus the files it reads. Every flag it writes
is one of `ENGINES[engine].flags`, the options documented for the engine version named
there (with the page they come from); a design the engine cannot express raises ValueError
with the reason instead of a command that would run something else.

How perfmodel's layout maps to the engines (a layout is `tp` chips per stage, `pp` stages,
`ep`-way expert parallelism, attention data-parallel over the `tp` chips with `dp_attention`,
and `replicas` independent instances):

- vLLM: attention TP is `--tensor-parallel-size`; DP attention is `--data-parallel-size tp`
  with TP 1. Its expert parallelism always spans every rank of the instance
  (`--enable-expert-parallel`: EP = TP x DP), so `ep` must be 1 or `tp`.
- SGLang: `--tp-size tp` chips per stage; DP attention adds `--enable-dp-attention --dp-size
  tp`; `--ep-size ep` shards the experts (the rest of `tp` splits each expert).
- TensorRT-LLM (`trtllm-serve`, PyTorch backend): `--tp_size`, `--pp_size`, `--ep_size`;
  DP attention and the KV-cache format go in the `--extra_llm_api_options` YAML file.

Batch limits: the instance's share of the deployment concurrency. Under DP attention vLLM
and TensorRT-LLM take the limit of each data-parallel rank (each runs its own scheduler),
so it is divided by `tp`; SGLang takes the instance's. The chunk of prefill tokens per step
is `Runtime.max_batched_tokens`, the memory fraction `Runtime.memory_fraction`: the settings
the model predicted with.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex

from .design import Layout, Runtime
from .hardware import Chip


@dataclasses.dataclass(frozen=True)
class Engine:
    """One engine version's launch command and the options documented for it."""

    name: str
    version: str
    program: tuple[str, ...]
    """The command before the model argument."""
    model_flag: str | None
    """The option naming the model, or None for a positional argument."""
    flags: frozenset[str]
    """Every option `launch` may write, as documented for `version`."""
    source: str
    kv_formats: dict[str, str | None]
    """perfmodel KV format -> the engine's value (None: its default, the model's dtype)."""
    quantizes_to: frozenset[str]
    """Weight formats the engine makes from a higher-precision checkpoint at load time."""
    quantization_flag: str | None
    kv_flag: str | None
    """The option setting the KV-cache format (None: in an options file)."""
    context_flag: str
    """The option capping a request's prompt plus output (tokens)."""


ENGINES = {
    "vllm": Engine(
        name="vllm", version="0.11", program=("vllm", "serve"), model_flag=None,
        flags=frozenset({"--tensor-parallel-size", "--pipeline-parallel-size",
                         "--data-parallel-size", "--enable-expert-parallel", "--max-num-seqs",
                         "--max-num-batched-tokens", "--kv-cache-dtype", "--quantization",
                         "--gpu-memory-utilization", "--max-model-len"}),
        source="vLLM engine arguments, https://docs.vllm.ai/en/v0.11.0/configuration/"
               "engine_args.html (vllm serve --help)",
        kv_formats={"bf16": None, "fp16": None, "fp8": "fp8"},
        quantizes_to=frozenset({"fp8"}), quantization_flag="--quantization",
        kv_flag="--kv-cache-dtype", context_flag="--max-model-len"),
    "sglang": Engine(
        name="sglang", version="0.5", program=("python", "-m", "sglang.launch_server"),
        model_flag="--model-path",
        flags=frozenset({"--model-path", "--tp-size", "--pp-size", "--dp-size", "--ep-size",
                         "--enable-dp-attention", "--max-running-requests",
                         "--chunked-prefill-size", "--kv-cache-dtype", "--quantization",
                         "--mem-fraction-static", "--context-length"}),
        source="SGLang server arguments, https://docs.sglang.io/advanced_features/"
               "server_arguments.html (python -m sglang.launch_server --help)",
        kv_formats={"bf16": None, "fp16": None, "fp8": "fp8_e4m3"},
        quantizes_to=frozenset({"fp8"}), quantization_flag="--quantization",
        kv_flag="--kv-cache-dtype", context_flag="--context-length"),
    "trtllm": Engine(
        name="trtllm", version="1.0", program=("trtllm-serve",), model_flag=None,
        flags=frozenset({"--backend", "--tp_size", "--pp_size", "--ep_size",
                         "--max_batch_size", "--max_num_tokens", "--max_seq_len",
                         "--kv_cache_free_gpu_memory_fraction", "--extra_llm_api_options"}),
        source="TensorRT-LLM trtllm-serve, https://nvidia.github.io/TensorRT-LLM/1.0.0/"
               "commands/trtllm-serve/trtllm-serve.html; extra_llm_api_options keys "
               "enable_attention_dp and kv_cache_config.dtype from the LLM API reference",
        kv_formats={"bf16": None, "fp16": None, "fp8": "fp8"},
        quantizes_to=frozenset(), quantization_flag=None, kv_flag=None,
        context_flag="--max_seq_len"),
}

#: Chip vendors each engine runs on.
_VENDORS = {"vllm": {"NVIDIA", "AMD"}, "sglang": {"NVIDIA", "AMD"}, "trtllm": {"NVIDIA"}}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One engine instance's command (run it on each of `instances`) and its files."""

    engine: str
    version: str
    argv: tuple[str, ...]
    files: dict
    """File name -> text the command reads (TensorRT-LLM's extra options)."""
    instances: int
    chips_per_instance: int
    notes: tuple[str, ...]

    def text(self) -> str:
        """A shell snippet: comments, the files as here-documents, the command."""
        lines = [f"# {self.engine} {self.version}: {self.instances} instance(s) of "
                 f"{self.chips_per_instance} chip(s); run this on each"]
        lines += [f"# {note}" for note in self.notes]
        for name, body in self.files.items():
            lines += [f"cat > {name} <<'EOF'", body.rstrip("\n"), "EOF"]
        lines.append(shlex.join(self.argv))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_engine(engine: str, chip: Chip, disaggregated: bool = False) -> None:
    """Raise ValueError unless `engine` runs on `chip` and can serve the kind of design
    (the checks that need no design, made before a search)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    vendor = _vendor(chip)
    if vendor not in _VENDORS[engine]:
        raise ValueError(f"{engine} does not run on {chip.name} ({vendor or 'no preset'}); "
                         f"it runs on {' and '.join(sorted(_VENDORS[engine]))} GPUs")
    if disaggregated:
        raise ValueError("a disaggregated (prefill/decode) design needs the engine's "
                         "disaggregation setup (two pools and a router), which perfmodel "
                         "does not write; emit aggregated designs only")


def launch(engine: str, design: dict, model, chip: Chip,
           runtime: Runtime | None = None, max_context: int | None = None) -> Launch:
    """The launch command of `engine` for `design`.

    Args:
        engine: a key of `ENGINES` ("vllm", "sglang", "trtllm").
        design: the search's design dict (`OptimizeResult.design`).
        model: the served `Model` (its name is the checkpoint to load; its released formats
            say which weight formats need a quantized checkpoint).
        chip: the chip (its vendor says whether the engine runs on it).
        runtime: the settings predicted with (default `Runtime()`).
        max_context: the longest request to admit (tokens; default the model's own).

    Raises:
        ValueError: an unknown engine, or a design it cannot express, saying why.

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> d = {"layout": "2xtp4", "chips": 8, "concurrency": 64, "formats":
        ...      {"weights": "bf16", "experts": "bf16", "kv": "fp8"}, "power_cap_w": 700.0}
        >>> run = launch("vllm", d, get_model("llama-3.1-70b"), get_chip("h100"))
        >>> run.instances, " ".join(run.argv[:7])
        (2, 'vllm serve meta-llama/Meta-Llama-3.1-70B --tensor-parallel-size 4 --max-num-seqs 32')
    """
    check_engine(engine, chip, disaggregated=str(design["layout"]).startswith("P["))
    spec = ENGINES[engine]
    vendor = _vendor(chip)
    runtime = runtime if runtime is not None else Runtime()
    layout = Layout.parse(design["layout"])
    tp, ep, pp, dpa = layout.tp, layout.ep, layout.pp, layout.dp_attention
    moe = model.num_experts > 0
    per_instance = math.ceil(design["concurrency"] / layout.replicas)
    per_scheduler = math.ceil(per_instance / tp) if dpa else per_instance
    formats = design["formats"]
    notes = [f"layout {design['layout']}: {layout.replicas} x {tp * pp} chips; "
             f"{design['concurrency']} requests in flight over the deployment"]

    # Weights: the released format loads as it is; the engine quantizes to `quantizes_to`;
    # anything else needs a checkpoint in that format.
    quantization = None
    released = {"weights": model.weight_format, "experts": model.expert_format}
    wanted = {"weights": formats["weights"]}
    if moe:
        wanted["experts"] = formats["experts"]
    changed = {k: v for k, v in wanted.items() if v != released[k]}
    if changed:
        targets = set(changed.values())
        if len(targets) == 1 and targets <= spec.quantizes_to and len(changed) == len(wanted):
            quantization = targets.pop()
        else:
            what = ", ".join(f"{k} {v} (released {released[k]})" for k, v in changed.items())
            raise ValueError(f"{engine} loads {what} only from a checkpoint quantized that way; "
                             "point it at such a checkpoint, or choose the released formats "
                             "(--precision, --formats)")
    if formats["kv"] not in spec.kv_formats:
        raise ValueError(f"{engine} {spec.version} has no {formats['kv']} KV cache; its "
                         f"formats: {', '.join(spec.kv_formats)}")
    kv = spec.kv_formats[formats["kv"]]
    context = max_context if max_context is not None else model.max_context

    args: list[str] = []
    files: dict = {}
    if engine == "vllm":
        if moe and ep not in (1, tp):
            raise ValueError(f"vLLM's expert parallelism spans every rank of an instance "
                             f"(EP = TP x DP = {tp}); ep{ep} with tp{tp} is not expressible")
        if dpa:
            args += ["--data-parallel-size", str(tp)]
        else:
            args += ["--tensor-parallel-size", str(tp)]
        if pp > 1:
            args += ["--pipeline-parallel-size", str(pp)]
        if moe and ep == tp and ep > 1:
            args.append("--enable-expert-parallel")
        args += ["--max-num-seqs", str(per_scheduler), "--max-num-batched-tokens",
                 str(int(runtime.max_batched_tokens)), "--gpu-memory-utilization",
                 f"{float(runtime.memory_fraction):g}"]
    elif engine == "sglang":
        args += ["--tp-size", str(tp)]
        if pp > 1:
            args += ["--pp-size", str(pp)]
        if dpa:
            args += ["--enable-dp-attention", "--dp-size", str(tp)]
        if moe and ep > 1:
            args += ["--ep-size", str(ep)]
        args += ["--max-running-requests", str(per_instance), "--chunked-prefill-size",
                 str(int(runtime.max_batched_tokens)), "--mem-fraction-static",
                 f"{float(runtime.memory_fraction):g}"]
    else:
        args += ["--backend", "pytorch", "--tp_size", str(tp), "--pp_size", str(pp)]
        if moe:
            args += ["--ep_size", str(ep)]
        args += ["--max_batch_size", str(per_scheduler), "--max_num_tokens",
                 str(int(runtime.max_batched_tokens)), "--kv_cache_free_gpu_memory_fraction",
                 f"{float(runtime.memory_fraction):g}"]
        options = {}
        if dpa:
            options["enable_attention_dp"] = True
        if kv:
            options["kv_cache_config"] = {"dtype": kv}
        if options:
            files["extra_llm_api_options.yaml"] = _yaml(options)
            args += ["--extra_llm_api_options", "extra_llm_api_options.yaml"]
    # What every engine spells its own way; an engine with no flag for a setting took it
    # above (TensorRT-LLM's KV format is in its options file, and it quantizes nothing).
    if quantization:
        args += [spec.quantization_flag, quantization]
    if kv and spec.kv_flag:
        args += [spec.kv_flag, kv]
    if context:
        args += [spec.context_flag, str(context)]
    unknown = sorted({a for a in args if a.startswith("--")} - spec.flags)
    if unknown:   # a bug here, not the user's: every flag must be a documented one
        raise AssertionError(f"undocumented {engine} flags {unknown}")
    if dpa:
        notes.append(f"DP attention: {tp} ranks per instance, each scheduling up to "
                     f"{per_scheduler} requests")
    # The engine reads the memory fraction by its own rule (`Runtime.fraction_of_free`):
    # say so where the prediction sized the KV cache by the other one.
    engine_of_free = engine == "trtllm"
    if bool(float(runtime.fraction_of_free) >= 0.5) != engine_of_free:
        notes.append(f"memory fraction {float(runtime.memory_fraction):g}: predicted as a "
                     f"fraction of {'the free' if not engine_of_free else 'all'} memory, "
                     f"which {engine} reads as a fraction of "
                     f"{'the free' if engine_of_free else 'all'} memory: the KV cache it "
                     "allocates differs from the prediction's (predict with the engine's "
                     "own runtime, `fitted.runtime_for`)")
    cap = design.get("power_cap_w")
    if cap is not None and cap < float(chip.tdp) - 0.5:
        tool = "nvidia-smi -pl" if vendor == "NVIDIA" else "rocm-smi --setpoweroverdrive"
        notes.append(f"power cap {cap:.0f} W per chip (TDP {float(chip.tdp):.0f} W): "
                     f"{tool} {cap:.0f}")
    checkpoint = _checkpoint(model)
    model_args = [checkpoint] if spec.model_flag is None else [spec.model_flag, checkpoint]
    return Launch(engine=engine, version=spec.version,
                  argv=(*spec.program, *model_args, *args), files=files,
                  instances=layout.replicas, chips_per_instance=tp * pp, notes=tuple(notes))


def _vendor(chip: Chip) -> str | None:
    """The chip preset's vendor (None for a chip that is no preset)."""
    from .presets import chip_info

    try:
        return chip_info(chip.name)["vendor"]
    except (KeyError, ValueError):
        return None


def _checkpoint(model) -> str:
    """The Hugging Face id to load: the preset's `hf_id`, else the model's name (a shipped
    or given config keeps its id or path as its name)."""
    from .presets import model_info

    try:
        return model_info(model.name)["hf_id"] or model.name
    except (KeyError, ValueError):
        return model.name


def _yaml(options: dict, indent: int = 0) -> str:
    """A small YAML mapping (bools, numbers, strings and nested mappings)."""
    lines = []
    for key, value in options.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(_yaml(value, indent + 2).rstrip("\n"))
        else:
            lines.append(" " * indent + f"{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"
