"""The shared solver idiom (`perfmodel.solvers`): a least-squares solve whose residuals and
Jacobian come from a separately compiled kernel, called back from the solve."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest

from perfmodel import compiled
from perfmodel.solvers import called_back, forward_jacobian, levenberg_marquardt


class Params(eqx.Module):
    scale: jnp.ndarray
    rate: jnp.ndarray


def decay(params, data):
    """A curve fit with a pytree of parameters (a scalar and a vector) and a matrix of
    residuals: y = scale x exp(-rate x t), one rate per column."""
    t, y = data
    model = params.scale * jnp.exp(-params.rate[None, :] * t[:, None])
    return model - y


T = jnp.linspace(0.0, 3.0, 7)
RATES = jnp.asarray([0.5, 1.5])
DATA = (T, 2.0 * jnp.exp(-RATES[None, :] * T[:, None])
        + 0.01 * jnp.sin(7.0 * T)[:, None])
START = Params(scale=jnp.asarray(1.0), rate=jnp.asarray([1.0, 1.0]))
KERNEL = compiled.filter_jit(forward_jacobian(decay))


def solve(fn, start, data):
    sol = optx.least_squares(fn, levenberg_marquardt(1e-10, 1e-12), start, args=data,
                             options={"jac": "fwd"}, max_steps=200, throw=False)
    return sol.value, sol.result, sol.stats["num_steps"], sol.state.f_info.jac.as_matrix()


def test_forward_jacobian_matches_jacfwd():
    r, jac = forward_jacobian(decay)(START, DATA)
    np.testing.assert_allclose(r, decay(START, DATA))
    expected = jax.jacfwd(decay)(START, DATA)
    columns = np.concatenate([np.reshape(expected.scale, (-1, 1)),
                              np.reshape(expected.rate, (r.size, 2))], axis=1)
    np.testing.assert_allclose(jac, columns, rtol=1e-12)


def test_called_back_solve_equals_the_traced_solve():
    direct = eqx.filter_jit(solve)(decay, START, DATA)
    through = eqx.filter_jit(solve)(called_back(KERNEL), START, DATA)
    assert direct[1] == optx.RESULTS.successful and through[1] == optx.RESULTS.successful
    assert int(direct[2]) == int(through[2])
    np.testing.assert_allclose(through[0].scale, direct[0].scale, rtol=1e-12)
    np.testing.assert_allclose(through[0].rate, direct[0].rate, rtol=1e-12)
    np.testing.assert_allclose(through[3], direct[3], rtol=1e-10, atol=1e-14)
    # The fit found the generating curve (up to the added ripple).
    assert abs(float(through[0].scale) - 2.0) < 0.02
    np.testing.assert_allclose(through[0].rate, RATES, rtol=0.05)


def test_called_back_kernel_lowers_once_per_structure():
    # A second solve with other data of the same types reuses the lowered kernel.
    lowered = len(KERNEL.lowered)
    eqx.filter_jit(solve)(called_back(KERNEL), START, (T, DATA[1] * 1.1))
    eqx.filter_jit(solve)(called_back(KERNEL), START, (T, DATA[1] * 0.9))
    assert len(KERNEL.lowered) - lowered <= 1


def test_called_back_has_the_kernel_jacobian_and_stops_args():
    fn = called_back(KERNEL)
    y_jac = jax.jacfwd(fn)(START, DATA)
    expected = jax.jacfwd(decay)(START, DATA)
    np.testing.assert_allclose(y_jac.scale, expected.scale, rtol=1e-12)
    np.testing.assert_allclose(y_jac.rate, expected.rate, rtol=1e-12)
    # No derivative in args: stopped, zero, not a wrong number.
    args_jac = jax.jacfwd(fn, argnums=1)(START, DATA)
    assert all(not np.any(np.asarray(x)) for x in jax.tree_util.tree_leaves(args_jac))


def test_called_back_rejects_a_non_array_parameter():
    with pytest.raises(ValueError, match="not an array"):
        called_back(KERNEL)(Params(scale=1.0, rate=jnp.asarray([1.0, 1.0])), DATA)


def test_called_back_traces_the_residuals_off_the_cpu(monkeypatch):
    # On an accelerator the callback could deadlock: the residual function is used as is.
    calls = []

    def spy(y, args):
        calls.append(1)
        return decay(y, args)

    kernel = compiled.filter_jit(forward_jacobian(spy))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    out = called_back(kernel)(START, DATA)
    np.testing.assert_allclose(out, decay(START, DATA))
    assert calls and not kernel.lowered
