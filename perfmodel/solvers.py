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
import jax.numpy as jnp
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
