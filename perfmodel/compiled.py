"""Compiled entry points: `eqx.filter_jit` with XLA options, and a store of traced programs.

`filter_jit(fun, options)` is `eqx.filter_jit(fun)` compiled with the XLA options that
`options()` returns, kept where this backend accepts them (`compiler_options`). Where
JAX's persistent compilation cache is on (the command line turns it on), each kernel's
traced program is also kept on disk (`traced_store`): the compilation cache is keyed on
the lowered program, so without the store a warm command traces every kernel again before
the cache can find its executable. Measured on `perfmodel optimize`'s README example (2
cores, load average about 5): a warm run takes 4.1-4.4 CPU seconds with the store and 7.4
without.
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
    """`eqx.filter_jit(fun)` compiled with `compiler_options(options())`, through the store
    of traced programs when there is one (`traced_store`). `options` is read at the first
    call (the accepted options depend on the backend, which should not start at import).

    Example:
        >>> import jax.numpy as jnp
        >>> double = filter_jit(lambda x: 2.0 * x)
        >>> float(double(jnp.asarray(1.5)))
        3.0
    """

    def __init__(self, fun, options=dict):
        self.fun, self.options = fun, options
        functools.update_wrapper(self, fun)

    def compiler_options(self) -> dict | None:
        return compiler_options(self.options())

    @functools.cached_property
    def jitted(self):
        return eqx.filter_jit(self.fun, compiler_options=self.compiler_options())

    def __call__(self, *args, **kwargs):
        folder = traced_store()
        if folder is None:
            return self.jitted(*args, **kwargs)
        return _through_store(self, folder, args, kwargs)


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
    root = os.path.dirname(os.path.abspath(__file__))
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
    h.update(repr((kernel.fun.__module__, kernel.fun.__qualname__,
                   kernel.compiler_options(), jax.__version__,
                   jaxlib.__version__, eqx.__version__, jax.config.jax_enable_x64,
                   jax.default_backend(), _source_digest())).encode())
    return h.hexdigest()


def _load(path: str, options: dict | None):
    stat = os.stat(path)
    frozen = tuple(sorted(options.items())) if options else None
    return _load_version(path, frozen, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _load_version(path: str, options, mtime_ns: int, size: int):
    with open(path, "rb") as fh:
        out_tree, exported = pickle.load(fh)
    return out_tree, jax.jit(exported.call,
                             compiler_options=dict(options) if options else None)


def _through_store(kernel: filter_jit, folder: str, args, kwargs):
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(dynamic)
    key = _key(kernel, static, treedef, leaves) if _register_sentinel() else None
    if key is None:
        return kernel.jitted(*args, **kwargs)
    path = os.path.join(folder, key + ".pkl")
    skip = os.path.join(folder, key + ".skip")
    if os.path.exists(skip):
        return kernel.jitted(*args, **kwargs)
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
            # Not exportable (a host callback, such as `eqx.error_if`'s run-time checks):
            # remembered, so later runs trace once, as without a store.
            os.makedirs(folder, exist_ok=True)
            open(skip, "wb").close()
            return kernel.jitted(*args, **kwargs)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, path)
    try:
        out_tree, call = _load(path, kernel.compiler_options())
    except Exception:   # a torn or foreign file: trace and compile as without a store
        os.remove(path)
        return kernel.jitted(*args, **kwargs)
    return jax.tree_util.tree_unflatten(out_tree, call(*leaves))
