"""One chunk of a grid evaluated: `serving.predict` vmapped over points under `jit`.

Per (model, chip) group one kernel is compiled: the layout enters as `LayoutNumbers`, the
precision as an index into the group's stacked `Precision`s, the workload and concurrency as
numbers, and every chunk is padded to the same length, so a sweep compiles once per group
whatever its layouts, formats and sizes. Reports use the hard max (`hard=True`), as
`perfmodel pareto` does.

Feasibility of a point, first reason that applies:
1. the cell's (`expand.Cell.reason`): format, layout of another chip count, unsplittable
   layout;
2. ISL + OSL longer than the model's maximum context (unless `allow_long_context`);
3. the weights, reserve and one sequence of KV do not fit in a chip's memory (`fits`);
4. more requests per replica than the batch that fits or the runtime's `max_running`
   (they queue; the Pareto sweep drops these points too);
5. a metric that is not finite.
Metrics of points failing 1-3 are NaN (empty in the file); the queued points of 4 keep the
model's prediction with the requests queueing.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..compiled import filter_jit
from ..design import LayoutNumbers
from ..serving import FIT_FIELDS
from ..sweep import point_row
from ..workload import Workload
from .expand import Chunk, Grid, Group
from .shard import Placement

#: Columns the kernel always returns: feasibility needs them.
_ALWAYS = ("fits", "max_batch")

#: Reasons of the per-point checks (the cell's own reasons come from `expand`).
TOO_LONG = "isl + osl exceed the model's maximum context"
NO_FIT = "does not fit in memory (weights + reserve + one sequence of KV)"
QUEUES = "queues: concurrency per replica exceeds the batch that fits (or runtime.max_running)"
NOT_FINITE = "non-finite prediction"


def _kernel(points, model, chip, runtime, precisions, shape, columns):
    def one(p):
        prec = jax.tree.map(lambda x: x[p["precision"]], precisions)
        layout = LayoutNumbers(tp=p["tp"], ep=p["ep"], pp=p["pp"], replicas=p["replicas"],
                               dp_attention=p["dpa"])
        row = point_row(model, chip, runtime, prec, layout, p["concurrency"], p["isl"],
                        p["osl"], shape)
        return {key: row[key] for key in columns}

    return jax.vmap(one)(points)


def _one_device(points, specs, columns):
    return _kernel(points, *specs, columns)


def _placed(points, specs, columns, placement):
    return placement.map(lambda p, s: _one_device(p, s, columns), points, specs)


_placed_jit = eqx.filter_jit(_placed)


# On one device the kernel goes through the traced-program store (`compiled.filter_jit`):
# a second sweep of the same model and chip loads it instead of tracing it again (about
# 1.5 s of a million-point sweep). A placement over several devices holds the devices
# themselves, which the store cannot key on, so the mesh kernel is traced every run.
_one_device_jit = filter_jit(_one_device)


def stack(group: Group):
    """The group's precisions as one pytree with a leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *group.precisions)


def _inputs(grid: Grid, group: Group, chunk: Chunk):
    pts = grid.points(group, chunk.start, chunk.stop)
    cells = group.cells
    degrees = np.asarray([c.degrees[:4] for c in cells], dtype=float)[pts["cell"]]
    inputs = {"tp": degrees[:, 0], "ep": degrees[:, 1], "pp": degrees[:, 2],
              "replicas": degrees[:, 3],
              "dpa": np.asarray([c.degrees[4] for c in cells], dtype=bool)[pts["cell"]],
              "precision": np.asarray([c.precision_index for c in cells],
                                      dtype=np.int32)[pts["cell"]],
              "isl": pts["isl"], "osl": pts["osl"], "concurrency": pts["concurrency"]}
    return pts, inputs


@dataclasses.dataclass(frozen=True, eq=False)
class Pending:
    """A step whose kernel was dispatched (`launch`) and whose results `finish` collects."""

    grid: Grid
    group: Group
    parts: list
    out: dict
    columns: tuple
    size: int


def evaluate(grid: Grid, chunks: list[Chunk], placement: Placement, size: int,
             columns: tuple[str, ...] | None = None) -> list[dict]:
    """`finish(launch(...))`: the results of one step, waiting for them."""
    return finish(launch(grid, chunks, placement, size, columns))


def launch(grid: Grid, chunks: list[Chunk], placement: Placement, size: int,
           columns: tuple[str, ...] | None = None) -> Pending:
    """Dispatch the kernel of one step without waiting for it (JAX runs it asynchronously,
    so the previous step's rows can be written meanwhile); `finish` returns, for each
    chunk, every point's inputs, metric columns, `feasible` and `reason`.

    Each chunk is padded to `size` points (copies of its last point) and runs on one
    device: XLA's reductions sum in an order that depends on the array's length, so a
    point's value depends on the length of the block it is computed in; blocks of the same
    `size`, one per device, keep that length on any number of devices.

    Args:
        grid: the expanded grid.
        chunks: up to `placement.count` chunks of one group, at most `size` points each.
        placement: where the kernel runs (`shard.Placement`: one device or a mesh).
        size: points per device, so one compiled kernel serves all chunks of a group.
        columns: metric columns (default: the spec's metrics).

    Returns:
        A `Pending`; `finish` gives, for each chunk, {column: array} of its points:
        `cell` (index into the group's cells), `isl`, `osl`, `concurrency`, each metric,
        `feasible` (bool) and `reason` (object array of str).
    """
    if not 1 <= len(chunks) <= placement.count or len({c.group for c in chunks}) != 1:
        raise ValueError(f"evaluate takes 1 to {placement.count} chunks of one group, got "
                         f"{len(chunks)}")
    group = grid.groups[chunks[0].group]
    columns = tuple(columns if columns is not None else grid.spec.metrics)
    wanted = tuple(dict.fromkeys(columns + _ALWAYS))
    parts = [_inputs(grid, group, chunk) for chunk in chunks]
    blocks = []
    for _, inputs in parts:
        n = len(inputs["isl"])
        if n > size:
            raise ValueError(f"a chunk of {n} points is longer than the block size {size}")
        blocks.append({k: np.concatenate([v, np.repeat(v[-1:], size - n)])
                       for k, v in inputs.items()})
    blocks += [blocks[-1]] * (placement.count - len(blocks))
    padded = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
    # The spec's output spread and cached share as a workload shape (`sweep.point_row`;
    # each point keeps its own lengths, so these two are placeholders).
    shape = Workload(1.0, 2.0, output_cv2=grid.spec.output_cv2,
                     cached_fraction=grid.spec.cached_fraction)
    specs = (group.model, group.chip, group.runtime, stack(group), shape)
    if placement.count == 1:
        out = _one_device_jit(padded, specs, wanted)
    else:
        out = _placed_jit(placement.put(padded), specs, wanted, placement)
    return Pending(grid, group, parts, out, columns, size)


def finish(pending: Pending) -> list[dict]:
    """The results of a `launch`ed step (waits for its kernel)."""
    grid, group, parts, columns, size = (pending.grid, pending.group, pending.parts,
                                         pending.columns, pending.size)
    out = {k: np.asarray(v) for k, v in pending.out.items()}
    results = []
    for i, (pts, inputs) in enumerate(parts):
        n = len(inputs["isl"])
        values = {k: v[i * size:i * size + n] for k, v in out.items()}
        results.append(_finish(grid, group, pts, inputs, values, columns))
    return results


def _finish(grid, group, pts, inputs, values, columns) -> dict:
    cells = group.cells
    reason = np.asarray([c.reason for c in cells], dtype=object)[pts["cell"]]
    limit = getattr(group.model, "max_context", 0)
    checks = []
    if limit and not grid.spec.allow_long_context:
        checks.append((pts["isl"] + pts["osl"] > limit, TOO_LONG))
    checks.append((~values["fits"].astype(bool), NO_FIT))
    running = np.minimum(values["max_batch"], float(group.runtime.max_running))
    checks.append((pts["concurrency"] / inputs["replicas"] > running, QUEUES))
    finite = np.all([np.isfinite(values[k].astype(float)) for k in columns], axis=0)
    checks.append((~finite, NOT_FINITE))
    for bad, text in checks:
        reason = np.where((reason == "") & bad, text, reason)
    feasible = reason == ""
    # Infeasible points carry no latency, throughput or power (the queued ones keep
    # theirs); those that do not fit keep the fields that say by how much (`FIT_FIELDS`);
    # cells never evaluated keep nothing.
    never = np.asarray([bool(c.reason) for c in cells])[pts["cell"]]
    blank = ~feasible & (reason != QUEUES)
    result = {"cell": pts["cell"], "isl": pts["isl"], "osl": pts["osl"],
              "concurrency": pts["concurrency"]}
    for key in columns:
        value = values[key]
        if value.dtype == bool:
            result[key] = value
        else:
            drop = never if key in FIT_FIELDS else blank
            result[key] = np.where(drop, np.nan, value.astype(float))
    result["feasible"] = feasible
    result["reason"] = reason
    return result
