"""The inferred mode of the Jalapeno comparison: the chip parameters the reported ratios
imply, and how well they imply each one.

Parameters (`InferredParams`, one field each, unconstrained): the fixed per-kernel and
per-step costs (the chip's `Efficiency.memory_latency` and `Efficiency.kernel_overhead`, the
runtime's `Runtime.step_overhead`: logs of seconds) and the attainable fractions of peak
(`Efficiency.attention_max` of FLOP/s in attention kernels, `Efficiency.bandwidth_max` of
HBM bandwidth: logits, so every value stays in (0, 1) without a penalty), and per reported
pair the chip's top concurrency (`InferredParams.top_requests`: log of requests per chip at
its peak, prior centre the predicted mode's top, width ln 4, `PRIOR_WIDTH`), which unties
the pair's two ratios (below). Slice count and HBM capacity are not fitted: at a given top
neither changes the peak point (issue 21).

Residuals (`residuals`), each a number of standard deviations:

- per reported pair (`Target`: one model at its predicted peak point, a single replica of
  the sweep's peak layout at its requests per replica), the log miss of the tokens/s per kW
  ratio and of the E2E ratio against the reported ones, over `DATA_WIDTH` (0.1: the ratios
  are rounded to one decimal, up to 3.3 %, and the model's median error on a chip left out
  of its fit is about 12 %, README "leave-one-chip-out");
- per parameter, its distance from the prior centre (the predicted-mode value: GPU-fitted
  efficiencies, the generic runtime) over its prior width (`PRIOR_WIDTH`, in its own
  unconstrained coordinate: 1 is a factor e on a time, and about 0.25 on a fraction near
  1/2, less towards 0 or 1);
- per `PointTarget` (a figure at a fixed sweep point: the per-user speeds J08 and J09 at the
  low-concurrency point, one request on one replica of its layout; the per-kW ratio J07 at
  the high-interactivity point), its `band_miss` against the reported band over the same
  `DATA_WIDTH` (speeds given to two figures, ">700" and "~1400": rounding up to 3.6 %, plus
  the model's error): zero inside the band, so a one-sided figure is free once met.

Solver: `optimistix.least_squares` with `optimistix.LevenbergMarquardt`, Jacobians by
forward mode (`options={"jac": "fwd"}`: one tangent per parameter; reverse mode gave NaN
gradients of chip fields through the serving model under jit on XLA:CPU), computed with
the residuals by one compiled kernel that the solve calls back (`perfmodel.solvers.
called_back`: the solve compiles in seconds, not a minute). It stops when a
step changes the parameters and the residuals by less than atol + rtol x their size. A
non-finite loss or Jacobian at the solution is `RESULTS.nonfinite`; `throw=True` raises on
any failure (`perfmodel.solvers.check`).

Identification: under the Gauss-Newton approximation the posterior covariance of the
unconstrained parameters at the solution is (J^T J)^-1, J the Jacobian of the whitened
residuals (data and prior rows). `Inference.posterior_width` is the square root of its
diagonal, and `Inference.width_ratio` the posterior over the prior width: near 0 the
reported ratios pin the parameter down; near 1 they say nothing about it beyond the prior.
A parameter is reported identified when the ratio is below `IDENTIFIED_BELOW` (0.5: the
data at least halve its uncertainty).

What the data can say: at a fixed number of requests per chip a model's two ratios are the
same function of the five chip parameters up to a constant (Little's law: tokens/s per kW
is requests x tokens per request / E2E / TDP), so without the tops each reported pair
constrains one combination of them, and a pair asking for another requests-per-chip ratio
than the peak's (`claims.consistency`: all three reported pairs) cannot be met. The
fitted top supplies that ratio, so the pair's per-kW ratio fixes the top and its E2E ratio
one combination of the chip parameters. `Inference.unmet` says, for a figure the fit still
misses, which one parameter would close it in the fewest prior widths, the value it needs,
and whether that is within `PLAUSIBLE_WIDTHS` of the prediction.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx

from .. import compiled
from ..design import Runtime
from ..hardware import Chip
from ..search.compile import SEARCH_OPTIONS
from ..solvers import RESULTS, called_back, check, forward_jacobian, levenberg_marquardt, message
from ..workload import Workload
from .targets import PointTarget, Target, band_miss, replica_metrics

#: Fitted parameters, in the order of `InferredParams`' fields and of the Jacobian columns.
INFERRED = ("memory_latency", "kernel_overhead", "step_overhead", "attention_max",
            "bandwidth_max")

#: Parameters fitted through a logit (fractions of a peak); the others through a log.
FRACTIONS = ("attention_max", "bandwidth_max")

#: The vector field of `InferredParams`: log of the chip's top concurrency (requests in flight
#: per chip at its peak), one per reported pair (`Target`).
TOP = "top_requests"

#: Prior width of each parameter in its unconstrained coordinate (log of s, log of requests,
#: or logit). The top concurrency's, ln 4: the reports give no concurrency and InferenceX
#: runs a power-of-two concurrency list, so a top two steps of that list from the GPU's is
#: one standard deviation (the reported pairs imply 0.65x, 0.24x and 0.22x, -0.3 to -1.1
#: widths; `claims.consistency`).
PRIOR_WIDTH = {"memory_latency": 1.0, "kernel_overhead": 1.0, "step_overhead": 1.0,
               "attention_max": 1.0, "bandwidth_max": 1.0, TOP: float(np.log(4.0))}

#: A fitted value this many prior widths or more from its centre is outside the physically
#: plausible range (`Inference.unmet` says so): beyond 2 widths a fixed cost is e^2 = 7.4x
#: off the GPU-fitted value, or a top concurrency 16x off the GPU's.
PLAUSIBLE_WIDTHS = 2.0

#: Standard deviation of a reported ratio's log (see the module docstring).
DATA_WIDTH = 0.1

#: A parameter is identified when its posterior width is below this fraction of its prior's.
IDENTIFIED_BELOW = 0.5


def _number(x):
    # Explicit dtype: a Python float would give a weakly typed array, whose compiled solve
    # a strongly typed one (a ratio computed by the model) would not reuse.
    return jnp.asarray(x, dtype=float)


def _vector(x):
    return jnp.reshape(jnp.asarray(x, dtype=float), (-1,))


class InferredParams(eqx.Module):
    """The inferred mode's parameters, unconstrained (see the module docstring).

    Example:
        >>> from perfmodel.presets import get_chip
        >>> from perfmodel.sweep import default_runtime
        >>> chip = get_chip("jalapeno")
        >>> p = InferredParams.of(chip, default_runtime(chip))
        >>> round(p.values()["step_overhead"], 6), round(p.values()["bandwidth_max"], 2)
        (0.001, 0.82)
    """

    memory_latency: jnp.ndarray = eqx.field(converter=_number)
    """log of `Efficiency.memory_latency`, the fixed latency of a memory-bound kernel (log s)."""
    kernel_overhead: jnp.ndarray = eqx.field(converter=_number)
    """log of `Efficiency.kernel_overhead`, launch, ramp and tail per kernel (log s)."""
    step_overhead: jnp.ndarray = eqx.field(converter=_number)
    """log of `Runtime.step_overhead`, host time per engine step (log s)."""
    attention_max: jnp.ndarray = eqx.field(converter=_number)
    """logit of `Efficiency.attention_max`, the fraction of peak FLOP/s attention kernels
    reach (logit of a dimensionless fraction)."""
    bandwidth_max: jnp.ndarray = eqx.field(converter=_number)
    """logit of `Efficiency.bandwidth_max`, the fraction of HBM bandwidth a large read
    reaches (logit of a dimensionless fraction)."""
    top_requests: jnp.ndarray = eqx.field(converter=_vector, default=())
    """log of the chip's top concurrency at each reported pair's peak (log requests per
    chip), in target order, shape (targets,); empty: not fitted, each target at its own
    `Target.concurrency`."""

    @classmethod
    def of(cls, chip: Chip, runtime: Runtime, tops=()) -> InferredParams:
        """The parameters of `chip` and `runtime` (float64 where x64 is on), with top
        concurrencies `tops` (requests per chip, one per target; empty: not fitted)."""
        e = chip.efficiency

        def log(x):
            return jnp.log(jnp.asarray(x, dtype=float))

        def logit(x):
            x = jnp.asarray(x, dtype=float)
            return jnp.log(x) - jnp.log1p(-x)

        return cls(memory_latency=log(e.memory_latency), kernel_overhead=log(e.kernel_overhead),
                   step_overhead=log(runtime.step_overhead),
                   attention_max=logit(e.attention_max), bandwidth_max=logit(e.bandwidth_max),
                   top_requests=log(jnp.asarray(tops, dtype=float)))

    @classmethod
    def widths(cls, widths: dict | None = None, tops: int = 0) -> InferredParams:
        """Prior widths as an `InferredParams` (`PRIOR_WIDTH`, updated by `widths`), with
        `tops` top-concurrency widths.

        Raises:
            ValueError: a key that is not a field, or a width that is not positive.
        """
        given = dict(PRIOR_WIDTH, **(widths or {}))
        for key, value in given.items():
            if key not in INFERRED + (TOP,):
                raise ValueError(f"prior width {key!r}: the fitted parameters are "
                                 f"{INFERRED + (TOP,)}")
            if not value > 0:
                raise ValueError(f"prior width of {key} is {value!r}: give a positive width "
                                 "(in log or logit units)")
        top = given.pop(TOP)
        return cls(**{k: float(v) for k, v in given.items()},
                   top_requests=jnp.full((tops,), float(top)))

    def flat(self) -> jnp.ndarray:
        """The fields as one vector, in `names` order: `INFERRED`, then the tops. On a
        pytree of Jacobians (leaves with leading residual axes), the parameters are the
        last axis."""
        return jnp.concatenate([jnp.stack([jnp.asarray(getattr(self, k), dtype=float)
                                           for k in INFERRED], axis=-1),
                                jnp.asarray(self.top_requests, dtype=float)], axis=-1)

    def names(self) -> tuple[str, ...]:
        """The entries of `flat`: `INFERRED`, then `top_requests[i]` per target."""
        return INFERRED + tuple(f"{TOP}[{i}]" for i in range(self.top_requests.shape[0]))

    def tops(self) -> np.ndarray:
        """The top concurrencies, requests per chip, shape (targets,) (concrete only)."""
        return np.exp(np.asarray(self.top_requests))

    def values(self) -> dict[str, float]:
        """The physical values (s, or fractions), by field name (concrete only)."""
        return {k: float(jax.nn.sigmoid(getattr(self, k)) if k in FRACTIONS
                         else jnp.exp(getattr(self, k))) for k in INFERRED}


def apply(params: InferredParams, chip: Chip, runtime: Runtime) -> tuple[Chip, Runtime]:
    """`chip` and `runtime` with the values of `params` (traceable).

    Example:
        >>> from perfmodel.presets import get_chip
        >>> from perfmodel.sweep import default_runtime
        >>> chip = get_chip("jalapeno")
        >>> runtime = default_runtime(chip)
        >>> p = InferredParams.of(chip, runtime)
        >>> c, r = apply(eqx.tree_at(lambda p: p.step_overhead, p, jnp.log(2e-3)), chip, runtime)
        >>> bandwidth = round(float(c.efficiency.bandwidth_max), 6)
        >>> round(float(r.step_overhead), 6), bandwidth == round(p.values()["bandwidth_max"], 6)
        (0.002, True)
    """
    e = chip.efficiency
    # One attention parameter: the decode kernels' efficiency; the prompt's (MLA and
    # windowed) move by the same factor (the chip's prompt-to-decode ratios kept), as one
    # term priced all three before they were fitted apart.
    attention = jax.nn.sigmoid(params.attention_max).astype(e.attention_max.dtype)
    prompt = jnp.minimum(e.prefill_attention_max * attention / e.attention_max, 1.0)
    window = jnp.minimum(e.window_prefill_attention_max * attention / e.attention_max, 1.0)
    chip = eqx.tree_at(
        lambda c: (c.efficiency.memory_latency, c.efficiency.kernel_overhead,
                   c.efficiency.attention_max, c.efficiency.prefill_attention_max,
                   c.efficiency.window_prefill_attention_max,
                   c.efficiency.bandwidth_max), chip,
        (jnp.exp(params.memory_latency).astype(e.memory_latency.dtype),
         jnp.exp(params.kernel_overhead).astype(e.kernel_overhead.dtype),
         attention, prompt.astype(e.prefill_attention_max.dtype),
         window.astype(e.window_prefill_attention_max.dtype),
         jax.nn.sigmoid(params.bandwidth_max).astype(e.bandwidth_max.dtype)))
    runtime = eqx.tree_at(lambda r: r.step_overhead, runtime,
                          jnp.exp(params.step_overhead).astype(runtime.step_overhead.dtype))
    return chip, runtime


def ratios(params: InferredParams, targets, chip: Chip, runtime: Runtime,
           workload: Workload) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The ratios `params` predict at each target's peak point (traceable).

    Args:
        params: the fitted parameters, applied to `chip` and `runtime` (`apply`).
        targets: `Target`s (their layouts, concurrencies and baselines; the reported
            ratios are not read). With `params.top_requests`, each at its fitted top.
        chip, runtime, workload: the rest of the prediction.

    Returns:
        (tokens/s per kW ratios, chip over baseline; E2E ratios, baseline over chip), each
        of shape (targets,), dimensionless.
    """
    kw, e2e, _ = _evaluate(params, tuple(targets), (), chip, runtime, workload)
    return kw, e2e


def _evaluate(params: InferredParams, targets, points, chip: Chip, runtime: Runtime,
              workload: Workload):
    """(per-kW ratios, E2E ratios) of the targets' peak points and the value of each point
    target, with `params` applied. The points of one model are evaluated in one vmapped
    call (layouts as numbers): the solve then traces and compiles the serving model once
    per model, not once per point."""
    fitted = params.top_requests.shape[0]
    if fitted not in (0, len(targets)):
        raise ValueError(f"params.top_requests has {fitted} entries for {len(targets)} "
                         "targets: give one per target, or none")
    chip, runtime = apply(params, chip, runtime)
    calls = [(t.model, t.layout, jnp.exp(params.top_requests[i]) * t.layout.chips_per_instance
              if fitted else t.concurrency) for i, t in enumerate(targets)]
    calls += [(p.model, p.layout, p.concurrency) for p in points]
    out = [None] * len(calls)
    for model in dict.fromkeys(c[0] for c in calls):
        which = [k for k, c in enumerate(calls) if c[0] == model]
        layouts = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                         *[calls[k][1] for k in which])
        concurrency = jnp.stack([jnp.asarray(calls[k][2], dtype=float) for k in which])

        def one(layout, c, model=model):
            m = replica_metrics(model, layout, c, chip, runtime, workload)
            return m.tok_s_per_kw_tdp, m.e2e, m.interactivity

        kw, e2e, speed = jax.vmap(one)(layouts, concurrency)
        for j, k in enumerate(which):
            out[k] = (kw[j], e2e[j], speed[j])
    n = len(targets)
    kw = jnp.stack([out[i][0] / t.baseline_kw for i, t in enumerate(targets)]) if n \
        else jnp.zeros((0,))
    e2e = jnp.stack([t.baseline_e2e / out[i][1] for i, t in enumerate(targets)]) if n \
        else jnp.zeros((0,))
    values = [(out[n + j][2] if p.metric == "interactivity" else out[n + j][0]) / p.baseline
              for j, p in enumerate(points)]
    return kw, e2e, values


class Problem(eqx.Module):
    """Everything `residuals` reads besides the parameters: the fit's data and prior."""

    targets: tuple[Target, ...]
    """The reported pairs."""
    chip: Chip
    """The prior chip (predicted mode)."""
    runtime: Runtime
    """The prior runtime."""
    workload: Workload
    """Request lengths."""
    centre: InferredParams
    """Prior centre (unconstrained)."""
    width: InferredParams
    """Prior widths (unconstrained units)."""
    data_width: jnp.ndarray
    """Standard deviation of a reported figure's log (dimensionless)."""
    points: tuple[PointTarget, ...] = ()
    """Reported figures at fixed sweep points (per-user speeds, high-interactivity ratios)."""

    def claims(self) -> tuple[str, ...]:
        """Claim id of each data residual, in `residuals` order."""
        return tuple(c for t in self.targets for c in t.claims) + tuple(
            p.claim for p in self.points)


def residuals(params: InferredParams, problem: Problem) -> jnp.ndarray:
    """Whitened residuals of the fit (module docstring; traceable).

    Returns:
        Shape (2 x targets + points + parameters,), in standard deviations: per target the
        log misses of its tokens/s per kW and E2E ratios over the data width, per point
        target its `band_miss` over the data width, then per parameter (`names` order) its
        distance from the prior centre over its prior width.
    """
    kw, e2e, values = _evaluate(params, problem.targets, problem.points, problem.chip,
                                problem.runtime, problem.workload)
    reported_kw = jnp.stack([t.reported_kw for t in problem.targets])
    reported_e2e = jnp.stack([t.reported_e2e for t in problem.targets])
    data = [jnp.stack([jnp.log(kw) - jnp.log(reported_kw),
                       jnp.log(e2e) - jnp.log(reported_e2e)], axis=1).reshape(-1)]
    if problem.points:
        data.append(jnp.stack([band_miss(v, p.low, p.high)
                               for v, p in zip(values, problem.points, strict=True)]))
    prior = (params.flat() - problem.centre.flat()) / problem.width.flat()
    return jnp.concatenate([jnp.concatenate(data) / problem.data_width, prior])


class Inference(eqx.Module):
    """Solution of `infer`."""

    params: InferredParams
    """Fitted parameters (unconstrained)."""
    chip: Chip
    """The prior chip with the fitted parameters."""
    runtime: Runtime
    """The prior runtime with the fitted step overhead."""
    result: RESULTS
    """`perfmodel.solvers.RESULTS` code: successful, nonlinear_max_steps_reached, nonfinite,
    ..."""
    loss: jnp.ndarray
    """Half the sum of squared whitened residuals at `params` (dimensionless)."""
    steps: jnp.ndarray
    """Levenberg-Marquardt steps taken, accepted or rejected."""
    centre: InferredParams
    """The prior centre (the predicted-mode chip and runtime), unconstrained."""
    prior_width: jnp.ndarray
    """Per parameter (`InferredParams.names` order), its prior width (unconstrained
    units)."""
    posterior_width: jnp.ndarray
    """Per parameter, the Gauss-Newton posterior standard deviation at `params`
    (unconstrained units)."""
    misses: jnp.ndarray
    """Per target, the log misses of the (tokens/s per kW, E2E) ratios at `params`
    (shape (targets, 2))."""
    point_misses: jnp.ndarray
    """Per point target, its `band_miss` at `params` (shape (points,), log units)."""
    residual: jnp.ndarray
    """The whitened residuals at `params` (`residuals`; standard deviations)."""
    jacobian: jnp.ndarray
    """Their Jacobian in the unconstrained parameters, shape (residuals, parameters)."""
    claims: tuple[str, ...] = eqx.field(static=True, default=())
    """Claim id of each data residual (`Problem.claims`)."""
    names: tuple[str, ...] = eqx.field(static=True, default=INFERRED)
    """Parameter names (`InferredParams.names`)."""

    @property
    def width_ratio(self) -> jnp.ndarray:
        """Posterior over prior width per parameter: near 1, not identified by the data."""
        return self.posterior_width / self.prior_width

    def identified(self) -> dict[str, bool]:
        """Per parameter, whether the data narrow it below `IDENTIFIED_BELOW` of its prior
        width (concrete only)."""
        return {k: bool(r < IDENTIFIED_BELOW) for k, r in zip(self.names, self.width_ratio,
                                                              strict=True)}

    def report(self, prefix: str = "inferred_") -> dict:
        """Flat row entries: per scalar parameter (`INFERRED`) its value and prior centre (s
        or fraction), prior and posterior widths (log or logit units), their ratio, whether
        it is identified and its distance from the prior centre in prior widths
        (`_widths_from_prior`); `implausible`, the parameters (`names`) fitted more than
        `PLAUSIBLE_WIDTHS` from their centres (comma-separated); the loss and the result's
        message ("successful" on success). The tops are per target: `report_top`."""
        out = {}
        values, centre = self.params.values(), self.centre.values()
        away = np.abs(np.asarray(self.params.flat() - self.centre.flat())
                      / np.asarray(self.prior_width))
        # The widths go on to the tops (`report_top`): the scalars are their first entries.
        for k, prior, post in zip(INFERRED, self.prior_width[:len(INFERRED)],
                                  self.posterior_width[:len(INFERRED)], strict=True):
            out[prefix + k] = values[k]
            out[f"{prefix}{k}_prior"] = centre[k]
            out[f"{prefix}{k}_prior_width"] = float(prior)
            out[f"{prefix}{k}_posterior_width"] = float(post)
            out[f"{prefix}{k}_width_ratio"] = float(post / prior)
            out[f"{prefix}{k}_identified"] = bool(post / prior < IDENTIFIED_BELOW)
        for k, a in zip(INFERRED, away[:len(INFERRED)], strict=True):
            out[f"{prefix}{k}_widths_from_prior"] = float(a)
        out[prefix + "implausible"] = ",".join(
            n for n, a in zip(self.names, away, strict=True) if a > PLAUSIBLE_WIDTHS)
        out[prefix + "loss"] = float(self.loss)
        out[prefix + "result"] = message(self.result) or "successful"
        return out

    def report_top(self, index: int, prefix: str = "inferred_") -> dict:
        """Row entries of target `index`'s fitted top concurrency (requests per chip), its
        prior centre, widths (log units), their ratio and whether it is identified; {}
        where the tops were not fitted."""
        if index >= self.params.top_requests.shape[0]:
            return {}
        j = len(INFERRED) + index
        prior, post = float(self.prior_width[j]), float(self.posterior_width[j])
        key = prefix + "top_requests_per_chip"
        return {key: float(self.params.tops()[index]),
                key + "_prior": float(self.centre.tops()[index]),
                key + "_prior_width": prior, key + "_posterior_width": post,
                key + "_width_ratio": post / prior,
                key + "_identified": bool(post / prior < IDENTIFIED_BELOW)}

    def unmet(self, claim: str) -> str:
        """Why the fit leaves `claim` missed, derived from its residual and Jacobian: the
        parameter that closes the miss in the fewest prior widths alone (linearised, the
        others held), the value it would need and whether that is within
        `PLAUSIBLE_WIDTHS` of its prior centre (concrete only).

        Returns:
            A sentence; "" when the fit has no residual for `claim`, or meets it.
        """
        if claim not in self.claims:
            return ""
        residual = np.asarray(self.residual)
        jac = np.asarray(self.jacobian)
        rows = [i for i, c in enumerate(self.claims) if c == claim]
        i = max(rows, key=lambda r: abs(residual[r]))
        if abs(residual[i]) == 0.0:
            return ""
        width = np.asarray(self.prior_width)
        flat, centre = np.asarray(self.params.flat()), np.asarray(self.centre.flat())
        with np.errstate(divide="ignore", invalid="ignore"):
            step = -residual[i] / jac[i]           # unconstrained units, one parameter alone
        cost = np.where(np.isfinite(step), np.abs(step) / width, np.inf)
        j = int(np.argmin(cost))
        if not np.isfinite(cost[j]):
            return f"{claim}: no fitted parameter moves it"
        name = self.names[j]
        needed = flat[j] + step[j]
        away = abs(needed - centre[j]) / width[j]

        def shown(x):
            if name in FRACTIONS:
                return f"{float(jax.nn.sigmoid(x)):.3g} of peak"
            if name.startswith(TOP):
                return f"{float(np.exp(x)):.3g} requests/chip"
            return f"{float(np.exp(x)) * 1e6:.3g} us"

        direction = "above" if step[j] > 0 else "below"
        text = (f"{claim} needs {name} {direction} {shown(needed)} (the fewest prior widths "
                f"of any one parameter, linearised, predicted {shown(centre[j])}, fitted "
                f"{shown(flat[j])}): {away:.1f} prior widths from the prediction")
        if away > PLAUSIBLE_WIDTHS:
            return text + f", beyond the plausible {PLAUSIBLE_WIDTHS:g}"
        return text + (", within the plausible range, but the fit trades it against the "
                       "other figures and priors")


# The residuals and their Jacobian, one forward pass, compiled apart from the solve and called
# back from it (`perfmodel.solvers.called_back`: the solve with the serving model of three
# LLMs traced into it took 11 s to trace and 40 s to compile on 2 cores, against 3 and 6 s
# for this kernel). It runs a few hundred times per fit, a few ms each: it compiles as the
# optimizer's search kernel does (`search.compile.SEARCH_OPTIONS`).
_residuals_and_jacobian = compiled.filter_jit(forward_jacobian(residuals),
                                              lambda: SEARCH_OPTIONS)


def _solve(start: InferredParams, problem: Problem, solver, max_steps: int):
    solution = optx.least_squares(called_back(_residuals_and_jacobian), solver, start,
                                  args=problem,
                                  options={"jac": "fwd"}, max_steps=max_steps, throw=False)
    params = solution.value
    # The residuals and Jacobian of the accepted iterate (`solution.value`): the state keeps
    # its forward-mode linearisation, materialised here by one jvp per parameter, so the
    # solve's program is not linearised a second time (tests/test_inferred.py checks it
    # against jax.jacfwd at the solution).
    r = solution.state.f_info.residual
    jac = solution.state.f_info.jac.as_matrix()
    covariance = jnp.linalg.inv(jac.T @ jac)
    posterior = jnp.sqrt(jnp.diagonal(covariance))
    loss = 0.5 * jnp.sum(r ** 2)
    finite = jnp.isfinite(loss) & jnp.all(jnp.isfinite(posterior))
    result = RESULTS.where(finite, RESULTS.promote(solution.result), RESULTS.nonfinite)
    targets, points = len(problem.targets), len(problem.points)
    misses = r[:2 * targets].reshape(targets, 2) * problem.data_width
    point_misses = r[2 * targets:2 * targets + points] * problem.data_width
    chip, runtime = apply(params, problem.chip, problem.runtime)
    return Inference(params=params, chip=chip, runtime=runtime, result=result, loss=loss,
                     steps=solution.stats["num_steps"], centre=problem.centre,
                     prior_width=problem.width.flat(),
                     posterior_width=posterior, misses=misses, point_misses=point_misses,
                     residual=r, jacobian=jac, claims=problem.claims(),
                     names=start.names())


# The solve's own program (the Levenberg-Marquardt loop around the callback) compiles as the
# search kernel does too.
_solve_jit = compiled.filter_jit(_solve, lambda: SEARCH_OPTIONS)


def infer(chip: Chip, runtime: Runtime, targets, workload: Workload, *, points=(),
          start: InferredParams | None = None, widths: dict | None = None,
          data_width: float = DATA_WIDTH, max_steps: int = 100, rtol: float = 1e-6,
          atol: float = 1e-6, throw: bool = True) -> Inference:
    """Fit `INFERRED` parameters to reported ratios (Levenberg-Marquardt; module docstring).

    Args:
        chip, runtime: the predicted-mode chip and runtime: the prior centre, and everything
            not fitted.
        targets: `Target`s, one per reported pair. With a `Target.top` on each, their top
            concurrencies are fitted too (prior centre there, width `PRIOR_WIDTH[TOP]`).
        workload: request lengths.
        points: `PointTarget`s, reported figures at fixed sweep points (per-user speeds,
            high-interactivity ratios).
        start: the first iterate (default: the prior centre), e.g. a previous fit's
            parameters when refitting at new peak points.
        widths: prior widths by parameter, overriding `PRIOR_WIDTH` (log or logit units).
        data_width: standard deviation of a reported ratio's log (`DATA_WIDTH`).
        max_steps: Levenberg-Marquardt steps at most, accepted or rejected.
        rtol, atol: stop when a step changes the parameters and the residuals by less than
            atol + rtol x their max norm.
        throw: raise `RuntimeError` when the result is not successful.

    Returns:
        `Inference`, with its `perfmodel.solvers.RESULTS` code and the identification of
        each parameter.

    Raises:
        ValueError: no targets, a bad prior width or data width, a prior centre at the
            edge of its domain (a zero time, a fraction of 0 or 1), or a top on some
            targets but not all.
        RuntimeError: with `throw`, the fit did not succeed (step limit, non-finite
            residuals or Jacobian).

    Example (not run as a doctest: the solve compiles the serving model for about 20 s;
    tests/test_inferred.py runs the same fit):
        >>> from perfmodel.design import Layout
        >>> from perfmodel.presets import get_chip
        >>> from perfmodel.sweep import default_runtime
        >>> chip = get_chip("jalapeno")
        >>> t = Target("gpt-oss-120b", Layout(tp=2, dp_attention=True), 128.0, 86_000.0,
        ...            70.0, 1.9, 1.7)
        >>> out = infer(chip, default_runtime(chip), [t], Workload(8192, 1024))  # doctest: +SKIP
        >>> out.identified()  # doctest: +SKIP
    """
    targets = tuple(targets)
    if not targets:
        raise ValueError("infer needs at least one target (a reported pair to fit)")
    if not data_width > 0:
        raise ValueError(f"data_width is {data_width!r}: give a positive width (log units)")
    given = [bool(jnp.isfinite(t.top)) for t in targets]
    if any(given) and not all(given):
        raise ValueError(f"targets {[i for i, g in enumerate(given) if not g]} have no top "
                         "(Target.top NaN) but others do: give every target a top "
                         "concurrency, or none")
    tops = [float(t.top) for t in targets] if all(given) else []
    for i, top in enumerate(tops):
        if not top > 0:
            raise ValueError(f"targets[{i}].top is {top!r}: give a positive number of "
                             "requests per chip")
    centre = InferredParams.of(chip, runtime, tops)
    for name, value in zip(INFERRED, centre.flat(), strict=False):
        if not jnp.isfinite(value):
            where = "runtime" if name == "step_overhead" else "chip.efficiency"
            raise ValueError(f"{where}.{name} is {centre.values()[name]!r}: the prior centre "
                             "needs a positive time, or a fraction strictly between 0 and 1")
    problem = Problem(targets=targets, chip=chip, runtime=runtime, workload=workload,
                      centre=centre, width=InferredParams.widths(widths, len(tops)),
                      data_width=jnp.asarray(float(data_width)), points=tuple(points))
    start = centre if start is None else jax.tree.map(lambda x: jnp.asarray(x, dtype=float),
                                                      start)
    if start.top_requests.shape != centre.top_requests.shape:
        raise ValueError(f"start.top_requests has shape {start.top_requests.shape}, the "
                         f"targets' tops {centre.top_requests.shape}: start from a fit of "
                         "the same targets")
    out = _solve_jit(start, problem, levenberg_marquardt(rtol, atol), max_steps)
    check(out.result, "infer", throw, f"loss {float(out.loss):.6g} after {int(out.steps)} "
                                      "steps")
    return out
