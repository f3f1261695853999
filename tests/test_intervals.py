"""Prediction intervals (`perfmodel.calibration.intervals`): the covariance and its
propagation against closed forms, jit against eager, lo <= prediction <= hi, no NaN."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from perfmodel import fitted
from perfmodel.calibration import intervals as iv
from perfmodel.calibration.params import FAMILY_FIELDS, FRAMEWORK_FIELDS, Params, from_json

Z90 = 1.6448536269514722   # the standard normal's 95th percentile


def test_linear_quantity_interval_matches_the_analytic_one():
    """y = a + B theta with theta ~ N(theta0, C): y's variance is diag(B C B^T) and its
    Gaussian 90 % interval a + B theta0 +- 1.645 sqrt(s^2 + var)."""
    rng = np.random.default_rng(0)
    A = rng.normal(size=(4, 4))
    cov = A @ A.T + 0.1 * np.eye(4)
    B, a, theta = rng.normal(size=(3, 4)), rng.normal(size=3), rng.normal(size=4)
    value, var = iv.propagate(lambda t: jnp.asarray(a) + jnp.asarray(B) @ t,
                              jnp.asarray(theta), jnp.asarray(cov))
    np.testing.assert_allclose(value, a + B @ theta, rtol=1e-12)
    np.testing.assert_allclose(var, np.diag(B @ cov @ B.T), rtol=1e-10)
    scale = 0.07
    lo, hi, sd = iv.bounds(jnp.asarray(a + B @ theta), jnp.asarray(B),
                           jnp.broadcast_to(jnp.asarray(cov), (3, 4, 4)), scale, -Z90, Z90)
    exact = np.sqrt(scale ** 2 + np.diag(B @ cov @ B.T))
    np.testing.assert_allclose(sd, exact, rtol=1e-10)
    np.testing.assert_allclose(np.log(lo), a + B @ theta - Z90 * exact, rtol=1e-10)
    np.testing.assert_allclose(np.log(hi), a + B @ theta + Z90 * exact, rtol=1e-10)


def test_covariance_is_the_linear_least_squares_posterior():
    """For y = X theta + noise(sigma) with a Gaussian prior of widths w, the posterior
    covariance is that of the augmented least squares [X / sigma; diag(1 / w)] (here by QR:
    (R^T R)^-1), and a direction no datum sees keeps its prior variance."""
    rng = np.random.default_rng(1)
    X, sigma, widths = rng.normal(size=(20, 3)), 0.3, np.array([1.0, 2.0, 0.5])
    cov = iv.posterior_covariance(X, np.full(20, sigma ** -2), np.diag(1.0 / widths))
    _, R = np.linalg.qr(np.vstack([X / sigma, np.diag(1.0 / widths)]))
    R_inv = np.linalg.inv(R)
    np.testing.assert_allclose(cov, R_inv @ R_inv.T, rtol=1e-10, atol=1e-14)
    # Only theta_0 + theta_1 is measured: theta_0 - theta_1 keeps the prior's variance 2.
    cov = iv.posterior_covariance(np.array([[1.0, 1.0]] * 50), np.full(50, 1e6), np.eye(2))
    d = np.array([1.0, -1.0])
    # The precision's condition number is 1e8: eigh's rounding reaches about 1e-8 of it.
    assert math.isclose(d @ cov @ d, 2.0, rel_tol=1e-6)
    s = np.array([1.0, 1.0])
    assert s @ cov @ s < 1e-6


def test_bounds_jit_and_eager_agree():
    rng = np.random.default_rng(2)
    y, g = jnp.asarray(rng.normal(size=5)), jnp.asarray(rng.normal(size=(5, 12)))
    A = rng.normal(size=(5, 12, 12))
    cov = jnp.asarray(np.einsum("nij,nkj->nik", A, A) * 1e-3)
    args = (y, g, cov, jnp.asarray(0.1), jnp.asarray(-1.8), jnp.asarray(1.5))
    jitted = iv.bounds(*args)
    with jax.disable_jit():
        eager = iv.bounds(*args)
    for a, b in zip(jitted, eager, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13)


finite = st.floats(-50.0, 50.0, allow_nan=False)


@given(y=finite, g=st.lists(finite, min_size=3, max_size=3),
       scale=st.floats(0.0, 3.0), z_lo=st.floats(-5.0, 1.0), z_hi=st.floats(-1.0, 5.0))
def test_bounds_contain_the_prediction_and_are_finite(y, g, scale, z_lo, z_hi):
    """lo <= exp(y) <= hi and no NaN for any finite inputs (quantiles on the wrong side of 0
    clip to the prediction)."""
    cov = jnp.asarray(np.diag([0.01, 0.5, 0.0]))[None]
    lo, hi, sd = iv.bounds(jnp.asarray([y]), jnp.asarray([g]), cov, jnp.asarray(scale),
                           jnp.asarray(z_lo), jnp.asarray(z_hi))
    pred = math.exp(y)
    assert np.all(np.isfinite([lo[0], hi[0], sd[0]]))
    assert float(lo[0]) <= pred * (1 + 1e-12) and pred <= float(hi[0]) * (1 + 1e-12)


def test_level_and_fallback_variance():
    p = Params.prior(("blackwell", "pooled"), ("vllm",))
    intervals = iv.Intervals.at_priors(p, scale=0.1)
    lo, hi = intervals.z("pred_ttft_s", 0.9)
    assert math.isclose(hi, Z90, rel_tol=1e-3) and math.isclose(lo, -Z90, rel_tol=1e-3)
    assert intervals.z("pred_ttft_s", 0.5)[1] < hi
    with pytest.raises(ValueError, match="level"):
        intervals.z("pred_ttft_s", 1.5)
    fitted_cov, extra = intervals.row_covariance(p, "blackwell", "vllm")
    assert not extra.any()
    # rubin falls back to blackwell: its family terms add the pooled prior's spread; an
    # unknown framework takes the priors.
    pooled = eqx_pooling(intervals, 0.5)
    cov, extra = pooled.row_covariance(p, "rubin", "nonesuch")
    widths = np.array([f[3] for f in FAMILY_FIELDS])
    nf = len(FAMILY_FIELDS)
    np.testing.assert_allclose(extra[:nf], (0.5 * widths) ** 2)
    np.testing.assert_allclose(np.diag(cov)[:nf],
                               np.diag(fitted_cov)[:nf] + (0.5 * widths) ** 2)
    np.testing.assert_allclose(np.diag(cov)[nf:], np.diag(fitted_cov)[nf:])


def eqx_pooling(intervals, pooling):
    return iv.Intervals(covariance=intervals.covariance, scale=intervals.scale,
                        quantiles=intervals.quantiles, names=intervals.names,
                        keys=intervals.keys, pooling=pooling)


def test_json_round_trip_and_framework_scales():
    p = Params.prior(("hopper",), ("sglang", "vllm"))
    a = iv.Intervals.at_priors(p, scale=0.2)
    a = iv.Intervals(covariance=a.covariance, scale=a.scale, quantiles=a.quantiles,
                     names=a.names, keys=a.keys,
                     framework_scale=np.tile([0.3, 0.1], (len(a.keys), 1)),
                     scale_frameworks=("sglang", "vllm"))
    b = iv.Intervals.from_json(a.to_json({"date": "x"}))
    np.testing.assert_allclose(b.covariance, a.covariance)
    np.testing.assert_allclose(b.quantiles, a.quantiles)
    np.testing.assert_allclose(b.framework_scale, a.framework_scale)
    assert b.names == a.names and b.keys == a.keys
    # Its own scale, its engine's (sglang-disagg -> sglang), the metric's for the unknown.
    assert b.scale_for("pred_ttft_s", "vllm", p) == 0.1
    assert b.scale_for("pred_ttft_s", "sglang-disagg", p) == 0.3
    assert b.scale_for("pred_ttft_s", "nonesuch", p) == 0.2
    with pytest.raises(ValueError, match="version"):
        iv.Intervals.from_json({"version": 99})


def test_shipped_intervals_match_the_shipped_fit():
    data = fitted.read(iv.INTERVAL_FILE)
    assert data, "perfmodel/data/fitted_intervals.json is shipped with the fit"
    intervals = iv.Intervals.from_json(data)
    params = from_json(fitted.read(fitted.LATENCY_FILE))
    assert intervals.names == iv.parameter_names(params)
    cov = intervals.covariance
    np.testing.assert_allclose(cov, cov.T, atol=1e-12)
    assert np.linalg.eigvalsh(cov).min() > -1e-12
    # No parameter is surer than the data allow nor vaguer than its prior.
    widths = np.concatenate([np.tile([f[3] for f in FAMILY_FIELDS], len(params.families)),
                             np.tile([f[3] for f in FRAMEWORK_FIELDS], len(params.frameworks))])
    assert np.all(np.sqrt(np.diag(cov)) <= widths * (1 + 1e-9))
    assert np.all(np.diff(intervals.quantiles, axis=1) >= 0)
    for key in iv.INTERVAL_KEYS:
        lo, hi = intervals.z(key, 0.9)
        assert lo < 0 < hi, key


def test_intervals_of_another_fit_are_refused(monkeypatch):
    """A fitted_intervals.json whose fit loss is not the shipped fit's (a refit that did not
    rewrite it) is refused by name before any work; so is a level outside (0, 1)."""
    from perfmodel.calibration.predict import predict_rows

    real = fitted.read

    def read(name):
        data = dict(real(name))
        if name == iv.INTERVAL_FILE:
            data["fit_loss"] = -1.0
        return data

    monkeypatch.setattr(fitted, "read", read)
    with pytest.raises(ValueError, match="another fit"):
        predict_rows([], interval=0.9)
    with pytest.raises(ValueError, match="level"):
        predict_rows([], interval=1.0)


@pytest.mark.slow
def test_predicted_rows_have_ordered_finite_bounds_and_the_jacobian_is_the_derivative():
    """Eager rows through `predict_rows(interval=0.9)`: lo <= pred <= hi, finite; and the
    row's Jacobian equals a central difference of the prediction along a random direction
    in its 12 unconstrained parameters."""
    import perfmodel.datasets as ds
    from perfmodel.calibration.predict import linearize, predict_rows

    rows = [ds.BenchRow(i, i + 2, "gpt-oss-120b", "b200", "vllm", "fp4", 1024., 1024.,
                        conc, False, ds.PoolLayout(1, 1, False), None, None, {})
            for i, conc in enumerate((4.0, 64.0))]
    p = Params.prior(("blackwell",), ("vllm",))
    out = predict_rows(rows, p, interval=0.9,
                       intervals=iv.Intervals.at_priors(p, scale=0.1))
    for entry in out:
        for key in iv.INTERVAL_KEYS:
            lo, pred, hi = entry[key + "_lo"], entry[key], entry[key + "_hi"]
            assert all(math.isfinite(v) for v in (lo, pred, hi)), key
            assert lo <= pred <= hi and hi / lo > 1.1, key
    nf = len(FAMILY_FIELDS)
    direction = np.random.default_rng(3).normal(size=p.flat.size)
    eps = 1e-4
    lin = linearize(rows, p, power={})

    def shifted(sign):
        q = Params(family_raw=p.family_raw + sign * eps * direction[None, :nf],
                   framework_raw=p.framework_raw + sign * eps * direction[None, nf:],
                   families=p.families, frameworks=p.frameworks)
        return predict_rows(rows, q, power={})

    plus, minus = shifted(1.0), shifted(-1.0)
    base = predict_rows(rows, p, power={})
    for k in range(len(rows)):
        for key in ("pred_tput_per_chip_total", "pred_ttft_s", "pred_tpot_s"):
            fd = (math.log(plus[k][key]) - math.log(minus[k][key])) / (2 * eps)
            # A central difference at 1e-4 in float64: truncation ~1e-8 relative.
            assert math.isclose(lin[k]["jacobian"][key] @ direction, fd, rel_tol=1e-5,
                                abs_tol=1e-8), key
            assert math.isclose(math.exp(lin[k]["log"][key]), base[k][key], rel_tol=1e-9)
