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

#: XLA:CPU options for small, scalar-heavy kernels that run a few times (the design search,
#: `perfmodel predict`'s per-group kernels of measurement rows), where compiling costs
#: seconds and running milliseconds: LLVM at -O0 and no fusion emitters. Measured in
#: `perfmodel/search/compile.py` (the search kernel 8.6 CPU s cold against 36.3 s with XLA's
#: defaults) and on the 688 power rows (60 CPU s against 204 s, outputs equal to 1 ulp).
QUICK_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}


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


def on_host(tree):
    """`tree` with every array leaf as a NumPy array (a Module keeps its class, without
    running its converters), so arithmetic on it runs on the host: outside a kernel, each
    `jax.numpy` operation on a small array is a compiled program of its own (compiled on a
    cold run, looked up and loaded on a warm one).

    Example:
        >>> import jax.numpy as jnp
        >>> type(on_host({"x": jnp.ones(2)})["x"]).__name__
        'ndarray'
    """
    return jax.tree_util.tree_map(np.asarray, tree)


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
        self.lowered = {}
        """`lower`'s kernels by their static arguments and array types."""
        self._lock = threading.Lock()
        self._jitted = None
        functools.update_wrapper(self, fun)

    def compiler_options(self) -> dict | None:
        return compiler_options(self.options())

    @property
    def jitted(self):
        """The `eqx.filter_jit` of `fun`, built once (threads that call a kernel at the same
        time share one jit cache; `perfmodel compare` sweeps from several threads)."""
        with self._lock:
            if self._jitted is None:
                self._jitted = eqx.filter_jit(self.fun,
                                              compiler_options=self.compiler_options())
            return self._jitted

    def __call__(self, *args, **kwargs):
        folder = traced_store()
        if folder is None:
            return self.jitted(*args, **kwargs)
        return _through_store(self, folder, args, kwargs)

    def lower(self, *args, **kwargs) -> Lowered:
        """Trace (or load from the store) and lower the kernel for these arguments, without
        compiling it. Array leaves may be `jax.ShapeDtypeStruct`s (the `out_shapes` of an
        earlier kernel), so a chain of kernels can be lowered before any of them runs and
        compiled side by side (`side_by_side`)."""
        dynamic, static = eqx.partition((args, kwargs), _is_dynamic)
        leaves, treedef = jax.tree_util.tree_flatten(dynamic)
        # As jit's own cache: the same static arguments and array types lower (and compile)
        # once per process.
        key = (treedef, jax.tree_util.tree_structure(static),
               tuple(jax.tree_util.tree_leaves(static)),
               tuple((x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)))
                     for x in leaves))
        if key not in self.lowered:
            self.lowered[key] = self._lower(static, leaves, treedef)
        return self.lowered[key]

    def _lower(self, static, leaves, treedef) -> Lowered:
        options = self.compiler_options()
        folder = traced_store()
        loaded = _stored(self, folder, static, treedef, leaves) if folder else None
        if loaded is not None:
            out_tree, call = loaded
            return Lowered(call.lower(*leaves), out_tree, treedef)
        flat, out_tree = _flat(self.fun, static, treedef)
        lowered = jax.jit(flat, compiler_options=options).lower(*leaves)
        return Lowered(lowered, out_tree[0], treedef)


def _flat(fun, static, treedef):
    """`fun` as a function of the flat array leaves (`treedef`) of its arguments, with the
    `static` part put back, and a list that receives its output tree when traced."""
    out_tree = []

    def flat(*xs):
        a, k = eqx.combine(jax.tree_util.tree_unflatten(treedef, xs), static)
        out, tree = jax.tree_util.tree_flatten(fun(*a, **k))
        out_tree.append(tree)
        return out

    return flat, out_tree


def _is_dynamic(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


class Lowered:
    """A lowered kernel (`filter_jit.lower`): `compile()` it (thread-safe: XLA compiles
    without holding Python's lock), then call it with concrete arguments of the shapes it
    was lowered for; `out_shapes` is its output as `jax.ShapeDtypeStruct`s."""

    def __init__(self, lowered, out_tree, treedef):
        self.lowered, self.out_tree, self.treedef = lowered, out_tree, treedef
        self.compiled = None

    @property
    def out_shapes(self):
        return jax.tree_util.tree_unflatten(self.out_tree, list(self.lowered.out_info))

    def compile(self) -> Lowered:
        if self.compiled is None:
            self.compiled = self.lowered.compile()
        return self

    def __call__(self, *args, **kwargs):
        dynamic, _ = eqx.partition((args, kwargs), eqx.is_array)
        leaves, treedef = jax.tree_util.tree_flatten(dynamic)
        if treedef != self.treedef:
            raise ValueError("a lowered kernel was called with arguments of another structure "
                             "than it was lowered for")
        return jax.tree_util.tree_unflatten(self.out_tree, self.compile().compiled(*leaves))


class side_by_side:
    """Compile lowered kernels side by side while the caller goes on (tracing the next
    one): `submit(lowered)` starts its compilation on a thread of a pool of `threads`
    (default: the cores) and returns it; leaving the `with` block waits for every
    compilation (and raises the first error). XLA:CPU compiles a kernel on one thread and
    releases Python's lock while it does, so on two idle cores two kernels compile in about
    the time of the longer one, and a kernel compiles while the next is traced; a cached
    executable (the persistent compilation cache) only loads.

    Example:
        >>> import jax.numpy as jnp
        >>> double = filter_jit(lambda x: 2.0 * x)
        >>> with side_by_side() as compiler:
        ...     kernel = compiler.submit(double.lower(jnp.zeros(3)))
        >>> kernel(jnp.ones(3)).tolist()
        [2.0, 2.0, 2.0]
    """

    def __init__(self, threads: int | None = None):
        self.threads = threads or os.cpu_count() or 1

    def __enter__(self):
        from concurrent.futures import ThreadPoolExecutor
        self.pool = ThreadPoolExecutor(max_workers=self.threads)
        self.futures = []
        return self

    def submit(self, lowered: Lowered) -> Lowered:
        self.futures.append(self.pool.submit(lowered.compile))
        return lowered

    def __exit__(self, *exc):
        try:
            for future in self.futures:
                future.result()
        finally:
            self.pool.shutdown()
        return False


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
    loaded = _stored(kernel, folder, static, treedef, leaves)
    if loaded is None:
        return kernel.jitted(*args, **kwargs)
    out_tree, call = loaded
    return jax.tree_util.tree_unflatten(out_tree, call(*map(_uncommitted, leaves)))


def _uncommitted(x):
    """`x`, or a host copy of it when it is a single-device array committed to its device.

    A stored program's outputs come back committed (`jax.export`'s call), and a committed
    argument lowers to a program with explicit shardings: fed as they are to the next
    stored kernel, they would compile it again beside the program for uncommitted
    arguments, which computes the same on one device."""
    if isinstance(x, jax.core.Tracer) or not getattr(x, "committed", False):
        return x
    return np.asarray(x) if len(x.sharding.device_set) == 1 else x


def _stored(kernel: filter_jit, folder: str, static, treedef, leaves):
    """(output tree, jitted call of the exported program) of the kernel from the store,
    traced and exported first when it is not there; None when the kernel cannot go
    through the store (then it is traced as without one)."""
    key = _key(kernel, static, treedef, leaves) if _register_sentinel() else None
    if key is None:
        return None
    path = os.path.join(folder, key + ".pkl")
    skip = os.path.join(folder, key + ".skip")
    if os.path.exists(skip):
        return None
    if not os.path.exists(path):
        flat, out_tree = _flat(kernel.fun, static, treedef)

        try:
            # Every custom call is allowed (LAPACK's QR in the least-squares solves has no
            # cross-version guarantee): the key holds jax's and jaxlib's versions, so only
            # the versions that exported a program load it. Host callbacks still refuse.
            any_call = (jax.export.DisabledSafetyCheck.custom_call("ALL"),)
            exported = jax.export.export(jax.jit(flat), disabled_checks=any_call)(*leaves)
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
            return None
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, path)
    try:
        return _load(path, kernel.compiler_options())
    except Exception:   # a torn or foreign file: trace and compile as without a store
        os.remove(path)
        return None
