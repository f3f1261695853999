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

Where JAX's persistent compilation cache is on (the command line turns it on), each
kernel's traced program is also kept on disk (`traced_store`): measured on `perfmodel
optimize`'s README example, a warm run takes 4.1-4.4 CPU seconds with it and 7.4 without.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import hashlib
import os
import pickle
import threading

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
        folder = traced_store()
        if folder is None:
            return self.jitted(*args, **kwargs)
        return _through_store(self, folder, args, kwargs)


def search_kernel(fun):
    """Decorator: `filter_jit` with `SEARCH_OPTIONS`."""
    return filter_jit(fun, "SEARCH_OPTIONS")


def enumeration_kernel(fun):
    """Decorator: `filter_jit` with `ENUMERATION_OPTIONS`."""
    return filter_jit(fun, "ENUMERATION_OPTIONS")


# A warm command still traces its kernels: the persistent compilation cache is keyed on the
# lowered program, so finding a compiled search kernel means tracing the search first (most
# of a warm `perfmodel optimize`). The store keeps each kernel's traced program
# (`jax.export`, serialized) under a key of everything the trace depends on (the static
# arguments, the shapes and dtypes of the arrays, the package's source, the versions), so
# a later process deserializes it instead of tracing, and the compilation cache then holds
# its executable.


def traced_store() -> str | None:
    """The folder of traced kernels: beside JAX's persistent compilation cache when one is
    set (`<cache>_traced`), else None (no store). `PERFMODEL_TRACED_STORE=off` disables it."""
    if os.environ.get("PERFMODEL_TRACED_STORE", "").strip().lower() == "off":
        return None
    cache = jax.config.jax_compilation_cache_dir
    if not cache:
        return None
    return os.path.normpath(cache) + "_traced"


def _missing_sentinel():
    from equinox._module import _flatten
    return _flatten.MISSING


def _register_sentinel() -> bool:
    """Equinox's tree definitions hold a sentinel that must unpickle as itself."""
    try:
        from equinox._module import _flatten
    except ImportError:
        return False
    copyreg.pickle(_flatten._Missing, lambda _: (_missing_sentinel, ()))
    return True


@functools.cache
def _source_digest() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as fh:
                    h.update(name.encode() + fh.read())
    return h.hexdigest()


def _key(kernel: filter_jit, static, treedef, leaves) -> str | None:
    import jaxlib
    try:
        static_bytes = pickle.dumps((jax.tree_util.tree_structure(static),
                                     jax.tree_util.tree_leaves(static), treedef))
    except (pickle.PicklingError, TypeError, AttributeError):
        return None
    h = hashlib.sha256(static_bytes)
    for x in leaves:
        h.update(repr((x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)))).encode())
    h.update(repr((kernel.fun.__module__, kernel.fun.__qualname__, kernel.options,
                   compiler_options(globals()[kernel.options]), jax.__version__,
                   jaxlib.__version__, eqx.__version__, jax.config.jax_enable_x64,
                   jax.default_backend(), _source_digest())).encode())
    return h.hexdigest()


def _load(path: str, options_name: str):
    stat = os.stat(path)
    return _load_version(path, options_name, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _load_version(path: str, options_name: str, mtime_ns: int, size: int):
    with open(path, "rb") as fh:
        out_tree, exported = pickle.load(fh)
    return out_tree, jax.jit(exported.call,
                             compiler_options=compiler_options(globals()[options_name]))


def _through_store(kernel: filter_jit, folder: str, args, kwargs):
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(dynamic)
    key = _key(kernel, static, treedef, leaves) if _register_sentinel() else None
    if key is None:
        return kernel.jitted(*args, **kwargs)
    path = os.path.join(folder, key + ".pkl")
    if not os.path.exists(path):
        out_tree = []

        def flat(*xs):
            a, k = eqx.combine(jax.tree_util.tree_unflatten(treedef, xs), static)
            out, tree = jax.tree_util.tree_flatten(kernel.fun(*a, **k))
            out_tree.append(tree)
            return out

        try:
            exported = jax.export.export(jax.jit(flat))(*leaves)
            # The serialized form needs `flatbuffers`; the dataclass pickles (less the
            # reverse-mode closure, which a forward call never uses).
            blob = pickle.dumps((out_tree[0], dataclasses.replace(exported, _get_vjp=None)))
            if pickle.loads(blob)[0] != out_tree[0]:
                raise TypeError("the output tree does not round-trip")
        except (TypeError, ValueError, AttributeError, NotImplementedError,
                pickle.PicklingError):
            return kernel.jitted(*args, **kwargs)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, path)
    try:
        out_tree, call = _load(path, kernel.options)
    except Exception:   # a torn or foreign file: trace and compile as without a store
        os.remove(path)
        return kernel.jitted(*args, **kwargs)
    return jax.tree_util.tree_unflatten(out_tree, call(*leaves))
