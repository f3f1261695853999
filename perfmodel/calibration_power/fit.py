"""The power fit: `serving.predict` on every measured row, fitted by Levenberg-Marquardt.

The fitted quantities enter the serving model as its real inputs: each row's chip gets
`energy` coefficients and `idle_power` from the generic TDP fractions plus its family's
offsets (`fitted.generic_energy`'s rule), and its design's `runtime` gets the engine terms
of its vLLM generation (`step_overhead`, `seq_overhead`, `expert_efficiency`,
`pipeline_overlap`, and `kernel_efficiency` per chip family). Rows that share a static
structure (`rows.groups_of`) are one batched `predict`; the residuals are a Huber loss on
log power per GPU and log J per output token, as rows r -> sign(r) sqrt(2 huber(r)) (their
sum of squares is twice the loss), plus the priors as extra rows, solved by
`optimistix.least_squares` with `optimistix.LevenbergMarquardt`.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
from jax.flatten_util import ravel_pytree

from .. import fitted as fitted_params
from ..architecture import Model
from ..design import Design
from ..formats import COMPUTE_CLASSES
from ..hardware import Chip
from ..presets import get_chip
from ..serving import predict
from ..solvers import RESULTS, check
from ..workload import Workload
from .rows import RowSpec, group_inputs, groups_of

FAMILIES = ("ampere", "hopper", "blackwell")
RUNTIMES = ("vllm", "vllm-2024")
#: Priors as fractions of TDP (`hardware.EnergyCoefficients` priors on an H100: 0.5 pJ/FLOP
#: x 989 TFLOP/s / 700 W = 0.71; 60 pJ/B x 3.35 TB/s / 700 W = 0.29; 40 pJ/B x 450 GB/s /
#: 700 W = 0.026; active power while kernels run 0.1; idle 0.15), host overheads (1 ms per
#: step, 20 us per sequence), and the engine's expert-kernel efficiency and pipeline overlap
#: (0.9 each: close to the latency fit's engines, which run at 1; weak priors, the data
#: decide).
PRIOR = {"flop": 0.71, "hbm": 0.29, "link": 0.026, "active": 0.1, "idle": 0.15,
         "step_overhead": 1e-3, "seq_overhead": 2e-5, "expert_efficiency": 0.9,
         "pipeline_overlap": 0.9, "kernel_efficiency": 0.9}
#: Huber threshold on log residuals (dimensionless: about 10%).
HUBER_DELTA = 0.1
#: Physical priors, Gaussian in log space: (centre, width in natural-log units).
#:
#: - "per_hbm_byte" (J/byte), on each measured chip's energy per HBM byte: 60 pJ/byte,
#:   `hardware.EnergyCoefficients`' prior: HBM2 access 3.97 pJ/bit core and I/O (O'Connor
#:   et al., "Fine-Grained DRAM: Energy-Efficient DRAM for Extreme Bandwidth Systems",
#:   MICRO 2017), 32 pJ/byte, about doubled for the on-chip path the figure also carries
#:   (L2, network on chip, SM loads). Width a factor of 2: DRAM alone is 1 sigma below,
#:   a path costing three times the DRAM access 1 sigma above.
#: - "kernel_efficiency", on each fitted (engine, chip family) kernel efficiency: 1, the
#:   speed of the latency fit's engines (its vLLM included: it fits no kernel term, so
#:   its kernels run at 1). Width a factor of 2: an engine of the same kernel libraries
#:   (cuBLAS, FlashAttention) reaching half the tuned engines' speed is 1 sigma, a quarter
#:   2 sigma.
GAUSSIAN_PRIORS = {"per_hbm_byte": (60e-12, math.log(2.0)),
                   "kernel_efficiency": (1.0, math.log(2.0))}
#: Scale of the log residuals (power, J/token) for weighing `GAUSSIAN_PRIORS` against the
#: data: 1.4826 x the median absolute log error of the shipped fit in sample (about 0.12),
#: the robust estimate of a Gaussian's sigma.
RESIDUAL_SCALE = 0.18


def _logit(p):
    return math.log(p / (1.0 - p))


def _array(x):
    return jnp.asarray(x, dtype=float)


class PowerParams(eqx.Module):
    """Fitted power parameters in log/logit space (the solver's variables).

    Example:
        >>> p = PowerParams.prior()
        >>> p.family_delta.shape, round(float(jnp.exp(p.log_fraction[0])), 2)
        ((3, 5), 0.71)
    """

    log_fraction: jnp.ndarray
    """Generic log TDP fractions of FLOP, HBM and link energy and of the active power,
    shape (4,)."""
    logit_idle: jnp.ndarray
    """Generic logit of the idle fraction of TDP."""
    family_delta: jnp.ndarray
    """Per-family offsets of the five values above, shape (len(FAMILIES), 5)."""
    log_overheads: jnp.ndarray
    """log (step, per-sequence) host overhead (s) per runtime, shape (len(RUNTIMES), 2)."""
    logit_engine: jnp.ndarray
    """logit (expert-kernel efficiency, pipeline overlap) per runtime (`design.Runtime`),
    shape (len(RUNTIMES), 2)."""
    logit_kernel: jnp.ndarray
    """logit of the kernel efficiency (`design.Runtime.kernel_efficiency`) per runtime and
    chip family, shape (len(RUNTIMES), len(FAMILIES)); other families run the latency
    fit's kernels (1)."""

    @staticmethod
    def prior() -> PowerParams:
        """The priors of `PRIOR` (family offsets 0)."""
        frac = [PRIOR[k] for k in ("flop", "hbm", "link", "active")]
        over = [[PRIOR["step_overhead"], PRIOR["seq_overhead"]]] * len(RUNTIMES)
        engine = [[_logit(PRIOR["expert_efficiency"]), _logit(PRIOR["pipeline_overlap"])]]
        kernel = [[_logit(PRIOR["kernel_efficiency"])] * len(FAMILIES)] * len(RUNTIMES)
        # Strong float64 leaves, as a fit's are: a weak-typed Python scalar would make
        # compiled functions retrace on the first fitted parameters.
        return PowerParams(
            log_fraction=jnp.log(_array(frac)), logit_idle=_array(_logit(PRIOR["idle"])),
            family_delta=_array(np.zeros((len(FAMILIES), 5))),
            log_overheads=jnp.log(_array(over)), logit_engine=_array(engine * len(RUNTIMES)),
            logit_kernel=_array(kernel))


#: Weight of each parameter's squared distance from its prior in the loss, by field of
#: `PowerParams`.
REGULARISATION = {
    # Family offsets: held near the generic set, so that unmeasured chips follow it.
    "log_fraction": 1e-3, "logit_idle": 1e-3, "family_delta": 0.05, "log_overheads": 1e-3,
    # Each engine term is seen by few rows (17 pipelined ones): a prior as weak as their
    # share of the mean data loss lets them speak.
    "logit_engine": 1e-5,
    # Kernel efficiencies: weak priors (each seen by tens to hundreds of rows).
    "logit_kernel": 1e-4}


def _flat_prior():
    """(raveled prior, unravel, sqrt(2 x regularisation weight) per raveled entry)."""
    prior = PowerParams.prior()
    flat, unravel = ravel_pytree(prior)
    weights = PowerParams(**{k: jnp.full(getattr(prior, k).shape, w)
                             for k, w in REGULARISATION.items()})
    return flat, unravel, jnp.sqrt(2.0 * ravel_pytree(weights)[0])


# ---------------------------------------------------------------------------------------
# The rows as `serving.predict` inputs.


class RowGroup(eqx.Module):
    """Rows of one static structure as `serving.predict` inputs (one row per element)."""

    model: Model
    chip: Chip
    """Latency fit applied; `energy` and `idle_power` are set from the parameters."""
    design: Design
    """Runtime priors; the engine terms are set from the parameters (vLLM rows)."""
    workload: Workload
    family: int = eqx.field(static=True)
    """Index into `FAMILIES`, or -1: the generic set."""
    runtime: int = eqx.field(static=True)
    """Index into `RUNTIMES`, or -1: the `Runtime` priors."""


class PowerProblem(eqx.Module):
    """Every row to fit or evaluate, grouped; rows in group order ("problem order").

    Build one with `build_problem`: it compiles nothing, and every fit and evaluation of
    the same problem reuses one compiled program (rows are chosen by weights, not by
    slicing).
    """

    groups: tuple[RowGroup, ...]
    power: jnp.ndarray
    """Measured average power per GPU (W), problem order; NaN where not measured."""
    joules: jnp.ndarray
    """Measured energy per output token (J); NaN where not measured."""
    tok_s: jnp.ndarray
    """Measured output tokens/s per GPU, for reports; NaN where not measured."""
    measured: jnp.ndarray
    """Whether the row has both power and J per output token (bool)."""
    hbm_scale: jnp.ndarray
    """log(TDP / HBM bandwidth) (log(J/byte) per TDP fraction) of each measured chip,
    shape (number of chips,), for the `GAUSSIAN_PRIORS` on energy per HBM byte."""
    index: tuple[int, ...] = eqx.field(static=True)
    """`RowSpec.index` (row of the measurement file) of each problem row."""
    group_sizes: tuple[int, ...] = eqx.field(static=True)
    """Rows of each group (problem order is group order)."""
    group_chip: tuple[int, ...] = eqx.field(static=True)
    """Index into `hbm_scale` of each group's chip."""

    def weights(self, indices) -> jnp.ndarray:
        """Per-row weights in problem order: 1 for rows whose `RowSpec.index` is in
        `indices` and which are measured, else 0."""
        chosen = set(int(i) for i in indices)
        mask = np.asarray([i in chosen for i in self.index], dtype=float)
        return jnp.asarray(mask) * self.measured


def build_problem(specs: list[RowSpec]) -> PowerProblem:
    """The serving-model inputs of measured rows, grouped by `RowSpec.group`.

    Chips take the shipped latency fit and the `EnergyCoefficients` priors; runtimes the
    `Runtime` priors: nothing depends on an earlier power fit.

    Raises:
        ValueError: no rows.
    """
    if not specs:
        raise ValueError("build_problem needs at least one row spec (see specs_of)")
    groups, order, chips, group_chip = [], [], {}, []
    for members in groups_of(specs):
        first = members[0]
        chip = fitted_params.apply(get_chip(first.chip_name, calibrated=False), power={})
        design, workload = group_inputs(members, chip, {})
        if chip.name not in chips:
            chips[chip.name] = math.log(float(chip.tdp) / float(chip.hbm_bandwidth))
        group_chip.append(list(chips).index(chip.name))
        groups.append(RowGroup(
            model=first.model, chip=chip, design=design, workload=workload,
            family=FAMILIES.index(chip.family) if chip.family in FAMILIES else -1,
            runtime=RUNTIMES.index(first.framework) if first.framework in RUNTIMES else -1))
        order += members

    def measured(key):
        values = np.asarray([s.measured[key] or np.nan for s in order], dtype=float)
        return np.where(values > 0, values, np.nan)

    power, joules = measured("avg_power_w_per_gpu"), measured("energy_j_per_output_token")
    return PowerProblem(groups=tuple(groups), power=jnp.asarray(power),
                        joules=jnp.asarray(joules),
                        tok_s=jnp.asarray(measured("output_tokens_per_s_per_gpu")),
                        measured=jnp.asarray(np.isfinite(power) & np.isfinite(joules)),
                        hbm_scale=jnp.asarray(list(chips.values()), dtype=float),
                        index=tuple(s.index for s in order),
                        group_sizes=tuple(len(m) for m in groups_of(specs)),
                        group_chip=tuple(group_chip))


def _own(holdout: str | None) -> jnp.ndarray:
    """1 per family that uses its own fitted terms, 0 for the held-out one."""
    if holdout is not None and holdout not in FAMILIES:
        raise ValueError(f"holdout={holdout!r} is not a fitted family; valid: {FAMILIES}")
    return jnp.asarray([0.0 if f == holdout else 1.0 for f in FAMILIES])


def _chip(params: PowerParams, group: RowGroup, own) -> Chip:
    # `fitted.generic_energy`'s rule (a fraction of TDP per unit at its peak rate), traced:
    # that one reads floats to write the JSON. A held-out family takes the generic set.
    fam = group.family
    delta = params.family_delta[fam] * own[fam] if fam >= 0 else jnp.zeros(5)
    frac = jnp.exp(params.log_fraction + delta[:4])
    chip = group.chip
    energy = type(chip.energy)(per_flop=frac[0] * chip.tdp / chip.peak_flops,
                               per_hbm_byte=frac[1] * chip.tdp / chip.hbm_bandwidth,
                               per_link_byte=frac[2] * chip.tdp / chip.scale_up.bandwidth,
                               active_power=frac[3] * chip.tdp)
    idle = chip.tdp * jax.nn.sigmoid(params.logit_idle + delta[4])
    return eqx.tree_at(lambda c: (c.energy, c.idle_power), chip, (energy, idle))


def _design(params: PowerParams, group: RowGroup, own) -> Design:
    run, fam = group.runtime, group.family
    if run < 0:
        return group.design
    over = jnp.exp(params.log_overheads[run])
    engine = jax.nn.sigmoid(params.logit_engine[run])
    # A family held out (or never fitted) runs the latency fit's kernels, as
    # `fitted.runtime_terms` gives it.
    kernel = jnp.where(own[fam] > 0, jax.nn.sigmoid(params.logit_kernel[run, fam]), 1.0) \
        if fam >= 0 else jnp.asarray(1.0)
    ones = jnp.ones_like(group.design.runtime.max_running)
    design = eqx.tree_at(
        lambda d: (d.runtime.step_overhead, d.runtime.seq_overhead,
                   d.runtime.expert_efficiency, d.runtime.kernel_efficiency), group.design,
        tuple(x * ones for x in (over[0], over[1], engine[0], kernel)))
    if group.design.layout.pp == 1:
        # No pipeline, no overlap to fit. Left out, the parameters reach the step only after
        # its operators' roofline, so the Jacobian's program is a small addition to the
        # serving model's; through the micro-batch size it would differentiate every
        # operator (measured on 10 groups: the Jacobian compiled in 21 s against 65 s).
        return design
    return eqx.tree_at(lambda d: d.runtime.pipeline_overlap, design, engine[1] * ones)


class RowPredictions(eqx.Module):
    """`serving.predict`'s figures of every problem row (problem order)."""

    power: jnp.ndarray
    """Average power per GPU (W)."""
    joules: jnp.ndarray
    """Energy per output token (J)."""
    tok_s: jnp.ndarray
    """Output tokens/s per GPU."""
    fits: jnp.ndarray
    """Whether the configuration fits in memory (bool)."""


def _predict(params: PowerParams, problem: PowerProblem, own) -> RowPredictions:
    outs = []
    for group in problem.groups:
        # vectorize: the same numbers, in a program that compiles about 2.4x faster under
        # the Jacobian (measured on 10 groups: 25 s against 59 s).
        m = predict(group.model, _chip(params, group, own), group.workload,
                    _design(params, group, own), hard=True, check=False, vectorize=True,
                    unfit="value")
        outs.append((m.power_per_chip, m.j_per_output_token, m.output_throughput_per_chip,
                     m.fits))
    return RowPredictions(*(jnp.concatenate(x) for x in zip(*outs, strict=True)))


def evaluate(params: PowerParams, problem: PowerProblem,
             holdout: str | None = None) -> RowPredictions:
    """The fit's predictions: `serving.predict` (exact maxima) of every problem row, with
    the parameters as its chip and runtime inputs (what `to_fitted` and `fitted.apply`
    give the same chip and runtime).

    Args:
        params: power parameters.
        problem: rows (`build_problem`); one compiled program serves every `params` and
            `holdout`.
        holdout: a family that takes the generic set and the latency fit's kernels.
    """
    # The held-out family as numbers: one compiled program for every holdout.
    return _evaluate(params, problem, _own(holdout))


_evaluate = eqx.filter_jit(_predict)


def usable(problem: PowerProblem, predictions: RowPredictions) -> list[int]:
    """`RowSpec.index` of the rows with measured power and J per output token whose
    configuration fits in memory (no fitted term changes that): the rows to fit."""
    keep = np.asarray(problem.measured) & np.asarray(predictions.fits)
    return sorted(i for i, k in zip(problem.index, keep, strict=True) if k)


def metric_pairs(problem: PowerProblem, predictions: RowPredictions):
    """(metric, predicted, measured) of power per GPU ("power"), J per output token
    ("j_per_token") and output tokens/s per GPU ("output_tok_s"), problem order (NumPy)."""
    return tuple((key, np.asarray(p), np.asarray(m)) for key, p, m in (
        ("power", predictions.power, problem.power),
        ("j_per_token", predictions.joules, problem.joules),
        ("output_tok_s", predictions.tok_s, problem.tok_s)))


def errors(problem: PowerProblem, predictions: RowPredictions, indices) -> dict:
    """Median and 90th-percentile absolute relative errors (%) of power per GPU, J per
    output token and output tokens/s per GPU over the given rows (`RowSpec.index`), where
    measured.

    Returns:
        {"power" | "j_per_token" | "output_tok_s": {"median_abs_pct", "p90_abs_pct", "n"}}.
    """
    chosen = np.isin(np.asarray(problem.index), np.asarray(list(indices), dtype=int))
    out = {}
    for key, predicted, measured in metric_pairs(problem, predictions):
        rel = np.abs(predicted / measured - 1.0)
        rel = rel[chosen & np.isfinite(rel)]
        out[key] = {"median_abs_pct": float(np.median(rel) * 100) if rel.size else math.nan,
                    "p90_abs_pct": float(np.percentile(rel, 90) * 100) if rel.size
                    else math.nan, "n": int(rel.size)}
    return out


# ---------------------------------------------------------------------------------------
# The solve.


def robust(r, delta: float = HUBER_DELTA):
    """Residuals whose sum of squares is twice the Huber loss: sign(r) sqrt(2 huber(r)).

    Example:
        >>> r = jnp.asarray([0.05, -0.3])   # sqrt(2 huber(-0.3)) = sqrt(0.05) = 0.2236
        >>> [round(float(x), 4) for x in robust(r)]
        [0.05, -0.2236]
    """
    size = jnp.abs(r)
    tail = size > delta
    # Double where: the square root's branch stays away from 0, where its derivative is
    # infinite, for residuals in the quadratic part.
    root = jnp.sqrt(jnp.where(tail, delta * (2.0 * size - delta), 1.0))
    return jnp.where(tail, jnp.sign(r) * root, r)


def _data_residuals(theta, static, args):
    dynamic, weights, own = args
    problem = eqx.combine(dynamic, static)
    predictions = _predict(_flat_prior()[1](theta), problem, own)
    use = weights > 0
    scale = jnp.sqrt(weights / jnp.sum(weights))

    def rows(predicted, measured):
        # Double where: unweighted rows (unmeasured, or not fitting) stay finite.
        r = jnp.log(jnp.where(use, predicted, 1.0) / jnp.where(use, measured, 1.0))
        return jnp.where(use, scale * robust(r), 0.0)

    return jnp.concatenate([rows(predictions.power, problem.power),
                            rows(predictions.joules, problem.joules)])


def _with_materialized_jacobian(fn):
    """`fn(theta, args)`, differentiated by one forward-mode Jacobian per point.

    Levenberg-Marquardt linearizes the residuals (`jax.linearize`), then applies, batches
    and transposes that linear map: three copies of the serving model's tangent program in
    its loop. Materializing the Jacobian once makes the linear map a matrix. Measured on 10
    row groups: linearized, the solve compiled in 383 s where the Jacobian alone took 59 s;
    materialized (with this module's other measures), 34 s against the Jacobian's 16 s.
    """
    @jax.custom_jvp
    def wrapped(theta, args):
        return fn(theta, args)

    @wrapped.defjvp
    def _jvp(primals, tangents):
        theta, args = primals
        jac, value = jax.jacfwd(lambda t: (fn(t, args),) * 2, has_aux=True)(theta)
        return value, jac @ tangents[0]

    return wrapped


def _gaussian_residuals(theta, static, args):
    """`GAUSSIAN_PRIORS` as residual rows, weighed as a Gaussian likelihood of the data
    would weigh them: z sigma_d / sqrt(N) for a prior's z-score, sigma_d = `RESIDUAL_SCALE`
    and N the number of row groups with a weighted row. A group (one model, chip, layout and
    engine across batch sizes) shares its model error, so groups, not rows, count as the
    independent observations. Only terms that some weighted row uses have rows (a held-out
    family's have none)."""
    dynamic, weights, own = args
    problem = eqx.combine(dynamic, static)
    params = _flat_prior()[1](theta)
    bounds = np.cumsum((0,) + problem.group_sizes)
    used = jnp.stack([jnp.any(weights[a:b] > 0) for a, b in zip(bounds[:-1], bounds[1:],
                                                                strict=True)]) * 1.0
    scale = RESIDUAL_SCALE / jnp.sqrt(jnp.sum(used))
    chip_used = [[] for _ in range(problem.hbm_scale.shape[0])]
    chip_family = [-1] * problem.hbm_scale.shape[0]
    pair_used = {}
    for g, group in enumerate(problem.groups):
        chip_used[problem.group_chip[g]].append(used[g])
        chip_family[problem.group_chip[g]] = group.family
        if group.runtime >= 0 and group.family >= 0:
            pair_used.setdefault((group.runtime, group.family), []).append(used[g])
    rows = []
    centre, width = GAUSSIAN_PRIORS["per_hbm_byte"]
    for c, family in enumerate(chip_family):
        delta = params.family_delta[family, 1] * own[family] if family >= 0 else 0.0
        on = jnp.max(jnp.stack(chip_used[c])) * (own[family] if family >= 0 else 1.0)
        log_energy = params.log_fraction[1] + delta + problem.hbm_scale[c]
        rows.append(on * (log_energy - math.log(centre)) / width)
    centre, width = GAUSSIAN_PRIORS["kernel_efficiency"]
    for (run, family), flags in sorted(pair_used.items()):
        on = jnp.max(jnp.stack(flags)) * own[family]
        log_kernel = jax.nn.log_sigmoid(params.logit_kernel[run, family])
        rows.append(on * (log_kernel - math.log(centre)) / width)
    return scale * jnp.stack(rows)


def _residual_fn(static):
    data = _with_materialized_jacobian(lambda t, a: _data_residuals(t, static, a))

    def fn(theta, args):
        prior, _, scale = _flat_prior()
        return jnp.concatenate([data(theta, args), scale * (theta - prior),
                                _gaussian_residuals(theta, static, args)])

    return fn


def _weights(problem: PowerProblem, weights) -> jnp.ndarray:
    weights = problem.measured * 1.0 if weights is None else jnp.asarray(weights, dtype=float)
    if weights.shape != problem.power.shape:
        raise ValueError(f"weights has shape {weights.shape}, the problem has "
                         f"{problem.power.shape[0]} rows (use problem.weights(indices))")
    return weights * problem.measured


def residuals(params: PowerParams, problem: PowerProblem, weights=None,
              holdout: str | None = None) -> jnp.ndarray:
    """The fit's residual vector: weighted `robust` log residuals of power per GPU, then
    of J per output token (problem order; 0 for unweighted rows), then the prior rows
    (`REGULARISATION`), then the physical priors (`GAUSSIAN_PRIORS`: each measured chip's
    energy per HBM byte, then each (engine, family) kernel efficiency with rows). Half its
    sum of squares is the loss `fit_power` minimises: the weighted mean Huber loss plus the
    regularisation and the priors. Differentiable (forward mode, the derivative the solver
    uses).

    Args:
        params, problem, weights, holdout: as `fit_power`.

    Returns:
        Array (2 rows + number of parameters + measured chips + fitted kernel pairs,).

    Raises:
        ValueError: weights of the wrong shape; an unknown `holdout`.
        equinox.EquinoxRuntimeError: no measured row has a positive weight.
    """
    theta = ravel_pytree(params)[0]
    dynamic, static = eqx.partition(problem, eqx.is_array)
    weights = _weights(problem, weights)
    weights = eqx.error_if(weights, ~jnp.any(weights > 0),
                           "no measured row has a positive weight")
    return _residual_fn(static)(theta, (dynamic, weights, _own(holdout)))


@eqx.filter_jit
def _solve(problem, weights, own, start, rtol, atol, max_steps):
    dynamic, static = eqx.partition(problem, eqx.is_array)
    solver = optx.LevenbergMarquardt(rtol=rtol, atol=atol)
    _, unravel, _ = _flat_prior()
    sol = optx.least_squares(_residual_fn(static), solver, ravel_pytree(start)[0],
                             args=(dynamic, weights, own), max_steps=max_steps,
                             throw=False)
    # The solver state holds the residuals at the accepted point: no second evaluation.
    loss = 0.5 * jnp.sum(sol.state.f_info.residual ** 2)
    return unravel(sol.value), loss, sol.stats["num_steps"], sol.result


class PowerFit(eqx.Module):
    """A power fit's solution."""

    params: PowerParams
    loss: jnp.ndarray
    """Mean Huber loss of the weighted rows plus the regularisation and the
    `GAUSSIAN_PRIORS`, at `params`."""
    steps: jnp.ndarray
    """Levenberg-Marquardt steps taken."""
    result: RESULTS
    """`perfmodel.solvers.RESULTS.successful` when the termination test was met."""


def fit_power(problem: PowerProblem, weights=None, holdout: str | None = None, *,
              start: PowerParams | None = None, rtol: float = 1e-6, atol: float = 1e-9,
              max_steps: int = 256, throw: bool = True) -> PowerFit:
    """Fit `PowerParams` to measured rows by Levenberg-Marquardt on `serving.predict`.

    Terminates when a step changes both the parameters and the residuals by less than
    `atol + rtol |value|` (optimistix's Cauchy test). One compiled program serves every fit
    of the same problem: weights and the held-out family are traced.

    Args:
        problem: rows (`build_problem`).
        weights: per-row weights in problem order (`PowerProblem.weights`); default 1 for
            every measured row. Rows of weight 0 are not fitted.
        holdout: a family fitted without its own terms (its rows, if weighted, use the
            generic set and the latency fit's kernels), for leave-one-chip-out checks.
        start: where the solve starts (default: the priors).
        rtol, atol: the termination test's tolerances (log parameters, residuals).
        max_steps: most solver steps.
        throw: raise when the solve does not succeed.

    Returns:
        `PowerFit`, its `result` a `perfmodel.solvers.RESULTS`.

    Raises:
        ValueError: weights of the wrong shape, or none positive; an unknown `holdout`.
        RuntimeError: with `throw`, a solve that did not succeed (step limit, non-finite).
    """
    own, weights = _own(holdout), _weights(problem, weights)
    if not bool(jnp.any(weights > 0)):
        raise ValueError("fit_power: no measured row has a positive weight")
    start = PowerParams.prior() if start is None else start
    params, loss, steps, result = _solve(problem, weights, own, start, rtol, atol, max_steps)
    result = check(RESULTS.promote(result), "power fit", throw,
                   f"loss {float(loss):.6g} after {int(steps)} steps")
    return PowerFit(params=params, loss=loss, steps=steps, result=result)


def to_fitted(params: PowerParams, chips: dict[str, Chip], holdout: str | None = None) -> dict:
    """The `fitted_power.json` content of fitted parameters.

    Args:
        params: fitted parameters.
        chips: one representative chip per family, for the physical per-family coefficients.
        holdout: a family left out of the fit (not written).
    """
    frac = np.exp(np.asarray(params.log_fraction))
    idle = float(jax.nn.sigmoid(params.logit_idle))
    generic = {"flop": [float(frac[0])] * len(COMPUTE_CLASSES), "hbm": float(frac[1]),
               "link": float(frac[2]), "active": float(frac[3]), "idle": idle}
    families = {}
    for i, family in enumerate(FAMILIES):
        if family == holdout or family not in chips:
            continue
        d = np.asarray(params.family_delta[i])
        fam = {"flop": [float(frac[0] * np.exp(d[0]))] * len(COMPUTE_CLASSES),
               "hbm": float(frac[1] * np.exp(d[1])), "link": float(frac[2] * np.exp(d[2])),
               "active": float(frac[3] * np.exp(d[3])),
               "idle": float(jax.nn.sigmoid(params.logit_idle + d[4]))}
        energy = fitted_params.generic_energy(chips[family], fam)
        families[family] = {"energy": energy, "idle_fraction": fam["idle"], "tdp_fractions": fam,
                            "reference_chip": chips[family].name}
    over = np.exp(np.asarray(params.log_overheads))
    engine = np.asarray(jax.nn.sigmoid(params.logit_engine))
    kernel = np.asarray(jax.nn.sigmoid(params.logit_kernel))
    runtimes = {name: {"step_overhead": float(over[i, 0]), "seq_overhead": float(over[i, 1]),
                       "expert_efficiency": float(engine[i, 0]),
                       "pipeline_overlap": float(engine[i, 1]),
                       "kernel_efficiency": {fam: float(kernel[i, j])
                                             for j, fam in enumerate(FAMILIES)
                                             if fam != holdout and fam in chips}}
                for i, name in enumerate(RUNTIMES)}
    return {"version": 1, "families": families, "generic": generic, "runtimes": runtimes}
