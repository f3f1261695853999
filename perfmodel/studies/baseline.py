"""The GPU baseline as the InferenceMAX submitters run it: the Dynamo + TensorRT-LLM recipe.

The measured GB200 DeepSeek-R1 rows of InferenceMAX at 8K/1K FP4 (shared/data/
benchmarks_inferencemax.csv, framework dynamo-trt) all run one recipe, which this module
turns into a small search space for models of the DeepSeek-V3 architecture (MLA attention,
DeepSeek-R1 and Kimi-K2.5) on NVL72 GPUs:

- prefill/decode disaggregation (Dynamo): prefill workers of `PREFILL_TP` chips (TP4 EP4 with
  DP attention in every row), `PREFILL_WORKERS` of them, and one decode worker of
  `DECODE_WIDTHS` chips with wide expert parallelism and DP attention (tp = ep = 8, 16, 32 in
  the rows; 3 decode workers of TP8 EP8 without DP attention at low concurrency), all within
  one NVL72 domain (`chip.domain_size`), so the KV hand-off runs over NVLink;
- MTP speculative decoding where the model has an MTP head (`Model.mtp_layers`): draft
  lengths `MTP_DRAFTS` at the per-token acceptance the calibration fits for the same rows
  (`fitted.mtp_acceptance("dynamo-trt")`: 0.54 on InferenceMAX's random-token prompts,
  against the prior `datasets.MTP_ACCEPTANCE` 0.7 from the DeepSeek-V3 technical report,
  arXiv:2412.19437 section 5.4.3, 85-90 % for the second token on real text), and
  without it;
- FP8 KV cache and FP8 attention: TensorRT-LLM's throughput recipe for DeepSeek-R1 on
  Blackwell ("FP8 KV cache and FP8 attention, rather than BF16 precision", TensorRT-LLM tech
  blog 3, "Optimizing DeepSeek R1 Throughput on NVIDIA Blackwell GPUs"; `kv_cache_config:
  dtype: fp8` with `enable_attention_dp: true` in TensorRT-LLM's
  examples/serve/deepseek_r1_reasoning_parser.sh): the FP8 cache, and the attention math
  `design.attention_class` gives it (FP8 for MLA on Blackwell, the rule the calibration
  reads the same rows with); weights as the NVFP4 checkpoint;
- the fitted engine terms of the framework InferenceMAX ran (`fitted.runtime_for(
  "dynamo-trt")`).

`recipe_points` evaluates every configuration of that space over a concurrency grid (one
vmapped `predict` over all of them, the pools as numbers); `perfmodel.studies.jalapeno`
takes the baseline's operating points from these points together with its aggregated
sweep, so the baseline configuration is the model's own best predicted point under the
InferenceX definition of the peak, never read from the measured rows. `measured_top` and
`check_top` put the chosen point beside the measured rows at the top of the same sweep (a
report, not an input).

Example (the search itself is not run as a doctest: one kernel for the 16 layouts, about
3 s to compile on a CPU):
    >>> from perfmodel.presets import get_chip, get_model
    >>> from perfmodel.workload import Workload
    >>> model, chip = get_model("deepseek-r1"), get_chip("gb200")
    >>> len(layouts(model, chip)), drafts(model)
    (16, (0, 1, 2, 3))
    >>> p = recipe_points(model, chip, Workload(8192, 1024), (76.8,))  # doctest: +SKIP
    >>> i = p["tput_per_chip_total"].argmax()  # doctest: +SKIP
    >>> p["labels"][i]  # doctest: +SKIP
    'dynamo-trt no-mtp P[4xtp4-ep4-dpa]+D[tp8-ep8-dpa]'
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import compiled
from ..architecture import Model
from ..design import Design, Disaggregated, Layout, SliceMapping, SpecDecode, precision
from ..fitted import mtp_acceptance, runtime_for
from ..hardware import Chip
from ..serving import METRIC_KEYS, predict
from ..sweep import padded_take
from ..workload import Workload

#: The framework whose fitted engine terms the recipe uses (the InferenceMAX GB200 rows).
FRAMEWORK = "dynamo-trt"

#: Chips per prefill worker: TP4 EP4 with DP attention in every GB200 dynamo-trt row.
PREFILL_TP = 4

#: Prefill workers tried with the wide-EP decode pools (the rows run 4, 5, 6 and 8).
PREFILL_WORKERS = (2, 4, 5, 6, 8)

#: Decode pools tried: (chips per worker = tp = ep, DP attention, workers). The rows run one
#: wide-EP worker of 8, 16 or 32 chips with DP attention, and 3 TP8 EP8 workers without it
#: at low concurrency.
DECODE_POOLS = ((8, False, 3), (8, True, 1), (16, True, 1), (32, True, 1))

#: MTP draft lengths the search tries besides none: TensorRT-LLM runs 1 to 3 MTP layers
#: (3 in its min-latency recipe, tech blog 1, "Pushing Latency Boundaries"), each at the
#: calibration's per-token acceptance.
MTP_DRAFTS = (1, 2, 3)


def applies(model: Model) -> bool:
    """Whether the recipe describes how InferenceMAX runs `model` (MLA models)."""
    return model.attention == "mla"


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of the recipe space: a disaggregated layout and an MTP draft
    length (0: no speculative decoding)."""

    layout: Disaggregated
    draft_tokens: int = 0

    @property
    def chips(self) -> int:
        return self.layout.chips

    @property
    def mtp(self) -> bool:
        return self.draft_tokens > 0

    def describe(self) -> str:
        spec = f"mtp{self.draft_tokens}" if self.mtp else "no-mtp"
        return f"{FRAMEWORK} {spec} {self.layout.describe()}"


def layouts(model: Model, chip: Chip) -> tuple[Disaggregated, ...]:
    """The recipe's disaggregated layouts for `model` on `chip` that fit in one scale-up
    domain (`chip.domain_size` chips)."""
    out = []
    for width, dpa, workers in DECODE_POOLS:
        if model.is_moe and model.num_experts % width:
            continue
        decode = Layout(tp=width, ep=width if model.is_moe else 1, dp_attention=dpa,
                        replicas=workers)
        # The rows pair the low-concurrency pool (no DP attention) with one prefill worker.
        for n in (PREFILL_WORKERS if dpa else (1,)):
            prefill = Layout(tp=PREFILL_TP, ep=PREFILL_TP if model.is_moe else 1,
                             dp_attention=model.is_moe, replicas=n)
            layout = Disaggregated(prefill=prefill, decode=decode)
            if layout.chips <= chip.domain_size:
                out.append(layout)
    return tuple(out)


def drafts(model: Model) -> tuple[int, ...]:
    """MTP draft lengths tried: none, and `MTP_DRAFTS` where the model has an MTP head."""
    return (0,) + (MTP_DRAFTS if model.mtp_layers > 0 else ())


def design_of(model: Model, chip: Chip, config: Config, concurrency: float = 1.0) -> Design:
    """The `Design` of one configuration (FP4 weights, FP8 KV and attention, fitted
    dynamo-trt runtime, MTP as configured)."""
    prec = precision(chip, model, "fp4", kv="fp8")
    spec = SpecDecode(draft_tokens=float(config.draft_tokens),
                      acceptance=mtp_acceptance(FRAMEWORK))
    return Design(concurrency=concurrency, layout=config.layout, precision=prec,
                  runtime=runtime_for(FRAMEWORK), mapping=SliceMapping(), speculative=spec)


def _evaluate(model, chip, workload, design, layouts, concurrency, draft):
    # One vmapped predict over (layout, concurrency, draft length) points: the pools are
    # numbers (`Disaggregated.numbers`) and the draft length an array leaf, so every
    # configuration of the recipe shares one compiled kernel.
    def one(layout, c, k):
        d = eqx.tree_at(lambda x: (x.concurrency, x.speculative.draft_tokens),
                        dataclasses.replace(design, layout=layout), (c, k))
        return predict(model, chip, workload, d, hard=True, check=False,
                       unfit="value").to_row()

    return jax.vmap(one)(layouts, concurrency, draft)


# `QUICK_COMPILE`: the recipe's few dozen configurations run once; compiling is the cost.
_evaluate_jit = compiled.filter_jit(_evaluate, lambda: compiled.QUICK_COMPILE)


def recipe_points(model: Model, chip: Chip, workload: Workload, per_chip) -> dict:
    """Every fitting, finite point of the recipe's configurations at the given requests in
    flight per chip (each configuration at `per_chip` x its chips).

    Returns:
        {column: array} with the `serving.METRIC_KEYS` and the other `Metrics.to_row`
        columns, `chips` (chips of the point's configuration), `draft_tokens` and `labels`
        (a list: the configuration, `Config.describe`).
    """
    per_chip = np.asarray(sorted({float(x) for x in per_chip}), dtype=float)
    ks = np.asarray(drafts(model), dtype=float)
    configs = layouts(model, chip)
    if not configs:
        return {"labels": []}
    chips = np.asarray([layout.chips for layout in configs], dtype=float)
    # Points by configuration, then draft length, then concurrency.
    index, k, c = (a.ravel() for a in np.meshgrid(np.arange(len(configs)), ks, per_chip,
                                                   indexing="ij"))
    c = np.maximum(np.floor(c * chips[index]), 1.0)
    n = len(index)
    take = padded_take(n)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *[x.numbers() for x in configs])
    points = jax.tree.map(lambda x: jnp.asarray(x[index[take]]), stacked)
    values = _evaluate_jit(model, chip, workload, design_of(model, chip, Config(configs[0])),
                           points, jnp.asarray(c[take]), jnp.asarray(k[take]))
    values = {name: np.asarray(v)[:n] for name, v in values.items()}
    finite = np.all([np.isfinite(values[name]) for name in METRIC_KEYS], axis=0)
    # As the aggregated sweep: no more requests per decode worker than its KV holds.
    workers = np.asarray([layout.decode.replicas for layout in configs], dtype=float)[index]
    keep = values["fits"] & finite & (values["concurrency"] / workers
                                      <= values["max_batch"] * (1.0 + 1e-9))
    out = {name: v[keep] for name, v in values.items()}
    out["chips"] = chips[index][keep]
    out["draft_tokens"] = k[keep]
    out["labels"] = [Config(configs[i], int(d)).describe()
                     for i, d in zip(index[keep], k[keep], strict=True)]
    return out


#: The measured rows shipped with the repository (not with the package).
ROWS = pathlib.Path(__file__).resolve().parents[2] / "calibration" / "data" / \
    "benchmarks_inferencemax.csv"

_LOGGED = {"deepseek-r1": ("DeepSeek-R1", "DeepSeek-R1-0528")}


def is_recipe_row(model: str, chip: str, logged_model: str, hardware: str, framework: str,
                  precision: str, isl: float, osl: float) -> bool:
    """Whether a measured row (its logged model name, hardware, framework, precision and
    lengths) is one of `model`'s 8K/1K FP4 dynamo-trt rows on `chip`: the rows
    `measured_top` and `calibration/baseline_check.py` compare against."""
    return (logged_model in _LOGGED.get(model, (model,)) and hardware == chip
            and framework == FRAMEWORK and precision == "fp4"
            and (float(isl), float(osl)) == (8192.0, 1024.0))


def measured_top(model: str, chip: str = "gb200", path=ROWS) -> list[dict]:
    """The measured 8K/1K FP4 dynamo-trt rows at the top of the model's sweep on `chip`:
    for MTP and for no MTP, the row of the highest `tput_per_gpu` (every InferenceMAX
    series peaks at its highest tested concurrency). [] where the file or rows are missing.

    Returns:
        dicts: mtp (bool), conc, gpus, requests_per_gpu, tput_per_gpu, interactivity,
        layout (as logged: prefill workers x TP and decode TP), run_id.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        return []
    with path.open() as handle:
        rows = [r for r in csv.DictReader(handle)
                if is_recipe_row(model, chip, r["model"], r["hardware"], r["framework"],
                                 r["precision"], r["isl"], r["osl"])]
    out = []
    for mtp in (False, True):
        group = [r for r in rows if (r["spec_decoding"] != "none") == mtp]
        if not group:
            continue
        best = max(group, key=lambda r: float(r["tput_per_gpu"]))
        gpus = float(best["num_prefill_gpu"]) + float(best["num_decode_gpu"])
        out.append({"mtp": mtp, "conc": float(best["conc"]), "gpus": gpus,
                    "requests_per_gpu": float(best["conc"]) / gpus,
                    "tput_per_gpu": float(best["tput_per_gpu"]),
                    "interactivity": float(best["median_intvty_tok_s_user"]),
                    "layout": f"{int(float(best['prefill_num_workers']))}x prefill TP"
                              f"{int(float(best['prefill_tp']))} + decode TP"
                              f"{int(float(best['decode_tp']))}",
                    "run_id": best["run_id"]})
    return out


def check_top(model_name: str, chip: Chip, model: Model, workload: Workload,
              path=ROWS) -> list[dict]:
    """The recipe's best predicted point at each measured top (same MTP setting, at most
    the measured requests per GPU) beside the measured row: the baseline check.

    Returns:
        One dict per measured top row (`measured_top`) with the predicted configuration,
        throughput per GPU and interactivity and their ratios to the measured ones.
    """
    out = []
    for row in measured_top(model_name, chip.name, path):
        points = recipe_points(model, chip, workload, (row["requests_per_gpu"],))
        mtp = points["draft_tokens"] > 0
        ok = (mtp == row["mtp"]) & (points["concurrency"] / points["chips"]
                                    <= row["requests_per_gpu"] * (1.0 + 1e-9))
        best = int(np.argmax(np.where(ok, points["tput_per_chip_total"], -np.inf)))
        out.append({**{"measured_" + k: v for k, v in row.items()},
                    "predicted_config": points["labels"][best],
                    "predicted_tput_per_gpu": float(points["tput_per_chip_total"][best]),
                    "predicted_interactivity": float(points["interactivity"][best]),
                    "ratio_tput": float(points["tput_per_chip_total"][best])
                    / row["tput_per_gpu"],
                    "ratio_interactivity": float(points["interactivity"][best])
                    / row["interactivity"]})
    return out
