"""The one smooth-max primitive of the model, and helpers built on it.

Every roofline `max` (compute vs memory vs fabric time, a power cap, a capacity cap) goes
through `smooth_max`, a p-norm of non-negative arguments:

    smooth_max(x_1..x_n) = (sum_i x_i^p)^(1/p),   max(x) <= smooth_max(x) <= n^(1/p) max(x).

It is exact as p -> inf, and `hard=True` gives the exact max for reports. A hard max gives the
non-binding resource exactly zero gradient and stalls gradient search; the p-norm does not.
The default sharpness p = 24 overestimates by at most 2.9% where two terms are exactly equal
and by less than 0.1% once one term is 25% larger than the other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

#: Default p of the p-norm; see the module docstring for the bound it gives.
DEFAULT_SHARPNESS = 24.0


@jax.custom_jvp
def _hard_max(*xs):
    """Elementwise `max` of arrays of one shape, whose derivative is that of the first
    largest argument. JAX's own rule for `max` divides by the number of arguments equal to
    the result; when a compiler evaluates the result and the arguments with different
    rounding (XLA:CPU did, at LLVM -O0 without fusion emitters), none is equal, and the
    derivative is 0 / 0."""
    return functools.reduce(jnp.maximum, xs)


@_hard_max.defjvp
def _hard_max_jvp(primals, tangents):
    # A running comparison: a later argument takes over only where it is strictly larger.
    best, dbest = primals[0], tangents[0]
    for x, dx in zip(primals[1:], tangents[1:], strict=True):
        take = x > best
        best, dbest = jnp.where(take, x, best), jnp.where(take, dx, dbest)
    return _hard_max(*primals), dbest


def smooth_max(*xs, sharpness=DEFAULT_SHARPNESS, hard: bool = False):
    """Smooth maximum of non-negative arrays (broadcast together).

    Args:
        *xs: non-negative arrays of any unit (all the same unit).
        sharpness: the p of the p-norm (dimensionless, > 1); may be traced.
        hard: static; if True, the exact `max`.

    Returns:
        An array of the broadcast shape, in the unit of the inputs.

    Example:
        >>> float(smooth_max(1.0, 0.0))
        1.0
        >>> float(smooth_max(2.0, 1.0, hard=True))
        2.0
    """
    xs = jnp.broadcast_arrays(*[jnp.asarray(x) for x in xs])
    if hard:
        # Elementwise maxima. A reduction over a stack of the arguments (as before
        # 2026-12-05) kept XLA:CPU from copying cheap producers into each consumer, but
        # became a YNNPACK fusion of its own; once the power cap's root stopped being
        # copied (`power._stretched_time`), the maxima were faster under a wide vmap
        # (`benchmarks/bench_vmap.py`, `bench_optimize.py`'s exhaustive kernel).
        return _hard_max(*xs)
    # Unstacked (in the gradient step a stack of the arguments is an array over XLA:CPU's
    # 512-byte limit for running a loop body in order; see `optimize._block`), and in the
    # log domain: top * (sum_i (x_i / top)^p)^(1/p) = exp(m + log(sum_i exp(p (l_i -
    # m))) / p) with l_i = log x_i and m = max_i l_i. A division per argument (the ratio
    # x_i / top) was one more small kernel of the gradient step each on XLA:CPU, which
    # pays per kernel at this size. Zero arguments have l_i = -inf, a zero term and a zero
    # gradient (double-`where`).
    logs = [jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.0)), -jnp.inf) for x in xs]
    m = functools.reduce(jnp.maximum, logs)
    positive = m > -jnp.inf
    safe_m = jnp.where(positive, m, 0.0)
    total = jnp.where(positive, sum(jnp.exp(sharpness * (lg - safe_m)) for lg in logs), 1.0)
    return jnp.where(positive, jnp.exp(safe_m + jnp.log(total) / sharpness), 0.0)


def smooth_min(*xs, sharpness=DEFAULT_SHARPNESS, hard: bool = False):
    """Smooth minimum of positive arrays: the harmonic dual of `smooth_max`.

    `smooth_min(x) = 1 / smooth_max(1/x)`, so `min(x) / n^(1/p) <= smooth_min(x) <= min(x)`.
    Use it for caps (a batch limited by memory capacity). Inputs must be > 0; `inf` is allowed
    and means "no cap".

    Example:
        >>> round(float(smooth_min(4.0, jnp.inf)), 6)
        4.0
    """
    if hard:
        # The exact minimum (the first smallest argument's derivative), with no divisions:
        # each was a kernel of its own under a wide vmap on XLA:CPU.
        return -smooth_max(*[-jnp.asarray(x) for x in xs], hard=True)
    inverses = [1.0 / jnp.asarray(x) for x in xs]
    return 1.0 / smooth_max(*inverses, sharpness=sharpness, hard=hard)


def safe_log(x, floor=1e-30):
    """`log(x)` with a finite value and gradient at `x = 0` (double-`where` trick)."""
    x = jnp.asarray(x)
    ok = x > floor
    return jnp.where(ok, jnp.log(jnp.where(ok, x, 1.0)), jnp.log(floor))


def safe_sqrt(x):
    """`sqrt(x)` for `x >= 0` with a finite gradient (0) at `x = 0` (double-`where` trick).

    Example:
        >>> import jax
        >>> float(jax.grad(safe_sqrt)(0.0)), float(safe_sqrt(4.0))
        (0.0, 2.0)
    """
    x = jnp.asarray(x)
    ok = x > 0
    return jnp.where(ok, jnp.sqrt(jnp.where(ok, x, 1.0)), 0.0)


def safe_div(numerator, denominator):
    """`numerator / denominator`, 0 where the denominator is 0 (finite gradient there)."""
    denominator = jnp.asarray(denominator)
    ok = denominator != 0
    return jnp.where(ok, numerator / jnp.where(ok, denominator, 1.0), 0.0)


def soft_penalty(excess_ratio, sharpness=DEFAULT_SHARPNESS):
    """Smooth hinge `max(0, r)` for a dimensionless constraint excess `r = need/have - 1`.

    `softplus(p r) / p`: about 0 for `r << 0`, about `r` for `r >> 0`; usable as an
    optimizer penalty. `log(2)/p` at `r = 0`.
    """
    excess_ratio = jnp.asarray(excess_ratio)
    return jnp.logaddexp(0.0, sharpness * excess_ratio) / sharpness
