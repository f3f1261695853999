"""Where a sweep runs: the grid axis sharded over local devices, chunks shared over hosts.

Within a process, a step evaluates one chunk per local device: the chunks, each padded to
the chunk size, are stacked along the grid axis of a 1-D `jax.sharding.Mesh` of the local
devices (axis ``"grid"``, `NamedSharding` with `PartitionSpec("grid")`, so the step's
length is a multiple of the device count) and each device runs the one-device kernel on
its block (`Placement.map`, `jax.shard_map`). A point is then computed by the same kernel at
the same place of a block of the same length on any number of devices. The rows agree with
the one-device rows in every input, feasibility and reason, and in the metrics to the last
bits: XLA fuses the multi-device program a little differently, and a few values differ by
an ulp or two (README "Sweeps").

Over several processes (`jax.distributed.initialize`, one per host or per accelerator
group), process p of n takes the chunks whose index is p modulo n and writes its own part
file (`part_path`); the parts are merged into the output in chunk order (`writers.merge`).
No collective crosses hosts: the grid is embarrassingly parallel, so the global mesh would
only add a gather per chunk.
"""

from __future__ import annotations

import dataclasses
import os

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: The mesh axis the grid is split along.
AXIS = "grid"


@dataclasses.dataclass(frozen=True)
class Placement:
    """A 1-D mesh over `devices` and the sharding of a chunk's points along it (hashable:
    a static argument of the jitted kernel)."""

    devices: tuple

    @property
    def count(self) -> int:
        return len(self.devices)

    @property
    def mesh(self) -> Mesh:
        return Mesh(np.asarray(self.devices), (AXIS,))

    @property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(AXIS))

    def map(self, kernel, points: dict, specs):
        """`kernel(points, specs)` with `points` split over the devices and `specs` (a
        pytree of model, chip and design specs) on each of them.

        Each device runs the one-device kernel on its share (`jax.shard_map`), with no
        collective: the points are independent.
        """
        arrays, static = eqx.partition(specs, eqx.is_array)

        def local(points, arrays):
            return kernel(points, eqx.combine(arrays, static))

        return _shard_map()(local, mesh=self.mesh, in_specs=(PartitionSpec(AXIS),
                                                               PartitionSpec()),
                             out_specs=PartitionSpec(AXIS))(points, arrays)

    def put(self, arrays: dict) -> dict:
        """`arrays` (leading axis a multiple of `count`) on the devices, split along the
        grid axis; on one device, as they are (jit places them)."""
        if self.count == 1:
            return arrays
        sharding = self.sharding
        return {k: jax.device_put(v, sharding) for k, v in arrays.items()}


def _shard_map():
    """`jax.shard_map` (`jax.experimental.shard_map` before JAX 0.6)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map

    return shard_map


def placement(devices: int | None = None) -> Placement:
    """The first `devices` local devices (None: all of them).

    Raises:
        ValueError: more devices than this process has.
    """
    local = jax.local_devices()
    if devices is None:
        return Placement(tuple(local))
    if not 1 <= devices <= len(local):
        raise ValueError(f"--devices {devices}: this process has {len(local)} local "
                         "device(s)")
    return Placement(tuple(local[:devices]))


def share(index: int, process: int, processes: int) -> bool:
    """Whether chunk `index` belongs to `process` of `processes`."""
    return index % processes == process


def part_path(out: str, process: int, processes: int) -> str:
    """The file process `process` of `processes` writes: `out` itself for one process,
    else "results.csv" -> "results.part1-of-2.csv".

    Example:
        >>> part_path("runs/results.csv", 1, 2)
        'runs/results.part1-of-2.csv'
    """
    if processes == 1:
        return out
    root, ext = os.path.splitext(out)
    return f"{root}.part{process}-of-{processes}{ext}"


def initialize(coordinator: str | None, processes: int | None, process: int | None):
    """`jax.distributed.initialize` (before any computation), then (process, processes).

    With no arguments JAX detects the cluster (SLURM, Open MPI, Cloud TPU); on a bare host
    give all three.
    """
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes,
                               process_id=process)
    return jax.process_index(), jax.process_count()
