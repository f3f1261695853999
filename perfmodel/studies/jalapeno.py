"""The Jalapeno-style comparison: one chip against a baseline on the same model and workload.

For each chip a sweep (`perfmodel.sweep.sweep`: every parallel layout of `chips` chips over a
concurrency grid) gives

- the peak-throughput point: throughput per chip, per kW of rated TDP (the normalisation of
  the reported comparison: Jalapeno 700 W, GB200 1,200 W, GB300 1,400 W), its end-to-end
  latency and interactivity (tokens/s/user), over the points at or above
  `PEAK_MIN_INTERACTIVITY` (InferenceX's sweeps stop there: the lowest interactivity in the
  shared InferenceMAX rows is 9.4 tokens/s/user; past it the model's throughput keeps
  creeping up at minutes of latency that no benchmark measures);
- the low-concurrency point: the point of highest interactivity (one request per replica on
  the widest layout), its interactivity and end-to-end latency;
- the high-interactivity point: the most tokens/s per kW among points at or above an
  interactivity threshold, half of the lower of the two chips' best interactivity (the
  reports do not say which level they used; `threshold` overrides it).

Ratios are chip over baseline for throughput, baseline over chip for latency (how many
times lower). Two modes:

- predicted: Jalapeno from its reported specs (`data/chips.csv`, assumptions listed there)
  with the efficiencies and power coefficients fitted on GPUs; nothing tuned to the ratios.
- inferred: Jalapeno's unknown parameters (achievable HBM bandwidth fraction, HBM capacity,
  slice count, matmul efficiency) fitted by gradient descent (optax Adam in log space) so
  that the predicted peak tokens/s per kW and E2E ratios match the reported ones, then the
  same sweep re-run on the inferred chip. The values they take are reported.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
from importlib import resources

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..design import Design, Layout
from ..hardware import Chip
from ..kvcache import max_batch
from ..presets import get_chip, get_model
from ..progress import bar
from ..serving import predict
from ..smooth import smooth_min
from ..solvers import value_and_grad_forward
from ..sweep import DEFAULT_GRID, Sweep, auto_chips, default_runtime, sweep
from ..workload import Workload

#: The reported pairs (shared/data/jalapeno_claims.csv J01-J06): model, baseline, and the
#: claim ids of tokens/s per kW at peak throughput and of the E2E latency ratio.
PAIRS = (("gpt-oss-120b", "gb200", "J01", "J02"),
         ("deepseek-r1", "gb300", "J03", "J04"),
         ("kimi-k2.5", "gb300", "J05", "J06"))

#: Jalapeno parameters the inferred mode fits, as paths into `Chip`.
INFERRED = ("efficiency.bandwidth_max", "hbm_capacity", "num_slices", "efficiency.compute_max")


@functools.cache
def reported_claims() -> dict[str, dict]:
    """The claims file shipped with the package (`data/jalapeno_claims.csv`), by claim id."""
    text = resources.files("perfmodel").joinpath("data", "jalapeno_claims.csv").read_text()
    return {row["claim_id"]: row for row in csv.DictReader(text.splitlines())}


def reported_ratios(model: str) -> dict:
    """Reported (tokens/s per kW at peak, E2E latency) ratios of a model's pair, or {}."""
    claims = reported_claims()
    for name, baseline, kw_id, e2e_id in PAIRS:
        if name == model:
            return {"baseline": baseline,
                    "reported_ratio_tok_s_per_kw_at_peak": float(claims[kw_id]["value"]),
                    "reported_ratio_e2e_latency": float(claims[e2e_id]["value"]),
                    "reported_ratio_tok_s_per_kw_high_interactivity": claims["J07"]["value"],
                    "reported_claims": f"{kw_id},{e2e_id},J07"}
    return {}


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

    def high_interactivity_tok_s_per_kw(self, threshold: float) -> float:
        v = self.sweep.values
        ok = v["interactivity"] >= threshold
        return float(np.max(v["tok_s_per_kw_tdp"][ok])) if ok.any() else float("nan")


#: Interactivity floor of the peak-throughput point (tokens/s/user); see the module docstring.
PEAK_MIN_INTERACTIVITY = 10.0


def chip_points(model: str, chip: Chip, workload: Workload, chips: int | None = None,
                grid=DEFAULT_GRID,
                min_interactivity: float = PEAK_MIN_INTERACTIVITY) -> ChipPoints:
    """Sweep one chip and pick its peak-throughput (at or above `min_interactivity`) and
    low-concurrency points."""
    m = get_model(model)
    fmt = "fp4"
    if chips is None:
        chips = max(8, auto_chips(m, chip, fmt, float(workload.input_len),
                                  float(workload.output_len)))
    s = sweep(m, chip, workload, chips=chips, precision=fmt, grid=grid, progress=False)
    v = s.values
    usable = v["interactivity"] >= min_interactivity
    if not usable.any():   # a chip that never reaches the floor: its best point
        usable = np.ones_like(usable)
    peak = int(np.argmax(np.where(usable, v["tput_per_chip_total"], -np.inf)))
    low = int(np.argmax(v["interactivity"]))
    layout = lambda i: s.layouts[int(s.layout_index[i])].describe()
    return ChipPoints(
        chip=chip.name, chips=int(chips), tdp_w=float(chip.tdp),
        peak_tput_per_chip=float(v["tput_per_chip_total"][peak]),
        peak_tok_s_per_kw=float(v["tok_s_per_kw_tdp"][peak]),
        peak_e2e_s=float(v["e2e_s"][peak]), peak_interactivity=float(v["interactivity"][peak]),
        peak_layout=layout(peak), peak_concurrency=float(v["concurrency"][peak]),
        low_interactivity=float(v["interactivity"][low]), low_e2e_s=float(v["e2e_s"][low]),
        low_layout=layout(low), max_interactivity=float(np.max(v["interactivity"])), sweep=s)


def _row(model, mode, a: ChipPoints, b: ChipPoints, threshold, extra) -> dict:
    hi_a = a.high_interactivity_tok_s_per_kw(threshold)
    hi_b = b.high_interactivity_tok_s_per_kw(threshold)
    row = {"model": model, "chip": a.chip, "baseline": b.chip, "mode": mode,
           "chips": a.chips, "baseline_chips": b.chips,
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


def _get(chip, path):
    node = chip
    for part in path.split("."):
        node = getattr(node, part)
    return node


def _set(chip: Chip, values: dict) -> Chip:
    for path, value in values.items():
        chip = eqx.tree_at(lambda c, p=path: _get(c, p), chip, jnp.asarray(value, dtype=float))
    return chip


def _peak_metrics(model_name, chip: Chip, layout: Layout, workload: Workload, runtime,
                  concurrency):
    """Differentiable peak point: throughput per kW and E2E of one replica of the sweep's
    peak layout at the sweep's peak concurrency per replica (capped by the batch that fits,
    as the chip's parameters move). By the envelope theorem the gradient of the sweep's
    maximum is the gradient at its maximiser, so between re-sweeps this point stands in for
    the peak."""
    model = get_model(model_name)
    from ..design import precision
    prec = precision(chip, model, "fp4")
    single = dataclasses.replace(layout, replicas=1)
    context = workload.mean_input_len + workload.mean_output_len / 2.0
    fit = max_batch(model, single, prec, chip.hbm_capacity, context, runtime.memory_fraction,
                    runtime.activation_reserve, None, chip.num_slices)
    conc = smooth_min(jnp.maximum(fit, 1.0), concurrency)
    design = Design(concurrency=conc, layout=single, precision=prec, runtime=runtime)
    m = predict(model, chip, workload, design, check=False, unfit="value")
    return m.tok_s_per_kw_tdp, m.e2e


def infer(chip: Chip, targets: list[dict], workload: Workload, steps: int = 60,
          learning_rate: float = 0.05) -> tuple[Chip, dict]:
    """Fit `INFERRED` parameters of `chip` to reported ratios by gradient descent.

    Args:
        chip: the predicted-mode chip (the start).
        targets: one dict per model: model, layout (its predicted peak layout), baseline
            peak tok/s per kW and E2E (fixed), reported ratios.
        workload: request lengths.
        steps, learning_rate: Adam settings (log space).

    Returns:
        (inferred chip, {"values": {path: value}, "loss": final, "result": 0 converged, 1 step
        limit, 2 stopped at a non-finite loss or gradient}).
    """
    start = {p: jnp.log(jnp.asarray(_get(chip, p), dtype=float)) for p in INFERRED}
    runtime = default_runtime(chip)

    def penalty(logs):
        # Weak pull to the reported specs; efficiency fractions kept at or below 1.
        prior = sum((logs[p] - start[p]) ** 2 for p in INFERRED) * 1e-2
        over = sum(jax.nn.relu(logs[p]) ** 2 for p in INFERRED if p.startswith("efficiency"))
        return prior + 10.0 * over

    # One compiled gradient per model (a joint trace of all models compiles far slower).
    grads_of = [value_and_grad_forward(functools.partial(
        claim_loss, t=t, chip=chip, workload=workload, runtime=runtime)) for t in targets]
    penalty_grad = jax.jit(jax.value_and_grad(penalty))
    optimizer = optax.adam(learning_rate)
    logs, state = start, optimizer.init(start)
    history, result = [], None
    for _ in range(steps):
        value, grads = penalty_grad(logs)
        for grad_of in grads_of:
            v, g = grad_of(logs)
            value = value + v
            grads = jax.tree.map(jnp.add, grads, g)
        if not all(bool(jnp.isfinite(x)) for x in jax.tree.leaves((value, grads))):
            result = 2      # keep the last finite parameters; never a silent NaN
            break
        updates, state = optimizer.update(grads, state, logs)
        logs = optax.apply_updates(logs, updates)
        history.append(float(value))
    values = {p: float(jnp.exp(v)) for p, v in logs.items()}
    for p in INFERRED:
        if p.startswith("efficiency"):
            values[p] = min(values[p], 1.0)
    if result is None:
        result = 0 if len(history) > 10 and abs(history[-10] - history[-1]) < 1e-3 else 1
    loss = history[-1] if history else float("nan")
    return _set(chip, values), {"values": values, "loss": loss, "result": result}


def claim_loss(logs, t, chip, workload, runtime):
    """Squared log misses of one model's reported ratios (per kW at peak, E2E) by `chip`
    with the `INFERRED` parameters at exp(`logs`): what the inferred mode minimises.

    Args:
        logs: {`INFERRED` path: log of its value}.
        t: one target of `infer` (model, layout, concurrency, baseline_kw, baseline_e2e,
            reported_kw, reported_e2e).
        chip, workload, runtime: the chip whose parameters are set, the request lengths and
            the engine settings.
    """
    c = _set(chip, {p: jnp.exp(v) for p, v in logs.items()})
    kw, e2e = _peak_metrics(t["model"], c, t["layout"], workload, runtime, t["concurrency"])
    return ((jnp.log(kw / t["baseline_kw"]) - jnp.log(t["reported_kw"])) ** 2
            + (jnp.log(t["baseline_e2e"] / e2e) - jnp.log(t["reported_e2e"])) ** 2)


def compare(models=None, chip: str = "jalapeno", baselines=None, isl: int = 8192,
            osl: int = 1024, reported: bool = False, modes=("predicted", "inferred"),
            chips: int | None = None, grid=DEFAULT_GRID, threshold: float | None = None,
            infer_steps: int = 60, progress: bool | None = None) -> list[dict]:
    """Compare a chip with baselines on models (defaults: the three reported pairs).

    Args:
        models: model names (default: gpt-oss-120b, deepseek-r1, kimi-k2.5).
        chip: the chip compared (default jalapeno).
        baselines: one baseline per model (default: the reported pair's, GB200 or GB300).
        isl, osl: input and output lengths (tokens).
        reported: add the reported ratios beside the predicted ones.
        modes: "predicted" and/or "inferred".
        chips: chips per deployment (default: max(8, the smallest count that holds it)).
        grid: concurrencies per replica of the sweeps.
        threshold: interactivity of the high-interactivity point (tokens/s/user).
        infer_steps: Adam steps of the inferred mode.
        progress: a bar over the sweeps and fits on standard error (`perfmodel.progress`;
            None: on a terminal).

    Returns:
        One dict per (model, chip, baseline, mode), with the keys of the module docstring
        (`ratio_tok_s_per_kw_at_peak`, `ratio_e2e_latency`,
        `ratio_tok_s_per_kw_high_interactivity`, `interactivity_low_concurrency`, ...), the
        reported ratios with `reported`, and `inferred_*` values in inferred mode.

    Raises:
        ValueError: unknown names or modes, or baselines not matching models.

    Example (not run as a doctest: its two sweeps compile for about 20 s, and
    tests/test_compare.py runs the same call):
        >>> rows = compare(["gpt-oss-120b"], modes=("predicted",), grid=(1., 64.),
        ...                chips=8)  # doctest: +SKIP
        >>> [(r["chip"], r["baseline"], r["mode"]) for r in rows]  # doctest: +SKIP
        [('jalapeno', 'gb200', 'predicted')]
    """
    models = list(models) if models else [p[0] for p in PAIRS]
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

    def points_of(m, c):
        result = chip_points(m, c, workload, chips, grid)
        shown.update(1)
        return result

    base_points = {}
    predicted = {}
    for m, b in zip(models, baselines, strict=True):
        base_points[m] = points_of(m, get_chip(b))
        predicted[m] = points_of(m, target)
    out = []

    def emit(mode, points, extra):
        for m in models:
            a, b = points[m], base_points[m]
            thr = threshold if threshold is not None else \
                0.5 * min(a.max_interactivity, b.max_interactivity)
            row = _row(m, mode, a, b, thr, extra)
            if reported:
                rep = reported_ratios(m)
                if rep and rep["baseline"] == b.chip:
                    row.update({k: v for k, v in rep.items() if k != "baseline"})
            out.append(row)

    if "predicted" in modes:
        emit("predicted", predicted, {})
    if "inferred" in modes:
        def targets_at(points):
            targets = []
            for m in models:
                rep = reported_ratios(m)
                if not rep or rep["baseline"] != base_points[m].chip:
                    continue
                layout = Layout.parse(points[m].peak_layout)
                targets.append({"model": m, "layout": layout,
                                "concurrency": points[m].peak_concurrency / layout.replicas,
                                "baseline_kw": base_points[m].peak_tok_s_per_kw,
                                "baseline_e2e": base_points[m].peak_e2e_s,
                                "reported_kw": rep["reported_ratio_tok_s_per_kw_at_peak"],
                                "reported_e2e": rep["reported_ratio_e2e_latency"]})
            return targets

        targets = targets_at(predicted)
        if targets:
            # Fit at the peaks of the predicted chip, re-sweep, refit at the new peaks.
            inferred_chip, info = infer(target, targets, workload, steps=infer_steps)
            shown.update(1)
            points = {m: points_of(m, inferred_chip) for m in models}
            inferred_chip, info = infer(inferred_chip, targets_at(points), workload,
                                        steps=infer_steps)
            shown.update(1)
            points = {m: points_of(m, inferred_chip) for m in models}
            extra = {"inferred_" + p.replace("efficiency.", ""): v
                     for p, v in info["values"].items()}
            extra["inferred_hbm_tb_s_achievable"] = (
                info["values"]["efficiency.bandwidth_max"] * float(target.hbm_bandwidth) / 1e12)
            extra.update(inferred_loss=info["loss"], inferred_result=info["result"])
            emit("inferred", points, extra)
    shown.close()
    return out
