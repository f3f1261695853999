"""How the search's kernels are compiled: `eqx.filter_jit` with XLA:CPU options that cut
compilation time, which dominates a cold search.

The search kernel is a scalar-heavy graph of a few thousand tiny operations, where XLA:CPU
spends seconds compiling and milliseconds running. Measured on 2 busy cores (jaxlib 0.10,
the README example's 13 layouts, `benchmarks/bench_optimize.py`, see the README):

- `xla_cpu_use_fusion_emitters=False` (both kernels): the fusion emitters about double
  this graph's compile time without speeding it up; the enumeration kernel compiles in
  4.8 instead of 7.1 CPU seconds and runs as fast. jaxlib 0.11 dropped the flag and
  rejects it.
- `xla_backend_optimization_level=0` (the search kernel only): LLVM without optimization
  compiles it in 4.6 instead of 11.4 CPU seconds (-O1) and runs it in 58 instead of 12 ms
  warm, still far below enumeration's time on the same grid. The enumeration kernel keeps
  LLVM's optimizations: it runs a million designs, and at -O0 ran 2.4 times as long.

Each option is probed once (by compiling a one-operation function) and kept where this XLA
accepts it; other backends get none. `PERFMODEL_COMPILE_OPTIONS=default` turns them all
off (XLA's defaults).
"""

from __future__ import annotations

import functools
import os

import equinox as eqx
import jax
import numpy as np

#: Options of the search kernel, on the CPU backend.
SEARCH_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
#: Options of the enumeration kernel, on the CPU backend.
ENUMERATION_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


@functools.cache
def _accepted(key: str, value) -> bool:
    try:
        jax.jit(lambda x: x + 1.0, compiler_options={key: value}).lower(
            np.float32(0.0)).compile()
    except jax.errors.JaxRuntimeError as error:
        if "compile option" not in str(error):
            raise
        return False
    return True


def compiler_options(options: dict) -> dict | None:
    """The entries of `options` this backend accepts, or None (another backend, or
    `PERFMODEL_COMPILE_OPTIONS=default`)."""
    if os.environ.get("PERFMODEL_COMPILE_OPTIONS", "").strip().lower() == "default":
        return None
    if jax.default_backend() != "cpu":
        return None
    accepted = {k: v for k, v in options.items() if _accepted(k, v)}
    return accepted or None


class filter_jit:
    """`eqx.filter_jit(fun)` compiled with `compiler_options` of the option set named
    `options` in this module. The options are read at the first call (they depend on the
    backend, which should not start at import)."""

    def __init__(self, fun, options: str):
        self.fun, self.options = fun, options
        functools.update_wrapper(self, fun)

    @functools.cached_property
    def jitted(self):
        return eqx.filter_jit(self.fun,
                              compiler_options=compiler_options(globals()[self.options]))

    def __call__(self, *args, **kwargs):
        return self.jitted(*args, **kwargs)


def search_kernel(fun):
    """Decorator: `filter_jit` with `SEARCH_OPTIONS`."""
    return filter_jit(fun, "SEARCH_OPTIONS")


def enumeration_kernel(fun):
    """Decorator: `filter_jit` with `ENUMERATION_OPTIONS`."""
    return filter_jit(fun, "ENUMERATION_OPTIONS")
