"""The inferred mode of the Jalapeno comparison: the chip parameters the reported ratios
imply, and how well they imply each one.

Parameters (`InferredParams`, one field each, unconstrained): the fixed per-kernel and
per-step costs (the chip's `Efficiency.memory_latency` and `Efficiency.kernel_overhead`, the
runtime's `Runtime.step_overhead`: logs of seconds) and the attainable fractions of peak
(`Efficiency.attention_max` of FLOP/s in attention kernels, `Efficiency.bandwidth_max` of
HBM bandwidth: logits, so every value stays in (0, 1) without a penalty). Slice count and
HBM capacity are not fitted: with the peak at the top of each chip's concurrency sweep (a
fixed number of requests per chip) neither changes the peak point (issue 21).

Residuals (`residuals`), each a number of standard deviations:

- per reported pair (`Target`: one model at its predicted peak point, a single replica of
  the sweep's peak layout at its requests per replica), the log miss of the tokens/s per kW
  ratio and of the E2E ratio against the reported ones, over `DATA_WIDTH` (0.1: the ratios
  are rounded to one decimal, up to 3.3 %, and the model's median error on a chip left out
  of its fit is about 12 %, README "leave-one-chip-out");
- per parameter, its distance from the prior centre (the predicted-mode value: GPU-fitted
  efficiencies, the generic runtime) over its prior width (`PRIOR_WIDTH`, in its own
  unconstrained coordinate: 1 is a factor e on a time, and about 0.25 on a fraction near
  1/2, less towards 0 or 1).

Solver: `optimistix.least_squares` with `optimistix.LevenbergMarquardt`, Jacobians by
forward mode (`options={"jac": "fwd"}`: five tangents, and reverse mode gave NaN gradients of
chip fields through the serving model under jit on XLA:CPU). It stops when a step changes
the parameters and the residuals by less than atol + rtol x their size. A non-finite loss
or Jacobian at the solution is `RESULTS.nonfinite`; `throw=True` raises on any failure
(`perfmodel.solvers.check`).

Identification: under the Gauss-Newton approximation the posterior covariance of the
unconstrained parameters at the solution is (J^T J)^-1, J the Jacobian of the whitened
residuals (data and prior rows). `Inference.posterior_width` is the square root of its
diagonal, and `Inference.width_ratio` the posterior over the prior width: near 0 the
reported ratios pin the parameter down; near 1 they say nothing about it beyond the prior.
A parameter is reported identified when the ratio is below `IDENTIFIED_BELOW` (0.5: the
data at least halve its uncertainty).

What the data can say: at a fixed number of requests per chip a model's two ratios are the
same function of these parameters up to a constant (Little's law: tokens/s per kW is
requests x tokens per request / E2E / TDP), so each reported pair constrains one
combination of the five, through two residuals whose Jacobian rows are equal. Where a pair
asks for more per-kW gain and more latency gain than Little's law allows at the peak's
requests per chip (`jalapeno.consistency`: all three reported pairs), no parameter value
matches both, and the fit splits the miss between them.
"""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optimistix as optx

from ..design import Design, Layout, Runtime, precision
from ..hardware import Chip
from ..kvcache import max_batch
from ..presets import get_model
from ..serving import predict
from ..smooth import smooth_min
from ..solvers import RESULTS, check, message
from ..workload import Workload

#: Fitted parameters, in the order of `InferredParams`' fields and of the Jacobian columns.
INFERRED = ("memory_latency", "kernel_overhead", "step_overhead", "attention_max",
            "bandwidth_max")

#: Parameters fitted through a logit (fractions of a peak); the others through a log.
FRACTIONS = ("attention_max", "bandwidth_max")

#: Prior width of each parameter in its unconstrained coordinate (log of s, or logit).
PRIOR_WIDTH = {"memory_latency": 1.0, "kernel_overhead": 1.0, "step_overhead": 1.0,
               "attention_max": 1.0, "bandwidth_max": 1.0}

#: Standard deviation of a reported ratio's log (see the module docstring).
DATA_WIDTH = 0.1

#: A parameter is identified when its posterior width is below this fraction of its prior's.
IDENTIFIED_BELOW = 0.5


def _number(x):
    # Explicit dtype: a Python float would give a weakly typed array, whose compiled solve
    # a strongly typed one (a ratio computed by the model) would not reuse.
    return jnp.asarray(x, dtype=float)


class InferredParams(eqx.Module):
    """The inferred mode's parameters, unconstrained (see the module docstring).

    Example:
        >>> from perfmodel.presets import get_chip
        >>> from perfmodel.sweep import default_runtime
        >>> chip = get_chip("jalapeno")
        >>> p = InferredParams.of(chip, default_runtime(chip))
        >>> round(p.values()["step_overhead"], 6), round(p.values()["bandwidth_max"], 3)
        (0.001, 0.882)
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

    @classmethod
    def of(cls, chip: Chip, runtime: Runtime) -> InferredParams:
        """The parameters of `chip` and `runtime` (float64 where x64 is on)."""
        e = chip.efficiency

        def log(x):
            return jnp.log(jnp.asarray(x, dtype=float))

        def logit(x):
            x = jnp.asarray(x, dtype=float)
            return jnp.log(x) - jnp.log1p(-x)

        return cls(memory_latency=log(e.memory_latency), kernel_overhead=log(e.kernel_overhead),
                   step_overhead=log(runtime.step_overhead),
                   attention_max=logit(e.attention_max), bandwidth_max=logit(e.bandwidth_max))

    @classmethod
    def widths(cls, widths: dict | None = None) -> InferredParams:
        """Prior widths as an `InferredParams` (`PRIOR_WIDTH`, updated by `widths`).

        Raises:
            ValueError: a key that is not a field, or a width that is not positive.
        """
        given = dict(PRIOR_WIDTH, **(widths or {}))
        for key, value in given.items():
            if key not in INFERRED:
                raise ValueError(f"prior width {key!r}: the fitted parameters are {INFERRED}")
            if not value > 0:
                raise ValueError(f"prior width of {key} is {value!r}: give a positive width "
                                 "(in log or logit units)")
        return cls(**{k: float(v) for k, v in given.items()})

    def flat(self) -> jnp.ndarray:
        """The fields as one vector, in `INFERRED` order."""
        return jnp.stack([jnp.asarray(getattr(self, k), dtype=float) for k in INFERRED])

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
        >>> round(float(r.step_overhead), 6), float(c.efficiency.bandwidth_max) > 0.88
        (0.002, True)
    """
    e = chip.efficiency
    chip = eqx.tree_at(
        lambda c: (c.efficiency.memory_latency, c.efficiency.kernel_overhead,
                   c.efficiency.attention_max, c.efficiency.bandwidth_max), chip,
        (jnp.exp(params.memory_latency).astype(e.memory_latency.dtype),
         jnp.exp(params.kernel_overhead).astype(e.kernel_overhead.dtype),
         jax.nn.sigmoid(params.attention_max).astype(e.attention_max.dtype),
         jax.nn.sigmoid(params.bandwidth_max).astype(e.bandwidth_max.dtype)))
    runtime = eqx.tree_at(lambda r: r.step_overhead, runtime,
                          jnp.exp(params.step_overhead).astype(runtime.step_overhead.dtype))
    return chip, runtime


class Target(eqx.Module):
    """One reported pair to fit: a model at its predicted peak point, against the baseline's
    peak (fixed) and the reported ratios.

    Example:
        >>> t = Target("gpt-oss-120b", Layout.parse("tp2-dpa"), concurrency=128.0,
        ...            baseline_kw=86_000.0, baseline_e2e=70.0, reported_kw=1.9,
        ...            reported_e2e=1.7)
        >>> t.layout.tp, float(t.reported_kw)
        (2, 1.9)
    """

    model: str = eqx.field(static=True)
    """Model preset name."""
    layout: Layout = eqx.field(static=True)
    """The peak point's layout (its replicas are ignored: one replica is evaluated)."""
    concurrency: jnp.ndarray = eqx.field(converter=_number)
    """Requests in flight per replica at the peak (requests; capped by the batch that fits
    as the parameters move)."""
    baseline_kw: jnp.ndarray = eqx.field(converter=_number)
    """The baseline's tokens/s per kW of TDP at its peak (tokens/s/kW)."""
    baseline_e2e: jnp.ndarray = eqx.field(converter=_number)
    """The baseline's end-to-end latency at its peak (s)."""
    reported_kw: jnp.ndarray = eqx.field(converter=_number)
    """Reported tokens/s per kW ratio, chip over baseline (dimensionless)."""
    reported_e2e: jnp.ndarray = eqx.field(converter=_number)
    """Reported E2E latency ratio, baseline over chip (dimensionless)."""


def peak_metrics(target: Target, chip: Chip, runtime: Runtime, workload: Workload):
    """(tokens/s per kW of TDP, E2E in s) of one replica of `target`'s layout at its
    concurrency (capped by the batch that fits with `chip` and `runtime`): the peak point,
    differentiably. By the envelope theorem the gradient of the sweep's maximum is the
    gradient at its maximiser, so between re-sweeps this point stands in for the peak."""
    model = get_model(target.model)
    prec = precision(chip, model, "fp4")
    single = dataclasses.replace(target.layout, replicas=1)
    context = workload.mean_input_len + workload.mean_output_len / 2.0
    fit = max_batch(model, single, prec, chip.hbm_capacity, context, runtime.memory_fraction,
                    runtime.activation_reserve, None, chip.num_slices)
    conc = smooth_min(jnp.maximum(fit, 1.0), target.concurrency)
    design = Design(concurrency=conc, layout=single, precision=prec, runtime=runtime)
    m = predict(model, chip, workload, design, check=False, unfit="value", vectorize=True)
    return m.tok_s_per_kw_tdp, m.e2e


def ratios(params: InferredParams, targets, chip: Chip, runtime: Runtime,
           workload: Workload) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The ratios `params` predict at each target's peak point (traceable).

    Args:
        params: the fitted parameters, applied to `chip` and `runtime` (`apply`).
        targets: `Target`s (their layouts, concurrencies and baselines; the reported
            ratios are not read).
        chip, runtime, workload: the rest of the prediction.

    Returns:
        (tokens/s per kW ratios, chip over baseline; E2E ratios, baseline over chip), each
        of shape (targets,), dimensionless.
    """
    chip, runtime = apply(params, chip, runtime)
    kw, e2e = [], []
    for t in targets:
        k, e = peak_metrics(t, chip, runtime, workload)
        kw.append(k / t.baseline_kw)
        e2e.append(t.baseline_e2e / e)
    return jnp.stack(kw), jnp.stack(e2e)


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
    """Standard deviation of a reported ratio's log (dimensionless)."""


def residuals(params: InferredParams, problem: Problem) -> jnp.ndarray:
    """Whitened residuals of the fit (module docstring; traceable).

    Returns:
        Shape (2 x targets + 5,), in standard deviations: per target the log misses of its
        tokens/s per kW and E2E ratios over the data width, then per parameter (`INFERRED`
        order) its distance from the prior centre over its prior width.
    """
    kw, e2e = ratios(params, problem.targets, problem.chip, problem.runtime, problem.workload)
    reported_kw = jnp.stack([t.reported_kw for t in problem.targets])
    reported_e2e = jnp.stack([t.reported_e2e for t in problem.targets])
    data = jnp.stack([jnp.log(kw) - jnp.log(reported_kw),
                      jnp.log(e2e) - jnp.log(reported_e2e)], axis=1).reshape(-1)
    prior = (params.flat() - problem.centre.flat()) / problem.width.flat()
    return jnp.concatenate([data / problem.data_width, prior])


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
    """Per parameter (`INFERRED` order), its prior width (unconstrained units)."""
    posterior_width: jnp.ndarray
    """Per parameter, the Gauss-Newton posterior standard deviation at `params`
    (unconstrained units)."""
    misses: jnp.ndarray
    """Per target, the log misses of the (tokens/s per kW, E2E) ratios at `params`
    (shape (targets, 2))."""

    @property
    def width_ratio(self) -> jnp.ndarray:
        """Posterior over prior width per parameter: near 1, not identified by the data."""
        return self.posterior_width / self.prior_width

    def identified(self) -> dict[str, bool]:
        """Per parameter, whether the data narrow it below `IDENTIFIED_BELOW` of its prior
        width (concrete only)."""
        return {k: bool(r < IDENTIFIED_BELOW) for k, r in zip(INFERRED, self.width_ratio,
                                                              strict=True)}

    def report(self, prefix: str = "inferred_") -> dict:
        """Flat row entries: per parameter its value and prior centre (s or fraction),
        prior and posterior widths (log or logit units), their ratio and whether it is
        identified; the loss and the result's message ("successful" on success)."""
        out = {}
        values, centre = self.params.values(), self.centre.values()
        for k, prior, post in zip(INFERRED, self.prior_width, self.posterior_width,
                                  strict=True):
            out[prefix + k] = values[k]
            out[f"{prefix}{k}_prior"] = centre[k]
            out[f"{prefix}{k}_prior_width"] = float(prior)
            out[f"{prefix}{k}_posterior_width"] = float(post)
            out[f"{prefix}{k}_width_ratio"] = float(post / prior)
            out[f"{prefix}{k}_identified"] = bool(post / prior < IDENTIFIED_BELOW)
        out[prefix + "loss"] = float(self.loss)
        out[prefix + "result"] = message(self.result) or "successful"
        return out


def _solve(start: InferredParams, problem: Problem, solver, max_steps: int):
    solution = optx.least_squares(residuals, solver, start, args=problem,
                                  options={"jac": "fwd"}, max_steps=max_steps, throw=False)
    params = solution.value
    # The residuals and Jacobian of the accepted iterate (`solution.value`): the state keeps
    # its forward-mode linearisation, materialised here by five jvps, so the solve's
    # program is not linearised a second time (tests/test_inferred.py checks it against
    # jax.jacfwd at the solution).
    r = solution.state.f_info.residual
    jac = solution.state.f_info.jac.as_matrix()
    covariance = jnp.linalg.inv(jac.T @ jac)
    posterior = jnp.sqrt(jnp.diagonal(covariance))
    loss = 0.5 * jnp.sum(r ** 2)
    finite = jnp.isfinite(loss) & jnp.all(jnp.isfinite(posterior))
    result = RESULTS.where(finite, RESULTS.promote(solution.result), RESULTS.nonfinite)
    targets = len(problem.targets)
    misses = r[:2 * targets].reshape(targets, 2) * problem.data_width
    chip, runtime = apply(params, problem.chip, problem.runtime)
    return Inference(params=params, chip=chip, runtime=runtime, result=result, loss=loss,
                     steps=solution.stats["num_steps"], centre=problem.centre,
                     prior_width=problem.width.flat(),
                     posterior_width=posterior, misses=misses)


@functools.cache
def _base_solver() -> optx.LevenbergMarquardt:
    # One instance: each holds its own `verbose` function, a static part of the compiled
    # solve, so a new instance would retrace it (as calibration.solve).
    return optx.LevenbergMarquardt(rtol=jnp.asarray(0.0), atol=jnp.asarray(0.0))


def _solver(rtol: float, atol: float) -> optx.LevenbergMarquardt:
    return eqx.tree_at(lambda s: (s.rtol, s.atol), _base_solver(),
                       (jnp.asarray(rtol, dtype=float), jnp.asarray(atol, dtype=float)))


_solve_jit = eqx.filter_jit(_solve)


def infer(chip: Chip, runtime: Runtime, targets, workload: Workload, *,
          start: InferredParams | None = None, widths: dict | None = None,
          data_width: float = DATA_WIDTH, max_steps: int = 100, rtol: float = 1e-6,
          atol: float = 1e-6, throw: bool = True) -> Inference:
    """Fit `INFERRED` parameters to reported ratios (Levenberg-Marquardt; module docstring).

    Args:
        chip, runtime: the predicted-mode chip and runtime: the prior centre, and everything
            not fitted.
        targets: `Target`s, one per reported pair.
        workload: request lengths.
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
        ValueError: no targets, a bad prior width or data width, or a prior centre at the
            edge of its domain (a zero time, a fraction of 0 or 1).
        RuntimeError: with `throw`, the fit did not succeed (step limit, non-finite
            residuals or Jacobian).

    Example (not run as a doctest: the solve compiles the serving model for about 20 s;
    tests/test_inferred.py runs the same fit):
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
    centre = InferredParams.of(chip, runtime)
    for name, value in zip(INFERRED, centre.flat(), strict=True):
        if not jnp.isfinite(value):
            where = "runtime" if name == "step_overhead" else "chip.efficiency"
            raise ValueError(f"{where}.{name} is {centre.values()[name]!r}: the prior centre "
                             "needs a positive time, or a fraction strictly between 0 and 1")
    problem = Problem(targets=targets, chip=chip, runtime=runtime, workload=workload,
                      centre=centre, width=InferredParams.widths(widths),
                      data_width=jnp.asarray(float(data_width)))
    start = centre if start is None else jax.tree.map(lambda x: jnp.asarray(x, dtype=float),
                                                      start)
    out = _solve_jit(start, problem, _solver(rtol, atol), max_steps)
    check(out.result, "infer", throw, f"loss {float(out.loss):.6g} after {int(out.steps)} "
                                      "steps")
    return out
