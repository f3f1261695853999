"""Grid sweeps at scale: a TOML spec expanded into millions of points, evaluated in chunks
with `vmap` under `jit`, sharded over local devices and shared over hosts, written as they
come (`perfmodel sweep SPEC.toml --out results.csv`).

Modules: `spec` (the TOML spec), `expand` (the grid and its chunks), `evaluate` (one chunk),
`shard` (devices and processes), `writers` (CSV / Parquet, resumable), `run` (the driver).
"""

from .expand import Grid, all_layouts, expand
from .run import Summary, chunk_size, run_sweep
from .spec import SweepSpec, from_dict, load

__all__ = ["Grid", "Summary", "SweepSpec", "all_layouts", "chunk_size", "expand", "from_dict",
           "load", "run_sweep"]
