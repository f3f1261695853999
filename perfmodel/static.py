"""Arithmetic on values that are either static (Python numbers) or arrays.

A parallel layout reaches the model as a static `design.Layout` (Python ints and bools: one
compiled kernel per layout, with the branches a layout does not take pruned away) or as a
`design.LayoutNumbers` (arrays, possibly traced or vmapped: one kernel for many layouts).
These helpers let one formula serve both: on static inputs they run the Python operation,
so a static layout computes exactly what it computed before arrays were allowed; on arrays
they run the `jax.numpy` counterpart.

Branches taken by arrays evaluate both sides and select with `jnp.where`, so the side a
layout does not take must stay finite, in value and gradient, on that layout's inputs (the
`where`-gradient trap): callers evaluate it on safe inputs (e.g. a group size of at least 2).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_STATIC = (bool, int, float, np.bool_, np.integer, np.floating)


def is_static(*xs) -> bool:
    """True when every argument is a Python (or NumPy scalar) number or bool."""
    return all(isinstance(x, _STATIC) for x in xs)


def concrete(x) -> np.ndarray | None:
    """`x` as a NumPy array where its value is known while tracing (a number, a NumPy
    array or a concrete JAX array: specs closed over by a jitted function), else None (a
    traced value). Formulas use it to drop terms that are exactly zero or one, which XLA
    keeps (x * 0 is not 0 for an infinite x)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def known(x, value) -> bool:
    """True where every element of `x` is known while tracing (`concrete`) to equal
    `value`.

    Example:
        >>> known(1.0, 1.0), known(jnp.asarray([0.0, 0.0]), 0.0), known(2.0, 1.0)
        (True, True, False)
    """
    c = concrete(x)
    return c is not None and bool(np.all(c == value))


def column(x, i: int):
    """`x[..., i]`: a NumPy array where `x` is known while tracing (`concrete`; so that
    `weighted` sees it: under jit every JAX operation is traced, constants included),
    else `lax.index_in_dim` (the same program as `x[..., i]`, and eager a fifth of its
    cost)."""
    c = concrete(x)
    if c is not None:
        return c[..., i]
    return jax.lax.index_in_dim(x, i, axis=-1, keepdims=False)


def weighted(weight, x):
    """`weight * x`, except that a `weight` known while tracing (`concrete`) to be exactly 0
    gives 0.0 and exactly 1 gives `x`: a placement or mix column that a closed-over design
    sets leaves no dead division in the program (XLA keeps 0 x (1 / y)).

    Example:
        >>> weighted(0.0, jnp.inf), weighted(1.0, 3.0), float(weighted(jnp.asarray(0.5), 4.0))
        (0.0, 3.0, 2.0)
    """
    if known(weight, 0.0):
        return 0.0
    if known(weight, 1.0):
        return x
    return weight * x


def branch(condition, if_true, if_false):
    """`if_true()` where `condition` holds, else `if_false()`.

    Args:
        condition: a Python bool (only the branch taken is evaluated) or a boolean array
            (both are evaluated and selected elementwise with `jnp.where`).
        if_true, if_false: zero-argument callables returning numbers or arrays, or pytrees
            (tuples) of them with the same structure.

    Example:
        >>> branch(True, lambda: 1.0, lambda: 1 / 0)
        1.0
        >>> branch(jnp.asarray([True, False]), lambda: 1.0, lambda: 2.0).tolist()
        [1.0, 2.0]
    """
    if is_static(condition):
        return if_true() if condition else if_false()
    decided = _decided(condition)
    if decided is not None:
        return if_true() if decided else if_false()
    condition = jnp.asarray(condition, dtype=bool)
    a, b = if_true(), if_false()
    if isinstance(a, tuple):
        return tuple(jnp.where(condition, x, y) for x, y in zip(a, b, strict=True))
    return jnp.where(condition, a, b)


def _decided(condition) -> bool | None:
    """True or False where a boolean array is known while tracing (`concrete`) to hold
    everywhere or nowhere, else None. An eager evaluation of many rows then skips a branch
    no row takes, and a branch every row takes needs no select (the same numbers)."""
    c = concrete(condition)
    if c is None:
        return None
    if np.all(c):
        return True
    return False if not np.any(c) else None


def add_if(condition, total, increment):
    """`total + increment()` where `condition` holds, else `total` (not evaluated when
    `condition` is a Python False or known while tracing to be False everywhere)."""
    if is_static(condition):
        return total + increment() if condition else total
    decided = _decided(condition)
    if decided is not None:
        return total + increment() if decided else total
    return jnp.where(jnp.asarray(condition, dtype=bool), total + increment(), total)


def logical_and(a, b):
    """`a and b` on Python bools, `jnp.logical_and` otherwise."""
    if is_static(a, b):
        return bool(a and b)
    return jnp.logical_and(a, b)


def logical_not(a):
    """`not a` on a Python bool, `jnp.logical_not` otherwise."""
    return (not a) if is_static(a) else jnp.logical_not(a)


def minimum(a, b):
    """`min` on Python numbers, `jnp.minimum` otherwise."""
    return min(a, b) if is_static(a, b) else jnp.minimum(a, b)


def maximum(a, b):
    """`max` on Python numbers, `jnp.maximum` otherwise."""
    return max(a, b) if is_static(a, b) else jnp.maximum(a, b)


def ceil(x):
    """`math.ceil` on a Python number, `jnp.ceil` otherwise."""
    return math.ceil(x) if is_static(x) else jnp.ceil(x)
