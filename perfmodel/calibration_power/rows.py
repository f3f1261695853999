"""Rows of `calibration/power/power_measurements.csv` as serving-model inputs, and the
predictions of the shipped (or any) power fit for such rows (`predict_power_rows`).

A row names a model (preset or Hugging Face id), a chip, a parallel layout, the weights'
format, the batch, the output length and the serving engine; `row_spec` turns it into a
`RowSpec`, and `group_inputs` turns rows that share a static structure (`RowSpec.group`)
into one batched `Design` and `Workload` of `perfmodel.serving.predict`.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import os
import re

import equinox as eqx
import numpy as np

from .. import fitted as fitted_params
from ..architecture import Model
from ..compiled import QUICK_COMPILE, filter_jit, on_host, side_by_side
from ..design import Design, Layout, Runtime, precision
from ..hardware import Chip
from ..kvcache import profile_activation_bytes
from ..presets import find_model, get_chip
from ..serving import predict
from ..workload import Workload
from . import intervals

#: Input length (tokens) assumed for data sets whose prompts are real text of unpublished
#: length (ML.ENERGY). ShareGPT and LM Arena prompts: about 250 tokens (vLLM's ShareGPT
#: benchmark set averages ~220 input tokens); GPQA Diamond questions with the chat template:
#: about 250; v2 code completion (HumanEval-style prompts): about 150; Sourcegraph
#: fill-in-the-middle requests carry surrounding code: about 1,000. Assumptions, not data.
ASSUMED_ISL = {"lm-arena-chat": 256.0, "chat": 256.0, "gpqa": 256.0, "code completion": 150.0,
               "sourcegraph-fim": 1024.0, "MLPerf": 1024.0}
DEFAULT_ISL = 256.0

# ---------------------------------------------------------------------------------------
# Rows of the measurement file -> model inputs.


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """One measured row as model inputs (static parts) and its measured values."""

    index: int
    model: Model
    chip_name: str
    layout: Layout
    weights: str | None
    isl: float
    isl_assumed: bool
    osl: float
    concurrency: float
    max_running: float
    framework: str
    measured: dict

    @property
    def group(self):
        return (self.model.name, self.chip_name, self.layout, self.weights, self.framework)


def _float(row: dict, key: str):
    value = (row.get(key) or "").strip()
    try:
        return float(value)
    except ValueError:
        return None


def resolve_model(name: str) -> Model | None:
    """A model by Hugging Face id: a preset, else a shipped HF config
    (`presets.find_model`), else None.

    Example:
        >>> resolve_model("openai/gpt-oss-120b").name, resolve_model("acme/unknown-7b")
        ('gpt-oss-120b', None)
    """
    try:
        return find_model(name, label=True)
    except ValueError:
        return None


def _layout(model: Model, parallelism: str, num_gpus: int) -> Layout:
    values = {k: int(v) for k, v in re.findall(r"(TP|EP|DP|PP)(\d+)", parallelism or "")}
    pp = values.get("PP", 1)
    chips = max(num_gpus // pp, 1)
    ep = values.get("EP", 1) if model.is_moe else 1
    ep = math.gcd(math.gcd(ep, chips), model.num_experts or 1) if model.is_moe else 1
    dp = values.get("DP", 1)
    return Layout(tp=chips, ep=max(ep, 1), pp=pp, dp_attention=bool(model.is_moe and dp > 1))


def _weights(text: str) -> str | None:
    text = (text or "").lower()
    if "mxfp4" in text or text.startswith("fp4"):
        return "fp4"
    if text.startswith("fp8"):
        return "fp8"
    if text.startswith("bfloat16") or text.startswith("bf16"):
        return "bf16"
    return None


def assumed_isl(workload: str) -> float:
    """Input length assumed for a data set named in `workload` (see `ASSUMED_ISL`)."""
    for key, value in ASSUMED_ISL.items():
        if workload.lower().startswith(key.lower()):
            return value
    return DEFAULT_ISL


def runtime_key(framework: str) -> str:
    """Which fitted runtime a framework label uses: "vllm-2024" (ML.ENERGY v2 era, version
    unrecorded), "vllm" (any other vLLM) or "other" (prior `Runtime`)."""
    text = framework.lower()
    if "vllm" not in text:
        return "other"
    return "vllm-2024" if "2024" in text or "v2 benchmark" in text else "vllm"


def row_spec(row: dict, index: int = 0) -> tuple[RowSpec | None, str]:
    """Model inputs of a measurement row (columns of `power_measurements.csv`).

    Returns:
        (spec, "") or (None, reason) when the model or chip is unknown or a column missing.
    """
    model = resolve_model(row.get("model", ""))
    if model is None:
        return None, f"unknown model {row.get('model')!r} (no preset, no shipped HF config)"
    try:
        chip = get_chip(row.get("hardware", ""), calibrated=False, label=True)
    except ValueError:
        return None, f"unknown hardware {row.get('hardware')!r}"
    num_gpus = int(_float(row, "num_gpus") or 1)
    batch = _float(row, "avg_batch_size") or _float(row, "max_batch_size") \
        or _float(row, "concurrency")
    osl = _float(row, "osl")
    if batch is None or osl is None:
        return None, "needs avg_batch_size, max_batch_size or concurrency, and osl"
    isl = _float(row, "isl")
    assumed = isl is None
    if assumed:
        isl = assumed_isl(row.get("workload", ""))
    framework = runtime_key(row.get("framework") or "")
    measured = {k: _float(row, k) for k in ("avg_power_w_per_gpu", "energy_j_per_output_token",
                                            "output_tokens_per_s_per_gpu", "median_itl_ms",
                                            "system_wall_power_w")}
    max_running = _float(row, "max_batch_size") or math.inf
    return RowSpec(index=index, model=model, chip_name=chip.name,
                   layout=_layout(model, row.get("parallelism", ""), num_gpus),
                   weights=_weights(row.get("precision", "")), isl=isl, isl_assumed=assumed,
                   osl=osl, concurrency=batch, max_running=max(max_running, batch),
                   framework=framework, measured=measured), ""


def specs_of(rows: list[dict]) -> tuple[list[RowSpec], list[tuple[int, str]]]:
    """Row specs of the rows the model can evaluate, and (index, reason) for the others."""
    specs, skipped = [], []
    for i, row in enumerate(rows):
        spec, why = row_spec(row, i)
        if spec is None:
            skipped.append((i, why))
        else:
            specs.append(spec)
    return specs, skipped


def group_inputs(specs: list[RowSpec], chip: Chip, fitted: dict) -> tuple[Design, Workload]:
    """Design and workload of rows sharing `RowSpec.group`, one row per array element.

    Args:
        specs: the rows (same model, chip, layout, weights and framework).
        chip: their chip (its formats decide the precisions).
        fitted: a power-fit dict (`fitted_power.json` layout) whose engine terms the rows'
            runtime takes ({}: the `Runtime` priors, kernels at the latency fit's speed).
    """
    first = specs[0]
    # NumPy until the Modules: outside a kernel, each jax.numpy operation on a group's
    # few rows compiles a program of its own for that group size (about 150 of them, 5 s,
    # on the 688 power rows' cold run).
    conc = np.asarray([s.concurrency for s in specs], dtype=float)
    running = np.asarray([s.max_running for s in specs], dtype=float)
    # vLLM keeps the KV cache in the model's dtype unless told otherwise.
    kv = "bf16" if first.framework.startswith("vllm") else None
    prec = precision(chip, first.model, first.weights, kv=kv, emulate=True)   # what ran
    # The measured harness's engine terms, resolved like any framework's
    # (`perfmodel.fitted.POWER_FRAMEWORKS`); "other" keeps the priors.
    name = f"mlenergy-{first.framework}"
    entry = (fitted_params.runtime_terms(name, chip.family, power=fitted)
             if name in fitted_params.POWER_FRAMEWORKS else {})
    ones = np.ones_like(running)
    terms = {k: np.asarray(v, dtype=float) * ones for k, v in entry.items()}
    terms.setdefault("kernel_efficiency", ones)
    runtime = Runtime(max_running=running, framework=first.framework, **terms)
    if first.framework.startswith("vllm"):
        # vLLM keeps its profiled activation peak out of the KV cache, not a flat reserve;
        # rows without max_num_seqs ran vLLM's default of 256 (vllm EngineArgs).
        seqs = np.where(np.isfinite(running), running, 256.0)
        reserve = profile_activation_bytes(first.model, first.layout, on_host(prec),
                                           np.asarray(runtime.max_batched_tokens), seqs)
        runtime = eqx.tree_at(lambda r: r.activation_reserve, runtime, reserve)
    design = Design(concurrency=conc, layout=first.layout, precision=prec, runtime=runtime)
    ratio = np.asarray([1.0 if s.isl_assumed else 0.8 for s in specs], dtype=float)
    workload = Workload(input_len=np.asarray([s.isl for s in specs], dtype=float),
                        output_len=np.asarray([s.osl for s in specs], dtype=float),
                        input_range_ratio=ratio, output_range_ratio=ratio,
                        first_wave_fraction=np.zeros_like(ratio))
    return design, workload


def groups_of(specs: list[RowSpec]) -> list[list[RowSpec]]:
    """Rows grouped by `RowSpec.group` (first-seen order): each group is one batched
    `serving.predict`, compiled once."""
    groups: dict = {}
    for spec in specs:
        groups.setdefault(spec.group, []).append(spec)
    return list(groups.values())


#: The per-group kernels' XLA:CPU options: `QUICK_COMPILE`, and each kernel's LLVM module
#: compiled whole. XLA:CPU splits a module into parts for parallel code generation by
#: default; these kernels are small and already compile two at a time (`side_by_side`),
#: where the split costs more than it saves: a cold `perfmodel predict` of the 688 power rows
#: took 0.92x the wall time and 0.87x the CPU time (median of three alternating cold runs
#: each; outputs equal to 1 ulp). `perfmodel compare`'s larger kernels were slower with it
#: (1.12x wall), so `QUICK_COMPILE` keeps XLA's split.
ROWS_COMPILE = dict(QUICK_COMPILE, xla_cpu_parallel_codegen_split_count=1)


# Through the traced-program store (a warm `perfmodel predict` does not trace), compiled
# with `ROWS_COMPILE`: 86 kernels of a few rows each, where compiling is the cost.
@functools.partial(filter_jit, options=lambda: ROWS_COMPILE)
def _predict_group(model, chip, workload, design):
    # vectorize: the same numbers, compiled about 25% faster for a group of a few rows
    # (measured: 10 groups in 36 s against 47 s).
    return predict(model, chip, workload, design, hard=True, check=False, vectorize=True,
                   unfit="value")


#: The prediction columns of measurement-style rows (`Metrics.to_row("pred_")` keys).
POWER_PREDICTION_KEYS = ("pred_power_w_modelled", "pred_j_per_output_token",
                         "pred_output_tput_per_chip")


def predict_power_rows(rows: list[dict], fitted: dict | None = None,
                       interval: float | None = None) -> list[dict]:
    """Predicted power, J per output token and output tokens/s per GPU for measurement-style
    rows (the columns of `power_measurements.csv`), for `perfmodel predict`.

    Each row needs model (preset name or Hugging Face id), hardware, num_gpus, parallelism
    (e.g. "TP2 EP1 DP1"), precision, avg_batch_size or max_batch_size (or concurrency) and
    osl; isl when known, else the input length of `ASSUMED_ISL` for its workload.

    Args:
        rows: the measurement-style rows.
        fitted: a power-fit dict (default: the shipped `fitted_power.json`).
        interval: a central prediction-interval level (0.9: 90 %) to add `<column>_lo` and
            `<column>_hi` for the three prediction columns (`intervals`: out-of-model
            residuals of the power fit, scaled per harness and chip family); None for none.

    Returns:
        One dict per row: the row plus `pred_power_w_modelled`,
        `pred_j_per_output_token`, `pred_output_tput_per_chip`, `pred_isl`,
        `pred_isl_assumed` and `pred_status` ("ok", "does not fit in memory" or why the row
        could not be evaluated: "unknown model ..."); with `interval`, the bounds (None
        where there is no prediction).

    Raises:
        ValueError: `interval` outside (0, 1), or a power fit without intervals.

    Example:
        >>> row = dict(model="meta-llama/Llama-3.1-8B-Instruct", hardware="H100",
        ...            num_gpus="1", parallelism="TP1", precision="bfloat16",
        ...            max_batch_size="64", osl="400", framework="vLLM 0.11.1")
        >>> out = predict_power_rows([row])[0]
        >>> out["pred_status"], 100 < out["pred_power_w_modelled"] <= 700
        ('ok', True)
    """
    fitted = fitted_params.read(fitted_params.POWER_FILE) if fitted is None else fitted
    table = None
    if interval is not None:
        if not 0.0 < interval < 1.0:
            raise ValueError(f"interval {interval} must be a level in (0, 1), e.g. 0.9")
        table = fitted.get("intervals")
        if table is None:
            raise ValueError("interval=...: this power fit has no prediction intervals "
                             "(refit with `python calibration/power/fit.py`)")
    bound_keys = tuple(f"{c}_{side}" for c in intervals.COLUMNS.values()
                       for side in ("lo", "hi")) if table is not None else ()
    specs, skipped = specs_of(rows)
    out = [dict(row) for row in rows]
    for i, why in skipped:
        out[i].update(pred_power_w_modelled=None, pred_j_per_output_token=None,
                      pred_output_tput_per_chip=None, pred_isl=None,
                      pred_isl_assumed=None, pred_status=why, **dict.fromkeys(bound_keys))
    # Every group's kernel is traced (or loaded from the store) first and compiled side by
    # side: XLA compiles one kernel per thread, without Python's lock.
    work, submitted = [], set()
    with side_by_side() as compiler:
        for members in groups_of(specs):
            first = members[0]
            chip = fitted_params.apply(get_chip(first.chip_name, calibrated=False),
                                       power=fitted)
            design, workload = group_inputs(members, chip, fitted)
            args = (first.model, chip, workload, design)
            kernel = _predict_group.lower(*args)
            if id(kernel) not in submitted:   # groups of one structure share a kernel
                submitted.add(id(kernel))
                compiler.submit(kernel)
            work.append((members, kernel, args))
    measured_families = tuple(fitted.get("families", {}))
    for members, kernel, args in work:
        m = kernel(*args)
        row = {k: np.asarray(v) for k, v in m.to_row("pred_").items()}
        for j, spec in enumerate(members):
            fits = bool(row["pred_fits"][j])
            entry = out[spec.index]
            entry.update(
                {k: float(row[k][j]) for k in POWER_PREDICTION_KEYS},
                pred_isl=spec.isl, pred_isl_assumed=spec.isl_assumed,
                pred_status="ok" if fits else "does not fit in memory")
            if table is not None:
                # A board's average power stays under its TDP.
                chip = args[1]
                group = intervals.group_key(spec.framework, chip.family, measured_families)
                entry.update(intervals.row_bounds(table, entry, group, interval,
                                                  float(chip.tdp)))
    return out


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Rows of a CSV file as dicts."""
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))
