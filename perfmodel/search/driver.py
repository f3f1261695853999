"""The design optimizer: `optimize` runs the relaxed search, screens the layouts, hardens the
kept ones and prices the constraints of the result, all in one compiled kernel per kind of
layout; `OptimizeResult` reports it.

Every layout is a branch of the search. Aggregated layouts enter the kernel as numbers
(`Layout.numbers()`, stacked), so one compilation serves any set of them, and `jax.vmap`
runs their searches side by side; a grid with one aggregated layout keeps it static (a
smaller kernel), and each disaggregated layout has a static kernel of its own. Inside a
kernel:

1. every layout runs `len(starts)` trajectories of the augmented-Lagrangian solver
   (`lagrangian.AugmentedLagrangian`) over the relaxation (`relax.Relaxed`);
2. the relaxed designs are rounded to the grid and evaluated exactly; with more layouts
   than `keep_layouts`, only the best by that and by the relaxed loss go on (the screen,
   `harden.screen_order`: successive halving with one rung, as in Hyperband, Li et al.,
   JMLR 18, 2018);
3. each kept layout is hardened by local search (`harden.harden`) and the best hardened
   design chosen;
4. its shadow prices come from the exact model's derivatives there
   (`sensitivity.sensitivity`).
"""

from __future__ import annotations

import dataclasses
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..architecture import Model
from ..compiled import filter_jit, side_by_side
from ..design import Design, Layout, LayoutNumbers
from ..hardware import Chip
from ..progress import bar
from ..smooth import DEFAULT_SHARPNESS
from ..solvers import RESULTS, check
from ..workload import Workload
from .compile import search_kernel
from .evaluate import FEASIBLE_TOL, Evaluation, Problem, materialize, problem
from .harden import Hardened, Neighbourhood, harden, neighbourhood
from .lagrangian import AugmentedLagrangian, run
from .relax import Relaxed
from .sensitivity import Sensitivity, sensitivity, shadow_prices
from .space import CONSTRAINTS, OBJECTIVES, UNITS, Space, Targets, tables

_RESULT_NAMES = ("successful", "infeasible", "nonlinear_max_steps_reached")


def _result_name(result) -> str:
    return next(name for name in _RESULT_NAMES if result == getattr(RESULTS, name))


class _Branches(eqx.Module):
    """What one search kernel returns: the hardened walkers (`Hardened`, one per kept
    layout), the relaxed solutions of their layouts (walker axis, then starts), and the
    best walker's sensitivity."""

    hardened: Hardened
    lam: jnp.ndarray
    scores: jnp.ndarray
    violations: jnp.ndarray
    steps: jnp.ndarray
    converged: jnp.ndarray
    relaxed: Evaluation
    relaxed_loss: jnp.ndarray
    best: jnp.ndarray
    sensitivity: Sensitivity


# A search is two kernels, the relaxed search (`_relax`, a reverse-mode loop) and what
# follows it (`_refine`: hardening, the multipliers, the sensitivities), lowered one after
# the other and compiled side by side (`compiled.side_by_side`): compilation is most of a
# cold search, and XLA:CPU compiles each kernel on one core.


def _unravel(starts: Relaxed):
    return jax.flatten_util.ravel_pytree(jax.tree_util.tree_map(lambda x: x[0], starts))[1]


@search_kernel
def _relax(prob: Problem, layouts, solver: AugmentedLagrangian, starts: Relaxed):
    """The relaxed search of one kernel: `layouts` is one static layout or `LayoutNumbers`
    with a leading layout axis; `starts` has a leading axis of starts. Returns (y, state),
    each with leading (layout, start) axes."""
    stacked = isinstance(layouts, LayoutNumbers)
    flat_starts = jax.vmap(lambda p: jax.flatten_util.ravel_pytree(p)[0])(starts)
    unravel = _unravel(starts)

    def fn(y, layout, temperature):
        out = prob.evaluate(layout, unravel(y).choice(prob.tables, temperature))
        return (out.score, out.g), out

    # Every (layout, start) pair along one batch axis.
    n_layouts = jax.tree_util.tree_leaves(layouts)[0].shape[0] if stacked else 1
    n_starts = flat_starts.shape[0]
    y = jnp.tile(flat_starts, (n_layouts, 1))
    args = jax.tree_util.tree_map(lambda x: jnp.repeat(x, n_starts, axis=0), layouts)
    y, state = run(solver, fn, y, args, batched=True, batched_args=stacked)
    return jax.tree_util.tree_map(lambda x: x.reshape(n_layouts, n_starts, *x.shape[1:]),
                                  (y, state))


@search_kernel
def _refine(prob: Problem, layouts, solver: AugmentedLagrangian, starts: Relaxed, relaxed,
            moves: Neighbourhood, max_moves, keep: int) -> _Branches:
    """Hardening, multipliers and sensitivities of one kernel's relaxed search (`relaxed`,
    the output of `_relax` on the same arguments)."""
    stacked = isinstance(layouts, LayoutNumbers)
    unravel = _unravel(starts)
    y, state = relaxed
    rounded = jax.vmap(jax.vmap(lambda flat: unravel(flat).nearest(prob.tables)))(y)
    found = harden(prob, layouts, rounded, jnp.min(state.loss, axis=1), keep, moves,
                   max_moves)
    best = jnp.argmax(found.evaluation.rank)
    chosen = found.layout[best]
    best_layout = jax.tree_util.tree_map(lambda x: x[chosen], layouts) if stacked \
        else layouts
    index = jax.tree_util.tree_map(lambda x: x[best], found.index)
    state = jax.tree_util.tree_map(lambda x: x[found.layout], state)
    lam = jax.vmap(jax.vmap(solver.final_multipliers))(state, state.aux.g)
    return _Branches(hardened=found, lam=lam, scores=state.scores,
                     violations=state.violations, steps=state.step,
                     converged=state.converged, relaxed=state.aux, relaxed_loss=state.loss,
                     best=best, sensitivity=sensitivity(prob, best_layout, index))


@filter_jit   # one small kernel (cached with the search's) instead of ~20 eager operations
def _materialized(chip: Chip, grid, layout, index):
    return materialize(chip, grid, layout, index.choice(grid))


@dataclasses.dataclass
class OptimizeResult:
    """Hardened design and its relaxed counterpart.

    `design` / `objective_value` / `metrics` are the hardened (exact, `hard=True`) design;
    when no feasible design was found they are None and `closest` holds the design with the
    smallest total constraint violation and what it achieves.
    """

    objective: str
    design: dict | None
    objective_value: float | None
    feasible: bool
    metrics: dict | None
    binding: list
    """Constraints at their limit on the grid (within `binding_tol`) or violated by a
    better-scoring grid neighbour (the ones `multipliers` prices); when infeasible, the
    violated ones."""
    multipliers: dict
    """Per constraint: `lambda`, the hardened design's shadow price (its KKT multiplier
    along concurrency and power cap, d log objective / d g), with `per_unit` the objective
    bought by one more unit of the limit; `relaxed_lambda`, the relaxed problem's
    augmented-Lagrangian multiplier. When infeasible, `lambda` is the relaxed one."""
    relaxed_metrics: dict
    relaxed_objective_value: float
    layout_weights: dict
    """Relaxed layout choice: softmax of minus each hardened branch's final loss /
    temperature (0 for the layouts in `screened_out`)."""
    trajectory: dict
    """Per Adam step, for the chosen branch: score, max violation, temperature."""
    evaluations: int
    """Exact evaluations spent in hardening and local search."""
    wall_s: float
    result: RESULTS
    """`RESULTS.successful`; `RESULTS.infeasible` when no design meets every target;
    `RESULTS.nonlinear_max_steps_reached` when the local search stopped at
    `max_iterations` while still improving."""
    relaxed_result: RESULTS
    """The relaxed search of the chosen branch: `successful` when its termination test
    passed, `nonlinear_max_steps_reached` when it used every step (the schedule's
    budget; hardening starts from wherever it got)."""
    closest: dict | None = None
    screened_out: list = dataclasses.field(default_factory=list)
    """Layouts the screen dropped (`keep_layouts`), best first."""
    screen_order: list = dataclasses.field(default_factory=list)
    """Every layout in the screen's order (`harden.screen_order`; the hardened ones
    first)."""
    blocking: dict = dataclasses.field(default_factory=dict)
    """Constraints that better-scoring grid neighbours violate, with the limit the nearest
    of them would need: why the grid design stops where it does (no shadow price)."""
    spec_args: tuple | None = dataclasses.field(default=None, repr=False)
    """(space, chip, layout, index) of the hardened design, for `specs`."""

    def specs(self) -> tuple[Chip, Design] | None:
        """The hardened design as model inputs: (chip with the chosen power cap as its TDP,
        `Design` with format names), or None when infeasible."""
        if self.spec_args is None:
            return None
        space, chip, layout, index = self.spec_args
        capped, design, _ = _materialized(chip, tables(space, chip), layout, index)
        names = (space.weights[int(index.weights)], space.experts[int(index.experts)],
                 space.kv[int(index.kv)])
        precision = dataclasses.replace(design.precision, names=names)
        return capped, eqx.tree_at(lambda d: d.precision, design, precision)

    def as_dict(self) -> dict:
        """JSON-ready dict (the `perfmodel optimize --format json` keys)."""
        keys = ("design", "metrics", "objective", "objective_value", "feasible", "binding",
                "blocking", "multipliers", "relaxed_metrics", "relaxed_objective_value",
                "layout_weights", "screened_out", "screen_order", "evaluations", "wall_s",
                "closest")
        out = {k: getattr(self, k) for k in keys}
        out["result"] = _result_name(self.result)
        out["relaxed_result"] = _result_name(self.relaxed_result)
        return out


def _groups(space: Space) -> list:
    """The kernels of a search: all aggregated layouts in one (as numbers, or the static
    layout when there is one), each disaggregated layout in its own. Each group is
    (layouts, kernel argument)."""
    aggregated = [x for x in space.layouts if isinstance(x, Layout)]
    groups = []
    if len(aggregated) == 1:
        groups.append((aggregated, aggregated[0]))
    elif aggregated:
        groups.append((aggregated, LayoutNumbers.stack(aggregated)))
    groups += [([x], x) for x in space.layouts if not isinstance(x, Layout)]
    return groups


def _blocking(gmin, limits) -> dict:
    out = {}
    for i, name in enumerate(CONSTRAINTS):
        if not np.isfinite(gmin[i]):
            continue
        if name == "memory":
            out[name] = {"excess": float(gmin[i])}
            continue
        unit, scale = UNITS[name]
        out[name] = {"needs": float((gmin[i] + 1.0) * limits[i] * scale), "unit": unit}
    return out


def _violations(g) -> dict:
    return {name: float(g[i]) for i, name in enumerate(CONSTRAINTS) if g[i] > FEASIBLE_TOL}


def _temperatures(solver: AugmentedLagrangian, steps: int) -> list:
    # `solver.temperature` on the host (eager JAX costs tens of microseconds an operation).
    start, end = float(solver.temperature_start), float(solver.temperature_end)
    return (start * (end / start) ** (np.arange(steps) / max(solver.max_steps - 1, 1))).tolist()


def _limits(tgt: Targets) -> np.ndarray:
    # `Targets.limits()` on the host.
    return np.asarray([float(tgt.max_tpot), float(tgt.max_ttft), float(tgt.max_e2e),
                       float(tgt.max_power), 1.0, float(tgt.max_quality_loss)])


def _scalars(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()}


def optimize(model: Model, chip: Chip, workload: Workload, space: Space, tgt: Targets,
             objective: str = "tok_s_per_kw", *, steps: int = 24, blocks: int = 4,
             learning_rate: float = 0.2, temperature=(1.0, 0.05), starts=(0.3, 0.7),
             mu=10.0, sharpness=DEFAULT_SHARPNESS, binding_tol: float = 0.03,
             max_iterations: int = 40, keep_layouts: int | None = 2,
             throw: bool = True, progress: bool | None = None) -> OptimizeResult:
    """Find the best design of `space` under `tgt` by gradient descent, then harden it.

    Every layout is a branch; each runs `len(starts)` trajectories of Adam on the augmented
    Lagrangian (vectorized) for up to `steps` steps, the multipliers updated every
    `steps // blocks`, the softmax temperature annealed geometrically from `temperature[0]`
    to `temperature[1]`. With more layouts than `keep_layouts`, only `keep_layouts` are
    hardened, chosen alternately by the best exact design on the concurrency line through
    their rounded relaxed designs and by their final augmented Lagrangian
    (`harden.screen_order`); the others are reported in `screened_out`.

    Args:
        model, chip, workload: what is served, on what.
        space: the grid (`design_space`).
        tgt: limits and prices (`targets`).
        objective: one of `OBJECTIVES`.
        steps, blocks, learning_rate: Adam schedule. The default (24 steps in 4 blocks)
            finds the same hardened designs as longer schedules on the test scenarios;
            longer ones converge the relaxed solution further
            (`benchmarks/bench_schedules.py`).
        temperature: (start, end) of the softmax temperature (traced: no recompiles).
        starts: initial concurrency positions in (0, 1) of the log range (one trajectory
            each).
        mu: initial penalty weight of the augmented Lagrangian (doubled per block while the
            violation does not halve).
        sharpness: smooth-max p of the relaxed model.
        binding_tol: a constraint binds when the hardened design is within this fraction
            of its limit, or when a better-scoring grid neighbour violates it.
        max_iterations: cap on the local search's moves (each evaluates one neighbourhood,
            ~100 designs, exactly).
        keep_layouts: aggregated layouts hardened when the grid has more (None: all);
            disaggregated layouts are always hardened.
        throw: raise `RuntimeError` unless the result is `RESULTS.successful`.
        progress: a bar over the kernels (one for all aggregated layouts, one per
            disaggregated layout; the first call of each traces and compiles it) on
            standard error (`perfmodel.progress`; None: on a terminal).

    Returns:
        `OptimizeResult`.

    Raises:
        ValueError: unknown objective, bad arguments (before tracing).
        RuntimeError: with `throw`, when no feasible design is found, or the local search
            stopped at `max_iterations`.

    Example:
        >>> import perfmodel as pm
        >>> from perfmodel.search import design_space, targets
        >>> chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-8b")
        >>> space = design_space(model, chip, 1, concurrency=(1, 2, 4, 8, 16, 32, 64))
        >>> r = optimize(model, chip, pm.Workload(1024, 256), space, targets(max_tpot_ms=8))
        >>> r.feasible, r.metrics["tpot_s"] <= 0.008
        (True, True)
    """
    if not isinstance(space, Space):
        raise ValueError("space must be a Space (see design_space)")
    if not (isinstance(steps, int) and isinstance(blocks, int) and steps >= blocks >= 1):
        raise ValueError(f"optimize: need integers steps >= blocks >= 1, got steps={steps!r}, "
                         f"blocks={blocks!r}")
    if not starts or any(not 0 < s < 1 for s in starts):
        raise ValueError("optimize: starts are positions in (0, 1)")
    if keep_layouts is not None and (not isinstance(keep_layouts, int) or keep_layouts < 1):
        raise ValueError(f"optimize: keep_layouts is a number of layouts >= 1, or None to "
                         f"harden every layout; got {keep_layouts!r}")
    t0 = time.perf_counter()
    prob = problem(model, chip, workload, tables(space, chip), tgt, objective, sharpness)
    solver = AugmentedLagrangian(max_steps=steps, steps_per_block=steps // blocks,
                                 learning_rate=learning_rate,
                                 temperature_start=temperature[0],
                                 temperature_end=temperature[1], mu=mu)
    initial = jax.tree_util.tree_map(lambda *xs: np.stack(xs),
                                     *[Relaxed.initial(space, s) for s in starts])
    moves = neighbourhood(space.sizes)
    max_moves = np.asarray(max_iterations, dtype=np.int32)
    groups = _groups(space)
    # Each kernel compiles while the next is traced, side by side with the others; every
    # kernel is dispatched before any result is read.
    with bar(2 * len(groups) + 1, "search", progress, unit="kernel") as shown:
        kernels = []
        with side_by_side() as compiler:
            for members, argument in groups:
                keep = len(members) if keep_layouts is None \
                    or not isinstance(members[0], Layout) else min(keep_layouts, len(members))
                relax = compiler.submit(_relax.lower(prob, argument, solver, initial))
                shown.update(1)
                refine = compiler.submit(_refine.lower(prob, argument, solver, initial,
                                                       relax.out_shapes, moves, max_moves,
                                                       keep))
                shown.update(1)
                kernels.append((argument, keep, relax, refine))
        pending = [refine(prob, argument, solver, initial,
                          relax(prob, argument, solver, initial), moves, max_moves, keep)
                   for argument, keep, relax, refine in kernels]
        outputs = jax.device_get(pending)
        shown.update(1)
    return _report(space, chip, groups, outputs, solver, prob, objective, binding_tol,
                   throw, t0)


def _report(space, chip, groups, outputs, solver, prob, objective, binding_tol, throw,
            t0) -> OptimizeResult:
    """The `OptimizeResult` of the kernels' `outputs` (host arrays), one per group."""
    ranks = [float(out.hardened.evaluation.rank[int(out.best)]) for out in outputs]
    gi = int(np.argmax(ranks))
    out, members = outputs[gi], groups[gi][0]
    b = int(out.best)
    h = out.hardened
    walker, si, index, evaluation, blocking, moves_made, capped = jax.tree_util.tree_map(
        lambda x: x[b], (h.layout, h.start, h.index, h.evaluation, h.blocking, h.moves,
                         h.capped))
    layout = members[int(walker)]
    si = int(si)
    g, value = np.asarray(evaluation.g), float(evaluation.value)
    feasible = bool(np.all(g <= FEASIBLE_TOL))
    evaluations = int(sum(int(o.hardened.evaluations) for o in outputs))

    # Screen: the layouts of every group past its kept ones; weights over the kept ones.
    screened, names, losses, order = [], [], [], []
    for o, (group, _) in zip(outputs, groups, strict=True):
        k = o.hardened.layout.shape[0]
        order += [group[int(i)].describe() for i in o.hardened.order]
        screened += [group[int(i)].describe() for i in o.hardened.order[k:]]
        names += [group[int(i)].describe() for i in o.hardened.layout]
        losses += [float(np.min(o.relaxed_loss[i])) for i in range(k)]
    losses = np.asarray(losses)
    weights = np.exp(-(losses - losses.min()) / float(solver.temperature_end))
    layout_weights = dict(zip(names, (weights / weights.sum()).tolist(), strict=True))
    layout_weights.update(dict.fromkeys(screened, 0.0))

    relaxed = jax.tree_util.tree_map(lambda x: x[b, si], out.relaxed)
    taken = int(out.steps[b, si])
    trajectory = {"score": out.scores[b, si, :taken].tolist(),
                  "max_violation": out.violations[b, si, :taken].tolist(),
                  "temperature": _temperatures(solver, taken)}
    relaxed_result = RESULTS.successful if bool(out.converged[b, si]) \
        else RESULTS.nonlinear_max_steps_reached

    limits = _limits(prob.targets)
    relaxed_lam = np.asarray(out.lam[b, si])
    # Shadow prices of the hardened design over the constraints that bind on the grid
    # (within binding_tol of their limit, or violated by a better-scoring neighbour).
    priced = np.array([np.isfinite(limits[i]) or name == "memory"
                       for i, name in enumerate(CONSTRAINTS)])
    active = priced & ((g >= -binding_tol) | np.isfinite(blocking))
    lam = shadow_prices(out.sensitivity, active) if feasible else relaxed_lam
    sign = 1.0 if OBJECTIVES[objective][1] else -1.0
    multipliers = {}
    for i, name in enumerate(CONSTRAINTS):
        if not priced[i]:
            continue
        unit, scale = UNITS[name]
        entry = {"lambda": float(lam[i]), "relaxed_lambda": float(relaxed_lam[i])}
        if feasible and name != "memory" and np.isfinite(limits[i]):
            # d objective / d limit = objective * lam / limit (at a binding constraint).
            entry["per_unit"] = float(sign * value * lam[i] / (limits[i] * scale))
            entry["unit"] = f"{objective} per {unit}" if unit else objective
        multipliers[name] = entry

    described = index.describe(space, chip, layout)
    metrics = _scalars(evaluation.metrics)
    common = dict(objective=objective, multipliers=multipliers,
                  relaxed_metrics=_scalars(relaxed.metrics),
                  relaxed_objective_value=float(relaxed.value), layout_weights=layout_weights,
                  trajectory=trajectory, evaluations=evaluations,
                  relaxed_result=relaxed_result, screened_out=screened, screen_order=order)
    if feasible:
        near = {name for i, name in enumerate(CONSTRAINTS) if active[i] and name != "memory"}
        if metrics["running_batch"] >= (1.0 - binding_tol) * metrics["max_batch"]:
            near.add("memory")
        code = RESULTS.nonlinear_max_steps_reached if bool(capped) \
            else RESULTS.successful
        result = OptimizeResult(
            design=described, objective_value=value, feasible=True, metrics=metrics,
            binding=[name for name in CONSTRAINTS if name in near],
            blocking=_blocking(blocking, limits), wall_s=time.perf_counter() - t0,
            result=code, spec_args=(space, chip, layout, index), **common)
        check(code, "optimize", throw,
              detail=f"after {int(moves_made)} moves of the local search")
        return result
    closest = {"design": described, "metrics": metrics, "objective_value": value,
               "violations": _violations(g),
               "achievable": {name: float((g[i] + 1.0) * limits[i] * UNITS[name][1])
                              for i, name in enumerate(CONSTRAINTS)
                              if g[i] > FEASIBLE_TOL and name != "memory"}}
    result = OptimizeResult(
        design=None, objective_value=None, feasible=False, metrics=None,
        binding=list(_violations(g)), wall_s=time.perf_counter() - t0,
        result=RESULTS.infeasible, closest=closest, **common)
    check(RESULTS.infeasible, "optimize", throw,
          detail=f"closest: {closest['design']}, violations {closest['violations']}")
    return result
