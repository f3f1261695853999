"""The Jalapeno-style comparison: one chip against a baseline on the same model and workload.

For each chip a sweep (`perfmodel.sweep.sweep`: every parallel layout of `chips` chips over a
concurrency grid) gives

- the peak-throughput point: throughput per chip, per kW of rated TDP (the normalisation of
  the reported comparison: Jalapeno 700 W, GB200 1,200 W, GB300 1,400 W), its end-to-end
  latency and interactivity (tokens/s/user). Two definitions (`PEAK_DEFINITIONS`):

  - "top" (default, as InferenceX defines it): the top of the chip's own concurrency sweep,
    the most throughput per chip over points of at most `top` requests in flight per chip.
    Every measured InferenceMAX series peaks at its highest tested concurrency, so the
    baseline's top is the requests per GPU of its measured peak (`GPU_TOP_CONCURRENCY`,
    cited there). Jalapeno's top is unknown (the reports give no concurrency); the rule
    (`JALAPENO_TOP`) is "same": the GPU's requests per chip, because the InferenceX harness
    runs one concurrency list on every chip (its single-node 8K/1K sweeps stop at 128
    requests on B200, MI355X and H200 alike), capped by the largest batch that fits.
    "interactivity" (the requests per chip whose per-user speed matches the GPU's at its
    top) and a number of requests per chip are the alternatives.
  - "floor": the most throughput per chip over points at or above `PEAK_MIN_INTERACTIVITY`
    tokens/s/user (the lowest interactivity in the shared InferenceMAX rows is 9.4).

- the low-concurrency point: the point of highest interactivity (one request per replica on
  the widest layout), its interactivity and end-to-end latency;
- the high-interactivity point: the most tokens/s per kW among points at or above an
  interactivity threshold, half of the lower of the two chips' best interactivity (the
  reports do not say which level they used; `threshold` overrides it).

Ratios are chip over baseline for throughput, baseline over chip for latency (how many
times lower). `consistency` adds the checks a reader needs to judge a reported pair: by
Little's law (requests in flight = throughput x E2E per request) the tokens/s per kW ratio
is the E2E ratio x the TDP ratio (baseline/chip) x the requests-per-chip ratio, so a pair
implies the requests per chip each side ran, and fixes which comparison definitions it
cannot have used. Two modes:

- predicted: Jalapeno from its reported specs (`data/chips.csv`, assumptions listed there)
  with the efficiencies and power coefficients fitted on GPUs; nothing tuned to the ratios.
- inferred: Jalapeno's fixed per-kernel and per-step costs, attention efficiency,
  achievable bandwidth fraction and per model its top concurrency fitted
  (`perfmodel.studies.inferred`: Levenberg-Marquardt on the log misses of every reported
  figure, J01-J09: the peak tokens/s per kW and E2E ratios, the per-user speeds at the
  low-concurrency point and the per-kW ratio at the high-interactivity point against their
  bands, with priors at the predicted-mode values) at the predicted points, the sweep re-run
  on the inferred chip and runtime at the fitted tops, refitted at the new points and
  re-run. The values, and how far the reported
  ratios identify each one (posterior against prior width), are reported.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import numpy as np

from ..design import Layout, Runtime
from ..hardware import Chip
from ..presets import get_chip, get_model
from ..progress import bar
from ..sweep import DEFAULT_GRID, Sweep, auto_chips, default_runtime, sweep
from ..workload import Workload
from .baseline import applies as recipe_applies
from .baseline import recipe_points
from .claims import (
    HIGH_INTERACTIVITY_CLAIM,
    PAIRS,
    SPEED_CLAIMS,
    claim_band,
    claim_checks,
    claim_keys,
    consistency,
    reported_ratios,
)
from .inferred import PointTarget, Target, infer


@dataclasses.dataclass(frozen=True)
class ChipPoints:
    """Operating points of one chip's sweep (see the module docstring)."""

    chip: str
    chips: int
    tdp_w: float
    peak_tput_per_chip: float
    peak_tok_s_per_kw: float
    peak_e2e_s: float
    peak_interactivity: float
    peak_layout: str
    peak_concurrency: float
    low_interactivity: float
    low_e2e_s: float
    low_layout: str
    max_interactivity: float
    sweep: Sweep = dataclasses.field(repr=False, compare=False)
    peak_ttft_s: float = float("nan")
    peak_chips: int = 0
    """Chips of the peak point's deployment (the sweep's, or a recipe configuration's)."""
    points: dict | None = dataclasses.field(default=None, repr=False, compare=False)
    """Every point the operating points were chosen from, when more than the sweep's
    (the GPU recipe's, `perfmodel.studies.baseline`)."""

    def high_interactivity_tok_s_per_kw(self, threshold: float) -> float:
        v = self.points if self.points is not None else self.sweep.values
        ok = v["interactivity"] >= threshold
        return float(np.max(v["tok_s_per_kw_tdp"][ok])) if ok.any() else float("nan")

    def high_interactivity_point(self, threshold: float) -> tuple[str, float] | None:
        """(layout, concurrency per replica) of the sweep's high-interactivity point (the
        most tokens/s per kW at or above `threshold` tokens/s/user), or None (no point
        reaches it, or the points are not the sweep's alone)."""
        if self.points is not None:
            return None
        v = self.sweep.values
        ok = v["interactivity"] >= threshold
        if not ok.any():
            return None
        best = int(np.argmax(np.where(ok, v["tok_s_per_kw_tdp"], -np.inf)))
        layout = self.sweep.layouts[int(self.sweep.layout_index[best])]
        return layout.describe(), float(v["concurrency"][best]) / layout.replicas


#: Interactivity floor of the "floor" peak definition (tokens/s/user).
PEAK_MIN_INTERACTIVITY = 10.0

#: Definitions of the peak-throughput point (see the module docstring).
PEAK_DEFINITIONS = ("top", "floor")

#: The widest deployment of the compared chip's sweep (chips): Jalapeno's local network
#: (shared/data/jalapeno_claims.csv J17), where layouts up to tp = ep = 128 are priced by the
#: collective algorithm selection.
WIDE_CHIPS = 128

#: Rules for Jalapeno's top concurrency (a number of requests per chip is also accepted).
JALAPENO_TOP_RULES = ("same", "interactivity")

#: The default rule for Jalapeno's top concurrency (see the module docstring).
JALAPENO_TOP = "same"

#: The top of the baseline GPU's InferenceX sweep at 8K/1K: (requests in flight per GPU,
#: source). Each is the requests per GPU of the highest `tput_per_gpu` among the model's
#: 8K/1K FP4 rows without speculative decoding in shared/data/benchmarks_inferencemax.csv
#: (columns conc / (num_prefill_gpu + num_decode_gpu)); the rows hold GB200 but no GB300,
#: so GB200's top stands in for GB300's (tests/test_compare.py re-derives these values).
GPU_TOP_CONCURRENCY = {
    "gpt-oss-120b": (128.0, "InferenceMAX runs 20737128080, 20742072203, 20764588467: GB200 "
                            "dynamo-trt FP4, 2 prefill workers + 1 decode worker (TP2), 4 GPUs "
                            "at conc 512"),
    "deepseek-r1": (2150.0 / 28.0, "InferenceMAX runs 20321908209, 20356790608: GB200 "
                                   "DeepSeek-R1-0528 dynamo-trt FP4 no MTP, 5 prefill workers "
                                   "(TP4) + 1 decode worker (TP8 EP8), 28 GPUs at conc 2150"),
    "kimi-k2.5": (2150.0 / 28.0, "no Kimi-K2.5 rows: DeepSeek-R1's GB200 top (same "
                                 "DeepSeek-V3 architecture), runs 20321908209, 20356790608"),
}

#: Requests per GPU where a model has no InferenceMAX rows: the top of the single-node 8K/1K
#: sweeps (conc 4..128 on one server; 128 per GPU at TP1, e.g. gpt-oss-120b B200 vLLM/TRT).
GPU_TOP_DEFAULT = (128.0, "InferenceMAX single-node 8K/1K sweeps stop at conc 128 (TP1: 128 "
                          "per GPU), e.g. run 20218553330")


def gpu_top_concurrency(model: str) -> tuple[float, str]:
    """(requests in flight per GPU at the top of InferenceX's sweep, source) for a model."""
    return GPU_TOP_CONCURRENCY.get(get_model(model).name, GPU_TOP_DEFAULT)


def top_grid(grid, chips: int, top: float) -> tuple[float, ...]:
    """`grid` (per replica) plus the concurrency per replica of `top` requests per chip for
    every power-of-two replica size up to `chips`, so each layout's sweep reaches the top."""
    extra, size = [], 1
    while size <= chips:
        extra.append(float(np.floor(top * size)))
        size *= 2
    return tuple(sorted({float(g) for g in grid} | {e for e in extra if e >= 1.0}))


def chip_points(model: str, chip: Chip, workload: Workload, chips: int | None = None,
                grid=DEFAULT_GRID, peak: str = "floor",
                min_interactivity: float = PEAK_MIN_INTERACTIVITY,
                top: float | None = None, runtime: Runtime | None = None) -> ChipPoints:
    """Sweep one chip and pick its peak-throughput and low-concurrency points.

    Args:
        peak: "floor" (the most throughput at or above `min_interactivity` tokens/s/user) or
            "top" (the most throughput at or below `top` requests in flight per chip; the
            grid is extended to reach it).
        runtime: serving-runtime settings (default: `sweep.default_runtime`).
    """
    if peak not in PEAK_DEFINITIONS:
        raise ValueError(f"peak {peak!r}: valid definitions are {PEAK_DEFINITIONS}")
    if peak == "top" and not (top is not None and np.isfinite(top) and top > 0):
        raise ValueError(f"top {top!r}: the top concurrency must be a positive number of "
                         "requests per chip")
    m = get_model(model)
    fmt = "fp4"
    if chips is None:
        chips = max(8, auto_chips(m, chip, fmt, float(workload.input_len),
                                  float(workload.output_len)))
    if peak == "top":
        grid = top_grid(grid, chips, top)
    s = sweep(m, chip, workload, chips=chips, precision=fmt, grid=grid, runtime=runtime,
              jit=True, progress=False)
    labels = [s.layouts[int(i)].describe() for i in s.layout_index]
    return _choose(chip, int(chips), s, s.values, np.full(len(labels), float(chips)), labels,
                   peak, min_interactivity, top)


def _choose(chip: Chip, chips: int, s: Sweep, v: dict, point_chips, labels, peak,
            min_interactivity, top, points=None) -> ChipPoints:
    """The operating points of `ChipPoints` among points `v` (each of `point_chips` chips,
    described by `labels`)."""
    if peak == "top":
        usable = v["concurrency"] / point_chips <= top * (1.0 + 1e-9)
    else:
        usable = v["interactivity"] >= min_interactivity
    if not usable.any():   # a chip that never reaches the floor or the cap: its best point
        usable = np.ones_like(usable)
    best = int(np.argmax(np.where(usable, v["tput_per_chip_total"], -np.inf)))
    low = int(np.argmax(v["interactivity"]))
    return ChipPoints(
        chip=chip.name, chips=int(chips), tdp_w=float(chip.tdp),
        peak_tput_per_chip=float(v["tput_per_chip_total"][best]),
        peak_tok_s_per_kw=float(v["tok_s_per_kw_tdp"][best]),
        peak_e2e_s=float(v["e2e_s"][best]), peak_interactivity=float(v["interactivity"][best]),
        peak_layout=labels[best], peak_concurrency=float(v["concurrency"][best]),
        low_interactivity=float(v["interactivity"][low]), low_e2e_s=float(v["e2e_s"][low]),
        low_layout=labels[low], max_interactivity=float(np.max(v["interactivity"])), sweep=s,
        peak_ttft_s=float(v["ttft_s"][best]), peak_chips=int(point_chips[best]),
        points=points)


#: Requests in flight per chip at which the GPU recipe is evaluated besides the top: the
#: low-concurrency and high-interactivity points (powers of two, 1/32 to 64).
RECIPE_GRID = tuple(2.0**k for k in range(-5, 7))


def baseline_points(model: str, chip: Chip, workload: Workload, chips: int | None = None,
                    grid=DEFAULT_GRID, peak: str = "floor",
                    min_interactivity: float = PEAK_MIN_INTERACTIVITY,
                    top: float | None = None, recipe: bool = True) -> ChipPoints:
    """`chip_points` of a GPU baseline, its points taken from its aggregated sweep and, for
    the models InferenceMAX serves with the Dynamo + TensorRT-LLM recipe
    (`baseline.applies`), from that recipe's configurations too (`baseline.recipe_points`:
    disaggregated, wide EP, MTP, FP8 attention, the fitted dynamo-trt runtime, up to the
    NVL72 domain). The peak is then the best predicted point of either under the same
    definition; `recipe=False` keeps the sweep alone."""
    base = chip_points(model, chip, workload, chips, grid, peak=peak,
                       min_interactivity=min_interactivity, top=top)
    m = get_model(model)
    if not (recipe and recipe_applies(m)):
        return base
    extra = recipe_points(m, chip, workload, RECIPE_GRID + ((top,) if top else ()))
    if not extra["labels"]:
        return base
    v = base.sweep.values
    keys = [k for k in v if k in extra]
    merged = {k: np.concatenate([v[k], extra[k]]) for k in keys}
    n = len(v["concurrency"])
    point_chips = np.concatenate([np.full(n, float(base.chips)), extra["chips"]])
    labels = [base.sweep.layouts[int(i)].describe() for i in base.sweep.layout_index] \
        + extra["labels"]
    return _choose(chip, base.chips, base.sweep, merged, point_chips, labels, peak,
                   min_interactivity, top, points=merged)


def compared_chips(model: str, chip: Chip, workload: Workload, chips: int | None = None,
                   wide: int = WIDE_CHIPS) -> int:
    """Chips of the compared chip's sweep: `chips` when given, else the largest power of two
    within min(`wide`, the chip's scale-up domain), and at least max(8, the smallest count
    that holds the model), so its widest layouts reach its local network.

    Example:
        >>> from perfmodel.presets import get_chip
        >>> compared_chips("deepseek-r1", get_chip("jalapeno"), Workload(8192, 1024))
        128
    """
    if chips is not None:
        return chips
    need = auto_chips(get_model(model), chip, "fp4", float(workload.input_len),
                      float(workload.output_len))
    reach = 1 << (min(int(wide), chip.domain_size).bit_length() - 1)
    return max(8, need, reach)


def _row(model, mode, a: ChipPoints, b: ChipPoints, threshold, extra) -> dict:
    hi_a = a.high_interactivity_tok_s_per_kw(threshold)
    hi_b = b.high_interactivity_tok_s_per_kw(threshold)
    row = {"model": model, "chip": a.chip, "baseline": b.chip, "mode": mode,
           "chips": a.chips, "baseline_chips": b.chips,
           "tdp_w": a.tdp_w, "baseline_tdp_w": b.tdp_w,
           "output_len": float(a.sweep.output_len),
           "requests_per_chip_at_peak": a.peak_concurrency / (a.peak_chips or a.chips),
           "baseline_requests_per_chip_at_peak": b.peak_concurrency / (b.peak_chips or b.chips),
           "baseline_chips_at_peak": b.peak_chips or b.chips,
           "baseline_ttft_s_at_peak": b.peak_ttft_s,
           "peak_tput_per_chip": a.peak_tput_per_chip,
           "baseline_peak_tput_per_chip": b.peak_tput_per_chip,
           "peak_tok_s_per_kw": a.peak_tok_s_per_kw,
           "baseline_peak_tok_s_per_kw": b.peak_tok_s_per_kw,
           "e2e_s_at_peak": a.peak_e2e_s, "baseline_e2e_s_at_peak": b.peak_e2e_s,
           "interactivity_at_peak": a.peak_interactivity,
           "baseline_interactivity_at_peak": b.peak_interactivity,
           "interactivity_low_concurrency": a.low_interactivity,
           "baseline_interactivity_low_concurrency": b.low_interactivity,
           "e2e_s_low_concurrency": a.low_e2e_s,
           "baseline_e2e_s_low_concurrency": b.low_e2e_s,
           "layout_at_peak": a.peak_layout, "baseline_layout_at_peak": b.peak_layout,
           "high_interactivity_threshold": threshold,
           "ratio_tok_s_per_chip_at_peak": a.peak_tput_per_chip / b.peak_tput_per_chip,
           "ratio_tok_s_per_kw_at_peak": a.peak_tok_s_per_kw / b.peak_tok_s_per_kw,
           "ratio_e2e_latency": b.peak_e2e_s / a.peak_e2e_s,
           "ratio_e2e_latency_low_concurrency": b.low_e2e_s / a.low_e2e_s,
           "ratio_tok_s_per_kw_high_interactivity": hi_a / hi_b,
           "ratio_interactivity_low_concurrency": a.low_interactivity / b.low_interactivity}
    row.update(extra)
    return row


def _unmet(fit, model: str, row: dict) -> str:
    """Why each of the row's claims missed by more than `CLAIM_TOLERANCE` is missed
    ("; "-joined; "" when all are met): the fit's reason (`Inference.unmet`), or, where the
    fit met it at its points, that the re-sweep moved the operating point."""
    reasons = []
    for claim in claim_keys(model):
        if row.get(f"claim_{claim}_within_15pct", True):
            continue
        key = claim if claim in fit.claims else f"{claim} {model}"
        reason = fit.unmet(key)
        if not reason:
            reason = (f"{key}: met at the fit's points, missed after the re-sweep moved the "
                      "operating point" if key in fit.claims else
                      f"{key}: not fitted (no point of the sweep reaches it)")
        value = row[f"claim_{claim}_value"]
        reasons.append(f"{reason} (value {value:.3g}, reported "
                       f"{row[f'claim_{claim}_reported']})")
    return "; ".join(reasons)


def _each(fn, items) -> list:
    """[fn(item) for item in items], one thread per core.

    Each item is a sweep (or two) whose kernel compiles for seconds: XLA compiles without
    holding Python's lock and runs a CPU kernel on the calling thread, so on two cores one
    sweep traces while the other compiles or runs. Each kernel is the same as run alone;
    the results come back in the items' order."""
    items = list(items)
    workers = min(len(items), os.cpu_count() or 1)
    if workers <= 1:
        return [fn(i) for i in items]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def compare(models=None, chip: str = "jalapeno", baselines=None, isl: int = 8192,
            osl: int = 1024, reported: bool = False, modes=("predicted", "inferred"),
            chips: int | None = None, grid=DEFAULT_GRID, threshold: float | None = None,
            infer_steps: int = 400, progress: bool | None = None, peak: str = "top",
            chip_top: str | float = JALAPENO_TOP, recipe: bool = True,
            wide: int = WIDE_CHIPS, throw: bool = True) -> list[dict]:
    """Compare a chip with baselines on models (defaults: the three reported pairs).

    Args:
        models: model names (default: gpt-oss-120b, deepseek-r1, kimi-k2.5).
        chip: the chip compared (default jalapeno).
        baselines: one baseline per model (default: the reported pair's, GB200 or GB300).
        isl, osl: input and output lengths (tokens).
        reported: add the reported ratios beside the predicted ones.
        modes: "predicted" and/or "inferred".
        chips: chips per deployment (default: the baselines max(8, the smallest count that
            holds it); the compared chip as many as `wide` allows).
        grid: concurrencies per replica of the sweeps.
        threshold: interactivity of the high-interactivity point (tokens/s/user).
        infer_steps: Levenberg-Marquardt steps at most of each inferred fit.
        peak: the peak definition, "top" (InferenceX's: the top of each chip's concurrency
            sweep) or "floor" (the most throughput at or above `PEAK_MIN_INTERACTIVITY`).
        chip_top: with peak "top", the compared chip's top concurrency: "same" (the
            baseline's requests per chip), "interactivity" (the requests per chip whose
            interactivity matches the baseline's at its top: its best throughput at or
            above that interactivity) or a number of requests per chip.
        progress: a bar over the sweeps and fits on standard error (`perfmodel.progress`;
            None: on a terminal).
        recipe: add the InferenceMAX Dynamo + TensorRT-LLM configurations to the GPU
            baselines of the models it applies to (`baseline_points`).
        wide: the compared chip's sweep covers min(`wide`, its scale-up domain) chips (at
            least the baselines' count), so layouts up to that width are considered (its
            local network: Jalapeno's 128 chips, priced by the collective selection of
            `perfmodel.interconnect`).
        throw: raise when an inferred fit does not succeed (`inferred.infer`); otherwise
            its rows carry the result's message in `inferred_result`.

    Returns:
        One dict per (model, chip, baseline, mode), with the keys of the module docstring
        (`ratio_tok_s_per_kw_at_peak`, `ratio_e2e_latency`,
        `ratio_tok_s_per_kw_high_interactivity`, `interactivity_low_concurrency`, ...), the
        peak definition (`peak_definition`, `baseline_top_requests_per_chip` with its
        `baseline_top_source`, `chip_top_rule`, `chip_top_requests_per_chip`), the
        `consistency` checks, the reported ratios with `reported`, and in inferred mode per
        fitted parameter (`inferred.INFERRED`) `inferred_<name>` (its value, s or a
        fraction), `inferred_<name>_prior_width`, `_posterior_width`, `_width_ratio` and
        `_identified` (`inferred.Inference.report`), with `inferred_hbm_tb_s_achievable`,
        `inferred_loss`, `inferred_steps` and `inferred_result`; per row its fitted top
        `inferred_top_requests_per_chip` (with `_prior`, widths and `_identified`,
        `Inference.report_top`) and `inferred_unmet` (why each figure missed by more than
        15 % is missed, `Inference.unmet`; "" when all are met). With `reported`, every
        row has per claim it evaluates (`claim_checks`: J01-J06 of its pair, J07, its
        speed claim J08 or J09) `claim_<id>_value`, `claim_<id>_reported` and
        `claim_<id>_within_15pct`.

    Raises:
        ValueError: unknown names, modes, peak definitions or top rules, or baselines not
            matching models.
        RuntimeError: with `throw`, an inferred fit did not succeed.

    Example (not run as a doctest: its two sweeps compile for about 20 s, and
    tests/test_compare.py runs the same call):
        >>> rows = compare(["gpt-oss-120b"], modes=("predicted",), grid=(1., 64.),
        ...                chips=8)  # doctest: +SKIP
        >>> [(r["chip"], r["baseline"], r["mode"]) for r in rows]  # doctest: +SKIP
        [('jalapeno', 'gb200', 'predicted')]
    """
    models = list(models) if models else [p[0] for p in PAIRS]
    if peak not in PEAK_DEFINITIONS:
        raise ValueError(f"peak {peak!r}: valid definitions are {PEAK_DEFINITIONS}")
    if isinstance(chip_top, str) and chip_top not in JALAPENO_TOP_RULES:
        raise ValueError(f"chip_top {chip_top!r}: valid rules are {JALAPENO_TOP_RULES} or a "
                         "number of requests per chip")
    if not isinstance(chip_top, str) and not (np.isfinite(chip_top) and chip_top > 0):
        raise ValueError(f"chip_top {chip_top!r}: requests per chip must be positive")
    if isinstance(wide, bool) or not isinstance(wide, (int, np.integer)) or wide < 1:
        raise ValueError(f"wide {wide!r}: the widest deployment must be a positive number of "
                         "chips")
    for mode in modes:
        if mode not in ("predicted", "inferred"):
            raise ValueError(f"mode {mode!r}: valid modes are 'predicted' and 'inferred'")
    if baselines is None:
        pairs = {p[0]: p[1] for p in PAIRS}
        baselines = [pairs.get(get_model(m).name, "gb200") for m in models]
    baselines = list(baselines)
    if len(baselines) == 1 and len(models) > 1:
        baselines = baselines * len(models)
    if len(baselines) != len(models):
        raise ValueError(f"{len(baselines)} baselines for {len(models)} models: give one, or "
                         "one per model")
    workload = Workload(float(isl), float(osl))
    target = get_chip(chip)
    models = [get_model(m).name for m in models]
    inferring = "inferred" in modes and any(reported_ratios(m) for m in models)
    # Two sweeps per model, and in inferred mode two fits each followed by a sweep per model.
    steps = 2 * len(models) + (2 * (1 + len(models)) if inferring else 0)
    shown = bar(steps, f"{chip} vs {', '.join(dict.fromkeys(baselines))}", progress,
                unit="sweep")

    def base_of(m, c):
        top, _ = gpu_top_concurrency(m)
        result = baseline_points(m, c, workload, chips, grid, peak=peak, top=top,
                                 recipe=recipe)
        shown.update(1)
        return result

    def points_of(m, c, runtime=None, fitted_top=None):
        n = compared_chips(m, c, workload, chips, wide)
        if fitted_top is not None:
            result = chip_points(m, c, workload, n, grid, peak="top", top=fitted_top,
                                 runtime=runtime)
        elif peak == "floor":
            result = chip_points(m, c, workload, n, grid, peak="floor", runtime=runtime)
        elif chip_top == "interactivity":
            result = chip_points(m, c, workload, n, grid, peak="floor",
                                 min_interactivity=base_points[m].peak_interactivity,
                                 runtime=runtime)
        else:
            top = gpu_top_concurrency(m)[0] if chip_top == "same" else float(chip_top)
            result = chip_points(m, c, workload, n, grid, peak="top", top=top,
                                 runtime=runtime)
        shown.update(1)
        return result

    def definition(m):
        if peak == "floor":
            return {"peak_definition": f"floor: most tok/s/chip at >= "
                                       f"{PEAK_MIN_INTERACTIVITY:g} tok/s/user"}
        top, source = gpu_top_concurrency(m)
        if chip_top == "same":
            rule = "same requests per chip as the baseline's top (one InferenceX list)"
            chip_value = top
        elif chip_top == "interactivity":
            rule = "the baseline's interactivity at its top"
            chip_value = float("nan")
        else:
            rule, chip_value = "given", float(chip_top)
        return {"peak_definition": "top: the top of each chip's concurrency sweep",
                "baseline_top_requests_per_chip": top, "baseline_top_source": source,
                "chip_top_rule": rule, "chip_top_requests_per_chip": chip_value}

    base_points = {}

    def both(m, b):
        # The chip's sweep may read its baseline's peak (`chip_top="interactivity"`).
        base_points[m] = base_of(m, get_chip(b))
        return points_of(m, target)

    predicted = dict(zip(models, _each(lambda mb: both(*mb),
                                       zip(models, baselines, strict=True)), strict=True))
    out = []

    def threshold_of(m, points):
        return threshold if threshold is not None else \
            0.5 * min(points[m].max_interactivity, base_points[m].max_interactivity)

    def emit(mode, points, extra, per_model=None, fit=None):
        for m in models:
            a, b = points[m], base_points[m]
            row = _row(m, mode, a, b, threshold_of(m, points), extra)
            row.update(definition(m))
            row.update((per_model or {}).get(m, {}))
            if reported:
                rep = reported_ratios(m)
                if rep and rep["baseline"] == b.chip:
                    row.update({k: v for k, v in rep.items() if k != "baseline"})
                    row.update(claim_checks(row))
            row.update(consistency(row))
            if fit is not None and reported:
                row["inferred_unmet"] = _unmet(fit, m, row)
            out.append(row)

    if "predicted" in modes:
        emit("predicted", predicted, {})
    if "inferred" in modes:
        # The predicted top (requests per chip) is the prior centre of each fitted top; the
        # "interactivity" rule and the floor peak have none, and their tops are not fitted.
        fit_tops = peak == "top" and chip_top != "interactivity"

        def fitted_models():
            return [m for m in models if reported_ratios(m)
                    and reported_ratios(m)["baseline"] == base_points[m].chip]

        def targets_at(points):
            targets, extra = [], []
            for m in fitted_models():
                rep = reported_ratios(m)
                layout = Layout.parse(points[m].peak_layout)
                top = definition(m)["chip_top_requests_per_chip"] if fit_tops \
                    else float("nan")
                claims = rep["reported_claims"].split(",")
                targets.append(Target(
                    m, layout, concurrency=points[m].peak_concurrency / layout.replicas,
                    baseline_kw=base_points[m].peak_tok_s_per_kw,
                    baseline_e2e=base_points[m].peak_e2e_s,
                    reported_kw=rep["reported_ratio_tok_s_per_kw_at_peak"],
                    reported_e2e=rep["reported_ratio_e2e_latency"], top=top,
                    claims=(claims[0], claims[1])))
                if m in SPEED_CLAIMS:
                    # One request on one replica of the sweep's low-concurrency layout.
                    extra.append(PointTarget(
                        f"{SPEED_CLAIMS[m]} {m}", m, Layout.parse(points[m].low_layout), 1.0,
                        "interactivity", 1.0, *claim_band(SPEED_CLAIMS[m])))
                hi = points[m].high_interactivity_point(threshold_of(m, points))
                base_hi = base_points[m].high_interactivity_tok_s_per_kw(
                    threshold_of(m, points))
                if hi is not None and np.isfinite(base_hi):
                    extra.append(PointTarget(
                        f"{HIGH_INTERACTIVITY_CLAIM} {m}", m, Layout.parse(hi[0]), hi[1],
                        "tok_s_per_kw", base_hi, *claim_band(HIGH_INTERACTIVITY_CLAIM)))
            return targets, extra

        targets, extra_points = targets_at(predicted)
        if targets:
            # Fit at the predicted chip's points, re-sweep at the fitted tops, refit at the
            # new points (the prior stays at the predicted chip and top), re-sweep.
            runtime = default_runtime(target)
            fit = infer(target, runtime, targets, workload, points=extra_points,
                        max_steps=infer_steps, throw=throw)
            shown.update(1)

            def resweep(fit):
                tops = dict(zip(fitted_models(), fit.params.tops(), strict=False))
                return dict(zip(models, _each(
                    lambda m: points_of(m, fit.chip, fit.runtime, tops.get(m)), models),
                    strict=True))

            points = resweep(fit)
            targets, extra_points = targets_at(points)
            fit = infer(target, runtime, targets, workload, points=extra_points,
                        start=fit.params, max_steps=infer_steps, throw=throw)
            shown.update(1)
            points = resweep(fit)
            extra = fit.report()
            extra["inferred_hbm_tb_s_achievable"] = (
                extra["inferred_bandwidth_max"] * float(target.hbm_bandwidth) / 1e12)
            extra["inferred_steps"] = int(fit.steps)
            per_model = {m: fit.report_top(i) for i, m in enumerate(fitted_models())}
            emit("inferred", points, extra, per_model, fit)
    shown.close()
    return out
