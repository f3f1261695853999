"""How the search's kernels are compiled: `eqx.filter_jit` with XLA:CPU options that cut
compilation time, which dominates a cold search.

The search kernel is a scalar-heavy graph of a few thousand tiny operations, where XLA:CPU
spends seconds compiling and milliseconds running. Measured with `python
benchmarks/bench_optimize.py --layouts 13 --min-points 100000 --compile-options
search|O1|default` (455k designs, 13 layouts, 2 busy cores; cold CPU seconds, warm wall):

- `xla_backend_optimization_level=0` (the search kernel only): 8.6 s cold and 59 ms warm,
  against 18.0 s and 33 ms at LLVM -O1 and 36.3 s and 35 ms with XLA's defaults. Cold time
  is what a command-line search pays; warm, the kernel stays far below enumeration.
- `xla_cpu_use_fusion_emitters=False` (both kernels): the fusion emitters lengthen this
  graph's compilation without speeding it up; the enumeration kernel's cold run takes 3.7
  CPU seconds without them, 6.4 with them. jaxlib 0.11 dropped the flag and rejects it.
  The enumeration kernel keeps LLVM's optimizations: it evaluates a million designs.

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
