"""Exhaustive enumeration of the grid with the exact model: the reference the search is
checked against (`perfmodel optimize --check-exhaustive`).

One compiled kernel per layout kind scans the whole grid in chunks of `CHUNK` designs
(each chunk one vmapped evaluation, per-operator order: faster than the vectorized one
under a wide vmap) and keeps the best-ranked design on the device. Aggregated layouts
enter as numbers (`Layout.numbers()`), so one compilation serves all of them;
disaggregated ones are static, one compilation each.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..architecture import Model
from ..design import Layout
from ..hardware import Chip
from ..workload import Workload
from .compile import filter_jit
from .evaluate import FEASIBLE_TOL, Problem, problem
from .space import CONSTRAINTS, GridIndex, Space, Targets, tables

#: Designs per vmapped evaluation.
CHUNK = 4096


@dataclasses.dataclass
class ExhaustiveResult:
    """Best design of the grid by enumeration."""

    design: dict | None
    """Description of the best feasible design (None when none is feasible)."""
    objective_value: float | None
    feasible: bool
    points: int
    """Designs evaluated."""
    wall_s: float
    closest: dict | None = None
    """When nothing is feasible: the design with the smallest total violation and its
    violations."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@filter_jit
def _best(prob: Problem, layout, chunk: int):
    """(rank, grid number, objective value, g) of the best-ranked design of the grid."""
    sizes = prob.tables.sizes
    total = math.prod(jax.tree_util.tree_leaves(sizes))

    def body(best, start):
        numbers = start + jnp.arange(chunk, dtype=jnp.int32)
        index = GridIndex.unravel(jnp.minimum(numbers, total - 1), sizes)
        out = jax.vmap(lambda i: prob.evaluate(layout, i.choice(prob.tables), hard=True,
                                               vectorize=False))(index)
        rank = jnp.where(numbers < total, out.rank, -jnp.inf)
        j = jnp.argmax(rank)
        new = (rank[j], numbers[j], out.value[j], out.g[j])
        better = new[0] > best[0]
        return jax.tree_util.tree_map(lambda a, b: jnp.where(better, a, b), new, best), None

    init = (jnp.asarray(-jnp.inf), jnp.zeros((), jnp.int32), jnp.zeros(()),
            jnp.zeros(len(CONSTRAINTS)))
    starts = jnp.arange(0, total, chunk, dtype=jnp.int32)
    return jax.lax.scan(body, init, starts)[0]


def exhaustive(model: Model, chip: Chip, workload: Workload, space: Space, tgt: Targets,
               objective: str = "tok_s_per_kw") -> ExhaustiveResult:
    """Enumerate every design of `space` with the exact (hard) model and keep the best
    feasible one (or, when none is, the one with the smallest total violation).

    Args:
        model, chip, workload: what is served, on what.
        space: the grid (`design_space`).
        tgt: limits and prices (`targets`).
        objective: a key of `OBJECTIVES`.

    Returns:
        `ExhaustiveResult`.

    Raises:
        ValueError: an unknown objective or specs of the wrong type.

    Example:
        >>> import perfmodel as pm
        >>> from perfmodel.search import design_space, targets
        >>> chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-8b")
        >>> space = design_space(model, chip, 1, concurrency=(1, 8, 64))
        >>> r = exhaustive(model, chip, pm.Workload(1024, 256), space, targets(max_tpot_ms=50))
        >>> r.points, r.feasible   # 3 concurrencies x 2 weight x 2 KV formats
        (12, True)
    """
    if not isinstance(space, Space):
        raise ValueError("space must be a Space (see design_space)")
    start = time.perf_counter()
    prob = problem(model, chip, workload, tables(space, chip), tgt, objective)
    # Every layout's kernel is dispatched before any result is read.
    pending = [_best(prob, x.numbers() if isinstance(x, Layout) else x, CHUNK)
               for x in space.layouts]
    results = jax.device_get(pending)
    k = int(np.argmax([float(r[0]) for r in results]))
    _, number, value, g = results[k]
    sizes = space.sizes
    index = GridIndex(*np.unravel_index(int(number), jax.tree_util.tree_leaves(sizes)))
    described = index.describe(space, chip, space.layouts[k])
    points = len(space.layouts) * math.prod(jax.tree_util.tree_leaves(sizes))
    wall = time.perf_counter() - start
    if np.all(g <= FEASIBLE_TOL):
        return ExhaustiveResult(design=described, objective_value=float(value), feasible=True,
                                points=points, wall_s=wall)
    violations = {name: float(g[i]) for i, name in enumerate(CONSTRAINTS)
                  if g[i] > FEASIBLE_TOL}
    return ExhaustiveResult(design=None, objective_value=None, feasible=False, points=points,
                            wall_s=wall, closest={"design": described,
                                                  "violations": violations})
