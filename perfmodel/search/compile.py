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

The kernels go through `perfmodel.compiled.filter_jit`, so a command line with the
persistent compilation cache also keeps their traced programs (`compiled.traced_store`).
"""

from __future__ import annotations

from ..compiled import QUICK_COMPILE, compiler_options, filter_jit  # noqa: F401  (re-exported)

#: Options of the search kernel, on the CPU backend.
SEARCH_OPTIONS = dict(QUICK_COMPILE)
#: Options of the enumeration kernel, on the CPU backend.
ENUMERATION_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def search_kernel(fun):
    """Decorator: `compiled.filter_jit` with `SEARCH_OPTIONS` (read at the first call)."""
    return filter_jit(fun, lambda: SEARCH_OPTIONS)


def enumeration_kernel(fun):
    """Decorator: `compiled.filter_jit` with `ENUMERATION_OPTIONS` (read at the first call)."""
    return filter_jit(fun, lambda: ENUMERATION_OPTIONS)
