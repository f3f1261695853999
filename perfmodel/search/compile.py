"""How the search's kernels are compiled: `eqx.filter_jit` with XLA:CPU options that cut
compilation time.

The search's kernels are scalar-heavy graphs of a few thousand tiny operations, where
XLA:CPU spends seconds compiling and microseconds running. Two of its options trade
little of the second for much of the first (`python benchmarks/bench_optimize.py
--compile-options default` against the default, see the README):

- `xla_cpu_use_fusion_emitters=False`: the fusion emitters triple this graph's compile time
  without speeding it up. jaxlib 0.11 dropped the flag and rejects it.
- `xla_backend_optimization_level=1`: LLVM's -O1 instead of -O2 compiles the gradient
  kernels about 40% faster, with run times within noise at these sizes.

Each option is probed once (by compiling a one-operation function) and kept where this XLA
accepts it; other backends get none. `PERFMODEL_COMPILE_OPTIONS=default` turns them off.
"""

from __future__ import annotations

import functools
import os

import equinox as eqx
import jax
import numpy as np

#: The options, on the CPU backend.
CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1}


@functools.cache
def compiler_options() -> dict | None:
    """The `CPU_OPTIONS` this backend accepts, or None (another backend, or
    `PERFMODEL_COMPILE_OPTIONS=default`)."""
    if os.environ.get("PERFMODEL_COMPILE_OPTIONS", "").strip().lower() == "default":
        return None
    if jax.default_backend() != "cpu":
        return None
    accepted = {}
    for key, value in CPU_OPTIONS.items():
        try:
            jax.jit(lambda x: x + 1.0, compiler_options={key: value}).lower(
                np.float32(0.0)).compile()
        except jax.errors.JaxRuntimeError as error:
            if "compile option" not in str(error):
                raise
            continue
        accepted[key] = value
    return accepted or None


class filter_jit:
    """`eqx.filter_jit(fun)` compiled with `compiler_options()`. The options are read at
    the first call (they depend on the backend, which should not start at import)."""

    def __init__(self, fun):
        self.fun = fun
        functools.update_wrapper(self, fun)

    @functools.cached_property
    def jitted(self):
        return eqx.filter_jit(self.fun, compiler_options=compiler_options())

    def __call__(self, *args, **kwargs):
        return self.jitted(*args, **kwargs)
