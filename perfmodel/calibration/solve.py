"""The latency fit: `optimistix.least_squares` with Levenberg-Marquardt on the Huber-
transformed residual blocks (`latency`), Jacobians by forward-mode autodiff.

Solver: `optimistix.LevenbergMarquardt` (Levenberg 1944, Marquardt 1963) on the residuals
`latency.huber_residuals(r, delta)`, whose half sum of squares is the Huber loss (Huber 1964)
of the weighted log residuals and the priors: a least-squares problem whose Gauss-Newton
steps are robust to the odd broken run. It stops when the parameters and the residuals both
change by less than atol + rtol x their size in a step (a Cauchy test, in the max norm).

Compilation: the solve is one program (optimistix runs its loop under `jax.lax.while_loop`),
holding every batch of rows and its Jacobian. What keeps it affordable: aggregated rows of
one model, chip and precision share one vmapped function (`data.batches`), the model runs
with `vectorize=True`, each row's Jacobian is taken in its own family and framework
parameters (`latency.rowwise_jacobian`), and XLA:CPU's fusion emitters are off
(`_CPU_COMPILER_OPTIONS`).
Which rows and samples are fitted are weights (array leaves), so every refit on a subset
(held-out, leave-one-chip-out) reuses the compiled program.

Devices: `devices=` (on `fit` and `Calibration`) splits the end-to-end rows over a 1-D mesh
of local devices (`latency.EndToEnd.sharded`): each device evaluates its rows and their
Jacobians; the parameters and the Levenberg-Marquardt linear algebra stay replicated. The
default (None) is the one-device program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optimistix as optx

from ..datasets import BenchRow
from ..grid.shard import Placement, placement
from ..presets import chip_key, get_chip
from ..search.compile import compiler_options
from ..solvers import RESULTS, check, levenberg_marquardt, succeeded
from .latency import OUTPUTS, AbstractBlock, EndToEnd, OpTimings, Prior, huber_residuals
from .params import FAMILY_FALLBACK, POOLED, Params, prior_widths, resolve_family

#: Huber threshold on the weighted log residuals (0.2 is about 22 %).
DELTA = 0.2

# XLA:CPU's fusion emitters double this scalar-heavy program's compile time without
# speeding it up (measured with jaxlib 0.10 on one disaggregated batch's Jacobian: 4.9 s ->
# 2.5 s); `search.compile.compiler_options` keeps the flag where this XLA accepts it.
_CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
#: Basin hopping (`hop`): a move shifts a value by this many prior widths (normal draws) ...
HOP_SCALE = 1.0
#: ... and moves each value with this chance.
HOP_FRACTION = 0.2


class LatencyFit(eqx.Module):
    """Solution of `fit`.

    Example:
        >>> from perfmodel.solvers import succeeded
        >>> p = Params.prior(("hopper",), ())
        >>> out = fit(p.with_flat(p.flat + 0.1), [Prior.build(p)])
        >>> succeeded(out.result), float(out.loss) < 1e-12
        (True, True)
    """

    params: Params
    """The fitted parameters (unconstrained space)."""
    result: RESULTS
    """`perfmodel.solvers.RESULTS` code: successful, nonlinear_max_steps_reached, nonfinite,
    ..."""
    loss: jnp.ndarray
    """Huber loss of the weighted log residuals plus the priors' half sum of squares, at
    `params` (dimensionless)."""
    steps: jnp.ndarray
    """Levenberg-Marquardt steps taken, accepted or rejected."""
    aux: tuple
    """Per block, its auxiliary outputs at `params` (`EndToEnd`: the `latency.OUTPUTS` of
    every row)."""
    hop: int = eqx.field(static=True, default=0)
    """`hop`: the move whose solve found `params` (1 for the first move; 0: the solve from
    the starting point). Moves are drawn in order from the seed, so `hop` with this many
    moves and the same seed returns this fit again."""


def _residuals(params: Params, args):
    blocks, delta = args
    parts = [block(params) for block in blocks]
    r = jnp.concatenate([huber_residuals(r, delta) for r, _ in parts])
    return r, tuple(aux for _, aux in parts)


def _solve(params, blocks, delta, solver, max_steps):
    solution = optx.least_squares(_residuals, solver, params, args=(blocks, delta),
                                  has_aux=True, max_steps=max_steps, throw=False)
    # The residuals and auxiliary outputs of the accepted iterate: in optimistix's
    # Gauss-Newton loop `solution.aux` is the previous accepted iterate's.
    state = solution.state
    loss = 0.5 * jnp.sum(state.f_info.residual ** 2)
    result = RESULTS.where(jnp.isfinite(loss), RESULTS.promote(solution.result),
                           RESULTS.nonfinite)
    return LatencyFit(params=solution.value, result=result, loss=loss,
                      steps=solution.stats["num_steps"], aux=state.aux)


@functools.cache
def _jitted(fun):
    # Built on first use: the compiler-option probe starts the backend.
    return eqx.filter_jit(fun, compiler_options=compiler_options(_CPU_COMPILER_OPTIONS))


def devices_placement(devices: int | str | None) -> Placement | None:
    """Where the end-to-end rows are evaluated: None (the default, one device), the first
    `devices` local devices, or "all" of them; None when that is one device.

    Raises:
        ValueError: not None, a positive int or "all", or more devices than this process
            has.

    Example:
        >>> devices_placement(None) is None, devices_placement(1) is None
        (True, True)
    """
    if devices is None:
        return None
    if devices == "all":
        place = placement(None)
    elif isinstance(devices, int) and not isinstance(devices, bool):
        place = placement(devices)
    else:
        raise ValueError(f"devices must be None, a number of local devices or 'all', got "
                         f"{devices!r}")
    return place if place.count > 1 else None


def _placed(blocks, devices):
    place = devices_placement(devices)
    if place is None:
        return tuple(blocks)
    return tuple(b.sharded(place) if isinstance(b, EndToEnd) and b.placement is None else b
                 for b in blocks)


def fit(params: Params, blocks: Sequence[AbstractBlock], *, max_steps: int = 100,
        delta: float = DELTA, rtol: float = 1e-4, atol: float = 1e-4,
        throw: bool = True, devices: int | str | None = None) -> LatencyFit:
    """Levenberg-Marquardt on the Huber-transformed residual blocks.

    Args:
        params: starting point (and the families and frameworks that are fitted).
        blocks: residual blocks (`latency.EndToEnd`, `latency.OpTimings`, `latency.Prior`).
        max_steps: Levenberg-Marquardt steps at most, accepted or rejected.
        delta: Huber threshold on the weighted log residuals (0.2: about 22 %).
        rtol, atol: stop when a step changes the parameters and the residuals by less than
            atol + rtol x their max norm.
        throw: raise `RuntimeError` when the result is not successful.
        devices: split the `EndToEnd` blocks' rows over this many local devices, or "all"
            (`devices_placement`); None (default): one device. Blocks already sharded
            (`EndToEnd.sharded`) keep their devices.

    Returns:
        `LatencyFit` with the result code (`perfmodel.solvers.RESULTS`).

    Raises:
        RuntimeError: with `throw`, the solve did not succeed (max steps, non-finite loss).

    Example:
        >>> from perfmodel.solvers import succeeded
        >>> p = Params.prior(("hopper",), ())
        >>> out = fit(p.with_flat(p.flat + 1.0), [Prior.build(p)], max_steps=20)
        >>> succeeded(out.result), round(float(out.loss), 9)
        (True, 0.0)
    """
    if not blocks:
        raise ValueError("fit needs at least one residual block")
    out = _jitted(_solve)(params, _placed(blocks, devices), jnp.asarray(delta, dtype=float),
                          levenberg_marquardt(float(rtol), float(atol)), max_steps)
    check(out.result, "calibrate", throw,
          f"loss {float(out.loss):.6g} after {int(out.steps)} steps")
    return out


def hop(params: Params, blocks: Sequence[AbstractBlock], *, hops: int, seed: int = 0,
        scale: float = HOP_SCALE, fraction: float = HOP_FRACTION, max_steps: int = 100,
        delta: float = DELTA, rtol: float = 1e-4, atol: float = 1e-4,
        devices: int | str | None = None) -> LatencyFit:
    """Basin hopping (Wales and Doye 1997, J. Phys. Chem. A 101, 5111) over `fit`: solve
    from `params`, then `hops` times move a random `fraction` of the unconstrained values
    of the best minimum so far by `scale` prior widths (normal draws, seeded) and solve
    again from there, keeping a minimum only when its solve succeeds with a lower loss.

    Levenberg-Marquardt stops at the first minimum it reaches, and the latency objective
    has several: a log-parametrized term whose prior sits orders of magnitude below what
    some rows want (a per-rank host time of microseconds where a stack pays milliseconds)
    has almost no gradient there, so a solve from the priors explains those rows with
    other terms and stays (calibration/README.md, "Local minima of the fit").

    Args:
        params: starting point (and the families and frameworks that are fitted).
        blocks, max_steps, delta, rtol, atol, devices: as `fit`.
        hops: moves to try (0: `fit` alone).
        seed: of the moves' random draws (the result is a function of it).
        scale: size of a move, in prior widths (`params.prior_widths`).
        fraction: chance that a value moves in a hop.

    Returns:
        The `LatencyFit` of the lowest minimum found (its result code that solve's; its
        `hop` the move that found it).

    Raises:
        ValueError: `hops` negative, `scale` not positive or `fraction` outside (0, 1].

    Example:
        >>> p = Params.prior(("hopper",), ())
        >>> out = hop(p.with_flat(p.flat + 1.0), [Prior.build(p)], hops=2, max_steps=20)
        >>> round(float(out.loss), 9)
        0.0
    """
    if hops < 0 or not scale > 0 or not 0 < fraction <= 1:
        raise ValueError(f"hop needs hops >= 0, scale > 0 and 0 < fraction <= 1; got "
                         f"hops={hops}, scale={scale}, fraction={fraction}")
    kwargs = dict(max_steps=max_steps, delta=delta, rtol=rtol, atol=atol, throw=False,
                  devices=devices)
    best = fit(params, blocks, **kwargs)
    rng = np.random.default_rng(seed)
    widths = prior_widths(params.families, params.frameworks)
    for move in range(1, hops + 1):
        moved = rng.random(widths.size) < fraction
        step = np.where(moved, scale * widths * rng.standard_normal(widths.size), 0.0)
        out = fit(best.params.with_flat(best.params.flat + step), blocks, **kwargs)
        if succeeded(out.result) and float(out.loss) < float(best.loss):
            best = dataclasses.replace(out, hop=move)
    return best


def _evaluate(block: EndToEnd, parameter_rows):
    return block.evaluate(parameter_rows, differentiable=False)


class Calibration:
    """Residual blocks of every data set, refittable on any subset without recompiling.

    Args:
        rows: InferenceMAX rows with measurements (all of them: weights pick what is fitted).
        gemm, nccl: op-level samples (`datasets.load_gemm`, `datasets.load_nccl`).
        devices: split the end-to-end rows over this many local devices, or "all", in every
            fit and prediction (`devices_placement`); None (default): one device.
    """

    def __init__(self, rows: Sequence[BenchRow], gemm: Sequence[dict] = (),
                 nccl: Sequence[dict] = (), devices: int | str | None = None):
        self.rows = list(rows)
        self.end_to_end, self.errors = EndToEnd.build(self.rows)
        self.end_to_end = _placed([self.end_to_end], devices)[0]
        self.gemm = OpTimings.gemm(gemm) if gemm else None
        self.nccl = OpTimings.nccl(nccl) if nccl else None
        #: `BenchRow.index` -> position in `rows` (the order of `predict` and `fits`).
        self.position = {row.index: k for k, row in enumerate(self.rows)}
        self._family = {name: get_chip(name, calibrated=False).family
                        for name in {r.hardware for r in self.rows}}
        ops = [b for b in (self.gemm, self.nccl) if b is not None]
        self._end_to_end_at = len(ops)     # the joint fit's blocks: ops, end to end, prior
        self.families = tuple(sorted({b.family for b in self.end_to_end.batches}
                                     | {f for b in ops for f in b.families}))
        self.frameworks = tuple(sorted({r.framework for r in self.rows}))

    @property
    def batches(self) -> int:
        """Vmapped model functions the end-to-end rows are evaluated with."""
        return len(self.end_to_end.batches)

    def fit(self, rows: Sequence[BenchRow] | None = None, *, exclude_chip: str | None = None,
            max_steps: int = 100, rtol: float = 1e-4, atol: float = 1e-4,
            pooling: float | None = None, throw: bool = True, hops: int = 0, seed: int = 0
            ) -> tuple[LatencyFit, tuple, tuple]:
        """Fit from the priors: op-level blocks alone, then jointly with the end-to-end rows.

        Args:
            rows: the end-to-end rows to fit (a subset of the constructor's); all when None.
            exclude_chip: leave every sample of this chip preset out (leave-one-chip-out).
            max_steps, rtol, atol, throw: as `fit` (the joint stage).
            pooling: partial pooling of the families (`latency.Prior`); adds a `POOLED` row,
                returned among the families with data.
            hops, seed: basin hopping of the joint stage (`hop`); 0 hops: one solve.

        Returns:
            (fit, families that had data, frameworks that had data). Rows whose weights and
            one sequence do not fit in HBM are not fitted (their predictions collapse;
            `predict_rows` flags them).
        """
        chosen = {r.index for r in (self.rows if rows is None else rows)}
        key = chip_key(exclude_chip) if exclude_chip else None
        by_index = {r.index: r for r in self.rows}
        e2e_rows = [by_index[i] for i in self.end_to_end.indices]
        weights = np.array([1.0 if r.index in chosen and chip_key(r.hardware) != key else 0.0
                            for r in e2e_rows])
        names = self.families + ((POOLED,) if pooling is not None else ())
        params = Params.prior(names, self.frameworks)
        ops = [b.with_weights([0.0 if c == key else 1.0 for c in b.sample_chips])
               for b in (self.gemm, self.nccl) if b is not None]
        prior = Prior.build(params, pooling)
        if ops:
            # The op-level stage is the joint problem with the end-to-end rows weighted 0:
            # one compiled program serves both stages.
            idle = self.end_to_end.with_weights(np.zeros(len(weights)))
            params = fit(params, ops + [idle, prior], max_steps=max_steps, rtol=rtol,
                         atol=atol, throw=False).params
        end_to_end = self.end_to_end.with_weights(weights)
        blocks = ops + [end_to_end, prior]
        result = hop(params, blocks, hops=hops, seed=seed, max_steps=max_steps, rtol=rtol,
                     atol=atol)
        check(result.result, "calibrate", throw,
              f"loss {float(result.loss):.6g} after {int(result.steps)} steps")
        excess = np.asarray(result.aux[self._end_to_end_at])[:, OUTPUTS.index("memory_excess")]
        fitted = [r for r, w, e in zip(e2e_rows, weights, excess, strict=True)
                  if w > 0 and e <= 0]
        families = sorted({self._family[r.hardware] for r in fitted}
                          | {f for b in ops for c, f in zip(b.sample_chips, b.sample_families,
                                                            strict=True) if c != key}
                          | ({POOLED} if pooling is not None else set()))
        frameworks = sorted({r.framework for r in fitted})
        return result, tuple(families), tuple(frameworks)

    def predict(self, params: Params, fallback: dict | None = None) -> dict:
        """Per row of `rows`: predicted tput/GPU (tokens/s), median TPOT, TTFT and E2E (s),
        memory excess, and the basis.

        Families absent from `params` use `fallback` (default `params.FAMILY_FALLBACK`),
        frameworks absent use `params.FRAMEWORK_FALLBACK`, else priors. Rows that cannot be
        modelled are NaN.
        """
        x = self.end_to_end.parameter_rows(params, fallback, strict=False)
        values = np.asarray(_jitted(_evaluate)(self.end_to_end, x))
        keys = ("tput_per_gpu", "median_tpot_s", "median_ttft_s", "median_e2el_s")
        out = {k: np.full(len(self.rows), np.nan) for k in keys + ("memory_excess",)}
        out["basis"] = [""] * len(self.rows)
        k = np.array([self.position[i] for i in self.end_to_end.indices], dtype=int)
        for c, key in enumerate(keys):
            out[key][k] = np.exp(values[:, c])
        out["memory_excess"][k] = values[:, OUTPUTS.index("memory_excess")]
        for b in self.end_to_end.batches:
            _, basis = resolve_family(b.family, params,
                                      FAMILY_FALLBACK if fallback is None else fallback)
            for i in b.indices:
                out["basis"][self.position[i]] = basis
        return out

    def fits(self, result: LatencyFit | None = None) -> np.ndarray:
        """Per row of `rows`: True when its weights and one sequence fit in HBM (which the
        fitted parameters do not change), False when not or when it cannot be modelled.

        Args:
            result: a fit of this problem (`fit`) whose outputs say it; None evaluates the
                rows at the priors (compiles the prediction program).
        """
        if result is None:
            excess = self.predict(Params.prior(self.families,
                                               self.frameworks))["memory_excess"]
        else:
            k = np.array([self.position[i] for i in self.end_to_end.indices], dtype=int)
            excess = np.full(len(self.rows), np.nan)
            excess[k] = np.asarray(result.aux[self._end_to_end_at])[
                :, OUTPUTS.index("memory_excess")]
        return np.isfinite(excess) & (excess <= 0)


def calibrate(rows: Sequence[BenchRow], gemm: Sequence[dict] = (), nccl: Sequence[dict] = (),
              *, exclude_chip: str | None = None, max_steps: int = 100,
              pooling: float | None = None, throw: bool = True,
              devices: int | str | None = None) -> tuple[LatencyFit, tuple]:
    """Fit the parameters of every family and framework the data covers (`Calibration`
    refits subsets without recompiling; `devices` as there).

    Returns:
        (fit, families that had data).
    """
    problem = Calibration(rows, gemm, nccl, devices=devices)
    result, families, _ = problem.fit(exclude_chip=exclude_chip, max_steps=max_steps,
                                      pooling=pooling, throw=throw)
    return result, families
