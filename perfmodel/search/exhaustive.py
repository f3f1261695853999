"""Exhaustive enumeration of the grid with the exact model: the reference the search is
checked against (`perfmodel optimize --check-exhaustive`).

One compiled kernel evaluates a chunk of `CHUNK` designs (one vmapped evaluation,
per-operator order: faster than the vectorized one under a wide vmap) and returns the
best-ranked of them. Aggregated layouts enter as numbers
(`Layout.numbers()`), so one compilation serves all of them (a grid of one keeps it
static, a smaller kernel); disaggregated ones are static, one compilation each.

XLA:CPU runs a kernel on the calling thread, so the work (layouts, and parts of a layout's
grid when there are fewer layouts than cores) is spread over one thread per core: on 2
cores, 963 ms against 1377 ms for the README example's 758k designs (busy host).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..architecture import Model
from ..design import Layout
from ..hardware import Chip
from ..progress import bar
from ..workload import Workload
from .compile import enumeration_kernel
from .evaluate import FEASIBLE_TOL, Problem, problem
from .space import CONSTRAINTS, OBJECTIVES, GridIndex, Space, Targets, tables

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
    per_layout: dict = dataclasses.field(default_factory=dict)
    """Per layout (by `describe()`): the best feasible objective value, None if none."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@enumeration_kernel
def _best(prob: Problem, layout, first, chunk: int):
    """(rank, grid number, objective value, g) of the best-ranked design among the `chunk`
    designs from grid number `first` (traced: one compilation serves every chunk). One
    chunk a call: a loop over chunks in the kernel took 60% longer to compile."""
    sizes = prob.tables.sizes
    total = math.prod(jax.tree_util.tree_leaves(sizes))
    numbers = first + jnp.arange(chunk, dtype=jnp.int32)
    index = GridIndex.unravel(jnp.minimum(numbers, total - 1), sizes)
    out = jax.vmap(lambda i: prob.evaluate(layout, i.choice(prob.tables), hard=True,
                                           vectorize=False))(index)
    rank = jnp.where(numbers < total, out.rank, -jnp.inf)
    j = jnp.argmax(rank)
    return rank[j], numbers[j], out.value[j], out.g[j]


def exhaustive(model: Model, chip: Chip, workload: Workload, space: Space, tgt: Targets,
               objective: str = "tok_s_per_kw", *, threads: int | None = None,
               progress: bool | None = None) -> ExhaustiveResult:
    """Enumerate every design of `space` with the exact (hard) model and keep the best
    feasible one (or, when none is, the one with the smallest total violation).

    Args:
        model, chip, workload: what is served, on what.
        space: the grid (`design_space`).
        tgt: limits and prices (`targets`).
        objective: a key of `OBJECTIVES`.
        threads: threads the work is spread over (default: one per core).
        progress: a bar over the chunks of designs on standard error
            (`perfmodel.progress`; None: on a terminal).

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
    threads = threads or os.cpu_count() or 1
    sizes = space.sizes
    total = math.prod(jax.tree_util.tree_leaves(sizes))
    aggregated = sum(isinstance(x, Layout) for x in space.layouts)
    arguments = [x.numbers() if isinstance(x, Layout) and aggregated > 1 else x
                 for x in space.layouts]
    # Work items: (layout, chunk starts), enough of them for every thread.
    firsts = np.arange(0, total, CHUNK, dtype=np.int32)
    parts = min(-(-threads // len(space.layouts)), len(firsts))
    work = [(k, part) for k in range(len(space.layouts))
            for part in np.array_split(firsts, parts)]

    shown = bar(len(firsts) * len(space.layouts), "enumeration", progress, unit="chunk")

    def run(item):
        k, starts = item
        results = []
        for first in starts:
            results.append(jax.device_get(_best(prob, arguments[k], first, CHUNK)))
            shown.update(1)   # tqdm's update is thread-safe
        return max(results, key=lambda r: float(r[0]))

    # Each kernel compiles once, here (its first chunk), before the threads would each
    # compile it.
    seen = {}
    for item in work:
        layout = space.layouts[item[0]]
        seen.setdefault("numbers" if isinstance(layout, Layout) else layout, item)
    with shown:
        for k, starts in seen.values():
            run((k, starts[:1]))
        shown.reset(shown.total)   # the compiling chunks run again below
        if threads > 1 and len(work) > 1:
            with concurrent.futures.ThreadPoolExecutor(min(threads, len(work))) as pool:
                results = list(pool.map(run, work))
        else:
            results = [run(item) for item in work]
    best = int(np.argmax([float(r[0]) for r in results]))
    k = work[best][0]
    _, number, value, g = results[best]
    better = max if OBJECTIVES[objective][1] else min
    per_layout = {}
    for (layout, _), (_, _, v, g_layout) in zip(work, results, strict=True):
        name = space.layouts[layout].describe()
        old = per_layout.get(name)
        if np.all(g_layout <= FEASIBLE_TOL):
            per_layout[name] = float(v) if old is None else better(old, float(v))
        else:
            per_layout.setdefault(name, None)
    index = GridIndex(*np.unravel_index(int(number), jax.tree_util.tree_leaves(sizes)))
    described = index.describe(space, chip, space.layouts[k])
    points = len(space.layouts) * total
    wall = time.perf_counter() - start
    if np.all(g <= FEASIBLE_TOL):
        return ExhaustiveResult(design=described, objective_value=float(value), feasible=True,
                                points=points, wall_s=wall, per_layout=per_layout)
    violations = {name: float(g[i]) for i, name in enumerate(CONSTRAINTS)
                  if g[i] > FEASIBLE_TOL}
    return ExhaustiveResult(design=None, objective_value=None, feasible=False, points=points,
                            wall_s=wall, closest={"design": described,
                                                  "violations": violations},
                            per_layout=per_layout)
