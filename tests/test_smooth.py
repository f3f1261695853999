"""The smooth-max primitive and the NaN-free helpers: documented bounds, exact hard mode,
finite gradients at the edges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from perfmodel.smooth import (
    DEFAULT_SHARPNESS,
    safe_div,
    safe_log,
    safe_sqrt,
    smooth_max,
    smooth_min,
    soft_penalty,
)

positive = st.floats(1e-12, 1e12)
# No subnormals: XLA on CPU flushes them to zero, and no time, byte or FLOP count of the model
# comes within 300 orders of magnitude of them.
values = st.lists(st.floats(0.0, 1e12, allow_subnormal=False), min_size=1, max_size=5)


@given(xs=values, p=st.floats(2.0, 64.0))
def test_smooth_max_bounds(xs, p):
    """max(x) <= smooth_max(x) <= n^(1/p) max(x) (smooth.py module docstring)."""
    got = float(smooth_max(*xs, sharpness=p))
    top = max(xs)
    assert top * (1 - 1e-12) <= got <= len(xs) ** (1 / p) * top * (1 + 1e-12)
    assert float(smooth_max(*xs, hard=True)) == top


def test_documented_overestimates():
    """'at most 2.9 % where two terms are exactly equal and by less than 0.1 % once one term is
    25 % larger than the other' (p = 24)."""
    assert DEFAULT_SHARPNESS == 24.0
    np.testing.assert_allclose(float(smooth_max(1.0, 1.0)), 2 ** (1 / 24), rtol=1e-12)
    assert round(100 * (2 ** (1 / 24) - 1), 1) == 2.9
    assert float(smooth_max(1.25, 1.0)) / 1.25 - 1 < 1e-3


@given(x=positive, y=positive, bump=st.floats(1e-6, 1e3))
def test_smooth_max_monotone(x, y, bump):
    assert float(smooth_max(x * (1 + bump), y)) >= float(smooth_max(x, y))


@given(xs=st.lists(positive, min_size=1, max_size=4))
def test_smooth_min_bounds(xs):
    got = float(smooth_min(*xs))
    low = min(xs)
    assert low / len(xs) ** (1 / 24) * (1 - 1e-12) <= got <= low * (1 + 1e-12)
    # inf means "no cap".
    np.testing.assert_allclose(float(smooth_min(*xs, jnp.inf)), got, rtol=1e-12)


def test_smooth_max_converges_to_max():
    for p in (24.0, 96.0, 384.0):
        assert float(smooth_max(3.0, 3.0, sharpness=p)) - 3.0 <= 3.0 * (2 ** (1 / p) - 1) + 1e-15
    np.testing.assert_allclose(float(smooth_max(3.0, 2.0, 1.0, sharpness=1e4)), 3.0, rtol=1e-4)


def test_gradients_are_finite_at_zero():
    """STYLE.md: no NaN gradients at the edges (all-zero arguments, zero under a log/sqrt,
    zero denominators)."""
    grad_max = jax.grad(lambda x: smooth_max(x, 0.0))(0.0)
    assert np.isfinite(float(grad_max))
    grads = jax.grad(lambda x: smooth_max(x, 2.0 * x, 0.0))(0.0)
    assert np.isfinite(float(grads))
    for f in (safe_log, safe_sqrt):
        assert np.isfinite(float(jax.grad(f)(0.0)))
    assert float(safe_div(1.0, 0.0)) == 0.0
    assert np.isfinite(float(jax.grad(lambda d: safe_div(1.0, d))(0.0)))


def test_smooth_max_gradient_splits_between_ties():
    """Unlike a hard max, both terms get gradient: at a tie each gets 2^(1/p) / 2."""
    g = jax.grad(lambda v: smooth_max(v[0], v[1]))(jnp.asarray([1.0, 1.0]))
    np.testing.assert_allclose(np.asarray(g), [2 ** (1 / 24) / 2] * 2, rtol=1e-12)
    g_small = jax.grad(lambda v: smooth_max(v[0], v[1]))(jnp.asarray([1.0, 0.5]))
    assert 0 < float(g_small[1]) < 1e-6 < float(g_small[0])


@given(x=positive)
def test_safe_helpers_match_numpy_on_the_interior(x):
    np.testing.assert_allclose(float(safe_log(x)), np.log(x), rtol=1e-12)
    np.testing.assert_allclose(float(safe_sqrt(x)), np.sqrt(x), rtol=1e-12)
    np.testing.assert_allclose(float(safe_div(2.0, x)), 2.0 / x, rtol=1e-12)


def test_soft_penalty():
    assert float(soft_penalty(-1.0)) < 1e-10
    np.testing.assert_allclose(float(soft_penalty(1.0)), 1.0, rtol=1e-10)
    np.testing.assert_allclose(float(soft_penalty(0.0)), np.log(2) / 24, rtol=1e-12)


def test_hard_max_derivative_is_the_largest_arguments():
    """The exact max's derivative is the largest argument's (the first one on a tie), by
    construction: JAX's rule divides by the count of arguments equal to the result, which
    was 0 / 0 in the compiled search kernel when the result and the arguments came out of
    XLA:CPU with different rounding (the design_optimization notebook's GB300 case)."""
    x = jnp.asarray([1.0, 3.0, 2.0])
    f = lambda x: smooth_max(x[0], x[1], x[2], hard=True)
    assert float(f(x)) == 3.0
    np.testing.assert_array_equal(jax.grad(f)(x), [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(jax.jacfwd(f)(x), [0.0, 1.0, 0.0])
    tie = jnp.asarray([2.0, 2.0, 1.0])
    np.testing.assert_array_equal(jax.grad(f)(tie), [1.0, 0.0, 0.0])
    batched = jax.vmap(jax.grad(f))(jnp.asarray([[1.0, 3.0, 2.0], [5.0, 0.0, 1.0]]))
    np.testing.assert_array_equal(batched, [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_hard_min_is_the_exact_minimum_with_the_smallest_arguments_derivative():
    """The hard minimum is computed without divisions (each was a kernel of its own under a
    wide vmap): exact, including `inf` (no cap), with the first smallest argument's
    derivative."""
    x = jnp.asarray([3.0, 1.0 / 3.0, 2.0])
    f = lambda x: smooth_min(x[0], x[1], x[2], hard=True)
    assert float(f(x)) == 1.0 / 3.0
    np.testing.assert_array_equal(jax.grad(f)(x), [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(jax.grad(f)(jnp.asarray([1.0, 1.0, jnp.inf])), [1.0, 0.0, 0.0])
    assert float(smooth_min(5.0, jnp.inf, hard=True)) == 5.0
