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

import equinox as eqx
import jax
import optimistix as optx


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


def value_and_grad_forward(fun):
    """`fun(x)` and its gradient with respect to the pytree `x` by forward mode, compiled
    (`eqx.filter_jit`): one tangent per leaf, cheaper than reverse mode for a few
    parameters, and finite where reverse mode through the serving model was not (NaN
    gradients of HBM capacity and slice count under jit on XLA:CPU, the inferred fit of
    `perfmodel compare`).

    Example:
        >>> import jax.numpy as jnp
        >>> value, grad = value_and_grad_forward(lambda x: (x["a"] * x["b"]) ** 2)(
        ...     {"a": jnp.asarray(2.0), "b": jnp.asarray(3.0)})
        >>> float(value), float(grad["a"]), float(grad["b"])
        (36.0, 36.0, 24.0)
    """
    def both(x):
        value = fun(x)
        return value, value

    def call(x):
        grads, value = jax.jacfwd(both, has_aux=True)(x)
        return value, grads

    return eqx.filter_jit(call)


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
