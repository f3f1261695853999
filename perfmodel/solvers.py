"""The solver idiom shared by calibration, the power fit, the design search and the serving
fixed points: one result enumeration and one way to act on it.

Every solver in perfmodel returns a solution that carries a `result` of `RESULTS` (an
`equinox.Enumeration`, extending optimistix's own, so an optimistix result can be returned
as it is), and takes `throw=True` by default: a solve that did not succeed raises, naming
the solver and the reason, unless the caller asked to inspect the result instead.

Example:
    >>> import optimistix as optx
    >>> message(RESULTS.successful), succeeded(optx.RESULTS.successful)
    ('', True)
    >>> succeeded(check(RESULTS.infeasible, "optimize", throw=False))
    False
    >>> check(RESULTS.infeasible, "optimize")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    RuntimeError: optimize: No candidate meets every constraint: ...
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
from jax.flatten_util import ravel_pytree


class RESULTS(optx.RESULTS):  # type: ignore[misc]
    """Result codes of every perfmodel solver (optimistix's codes, and these)."""

    infeasible = ("No candidate meets every constraint: relax a target or widen the search "
                  "space (the solution names the closest candidate).")


def _as_results(result) -> RESULTS:
    return result if isinstance(result, RESULTS) else RESULTS.promote(result)


def message(result) -> str:
    """The human-readable text of a (concrete) result code ("" for success)."""
    return RESULTS[_as_results(result)]


def succeeded(result) -> bool:
    """Whether a (concrete) result code is `RESULTS.successful`."""
    return bool(_as_results(result) == RESULTS.successful)


def check(result, solver: str, throw: bool = True, detail: str = ""):
    """Return `result`; with `throw`, raise `RuntimeError` when it is not successful.

    Args:
        result: a concrete result code (`RESULTS` or `optimistix.RESULTS`).
        solver: the solver's name, for the message.
        throw: raise on failure.
        detail: extra context (loss, steps) appended to the message.
    """
    result = _as_results(result)
    if throw and not succeeded(result):
        extra = f" ({detail})" if detail else ""
        raise RuntimeError(f"{solver}: {message(result)}{extra}")
    return result


@functools.cache
def _levenberg_marquardt() -> optx.LevenbergMarquardt:
    # One instance: each holds its own `verbose` function, a static part of a compiled
    # solve, so a new instance would retrace it.
    return optx.LevenbergMarquardt(rtol=jnp.asarray(0.0), atol=jnp.asarray(0.0))


def levenberg_marquardt(rtol: float, atol: float) -> optx.LevenbergMarquardt:
    """`optimistix.LevenbergMarquardt` with these tolerances as arrays (traced, so a new
    tolerance reuses a compiled solve), shared by every least-squares fit of the package
    (the latency calibration, the inferred mode).

    Example:
        >>> float(levenberg_marquardt(1e-8, 1e-10).rtol)
        1e-08
    """
    return eqx.tree_at(lambda s: (s.rtol, s.atol), _levenberg_marquardt(),
                       (jnp.asarray(rtol, dtype=float), jnp.asarray(atol, dtype=float)))


def forward_jacobian(fn):
    """`fn(y, args)` (an array of residuals) as `(y, args) -> (residuals, Jacobian)`, the
    Jacobian by forward mode (one tangent per entry of `y`, vmapped, the residuals computed
    once beside them), of shape (residuals.size, entries of y): rows in the residuals'
    C order, columns in `ravel_pytree(y)` order. `y` is a pytree of arrays.

    Example:
        >>> r, jac = forward_jacobian(lambda y, a: a * y ** 2)(jnp.asarray([1.0, 2.0]), 3.0)
        >>> r.tolist(), jac.tolist()
        ([3.0, 12.0], [[6.0, 0.0], [0.0, 12.0]])
    """
    def value_and_jacobian(y, args):
        x, unravel = ravel_pytree(y)

        def flat(z):
            return fn(unravel(z), args)

        basis = jnp.eye(x.shape[0], dtype=x.dtype)
        r, columns = jax.vmap(lambda t: jax.jvp(flat, (x,), (t,)), out_axes=(None, 0))(basis)
        return r, jnp.reshape(columns, (x.shape[0], -1)).T

    functools.update_wrapper(value_and_jacobian, fn)
    return value_and_jacobian


def _spec(x):
    # The host callback receives NumPy arrays, which are never weakly typed: lower for those.
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) if eqx.is_array(x) else x


def called_back(kernel):
    """The residual function of a compiled `kernel` (a `perfmodel.compiled.filter_jit` of
    `forward_jacobian(fn)`) as a function `(y, args) -> residuals` to hand to an optimistix
    least-squares solve under jit: inside the solve's program it is a host callback to the
    kernel, whose Jacobian is its derivative (`jax.custom_jvp`, linear in the tangent).

    Why: optimistix traces the residual function into its solve several times (the
    iterate, its linearisation, the materialised Jacobian, the accept/reject branch), and
    XLA compiles the whole loop as one program. For a residual function as large as the
    serving model of three LLMs (the inferred mode of `perfmodel compare`), that program took
    11 s to trace and 40 s to compile on 2 cores; through the callback the solve's own
    program holds no model, and the kernel (the residuals and their Jacobian, one forward
    pass) traces and compiles once, in 3 and 6 s, and is then called once or twice per
    Levenberg-Marquardt step, a few ms each. The solution is the same to rounding.

    On the CPU backend only: elsewhere the callback would receive host arrays and dispatch
    the kernel to the accelerator from inside a program running there, so the residual
    function is traced into the solve as usual.

    The result is differentiable once (the Jacobian), not twice, and in `y` only (`args`
    pass through `jax.lax.stop_gradient`); `y` must be a pytree of
    arrays and `args` the same structure, static parts and array types on every call of
    one solve (the kernel is lowered for them at the first).

    Example:
        >>> from perfmodel import compiled
        >>> kernel = compiled.filter_jit(forward_jacobian(lambda y, a: a * y - 1.0))
        >>> fn = called_back(kernel)
        >>> sol = eqx.filter_jit(lambda a: optx.least_squares(
        ...     fn, levenberg_marquardt(1e-8, 1e-10), jnp.asarray([0.0]), args=a,
        ...     options={"jac": "fwd"}))(jnp.asarray(4.0))
        >>> round(float(sol.value[0]), 6)
        0.25
    """
    def residuals(y, args):
        if jax.default_backend() != "cpu":
            # A callback gets host arrays, and a kernel it dispatched to the accelerator
            # could wait on the solve that waits on it: there the residual function is
            # traced into the solve (`forward_jacobian` keeps it as `__wrapped__`).
            return kernel.fun.__wrapped__(y, args)
        for leaf in jax.tree_util.tree_leaves(y):
            if not eqx.is_array(leaf):
                raise ValueError(f"called_back: y has a leaf {leaf!r} that is not an array: "
                                 "give every entry of y as an array")
        dynamic, static = eqx.partition(args, eqx.is_array)
        lowered = kernel.lower(*jax.tree.map(_spec, (y, args)))
        shapes = lowered.out_shapes

        def host(y, dynamic):
            return lowered(y, eqx.combine(dynamic, static))

        def call(y, dynamic):
            return jax.pure_callback(host, shapes, y, dynamic, vmap_method="sequential")

        @jax.custom_jvp
        def value(y, dynamic):
            return call(y, dynamic)[0]

        @value.defjvp
        def value_jvp(primals, tangents):
            r, jac = call(*primals)
            return r, jnp.reshape(jac @ ravel_pytree(tangents[0])[0], r.shape)

        # Derivatives in `args` are not computed: stop them, so none is silently wrong.
        return value(y, jax.lax.stop_gradient(dynamic))

    return residuals
