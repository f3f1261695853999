"""Gradients of `predict` against float64 central finite differences.

Parameters (chip specs, efficiencies, power, design, runtime, workload: see
`test_core_cases.PARAMETERS`) live in log space (acceptance in logit space); outputs are the
logs of TPOT, TTFT, throughput per chip, power and the p99 TPOT and TTFT, so every derivative
is an elasticity of order one and an absolute tolerance means the same for all of them.

Tolerances are JAX's own defaults for float64 (`jax.test_util.check_grads`: step 1e-4,
atol = rtol = 1e-5). The smooth max (p = 24) has third log-derivatives of order p^2, so the
central-difference truncation error is about 1e-8 / 6 * 576 ~ 1e-6, inside the tolerance.
Directions are normalised to unit length (check_grads uses unnormalised normal tangents, whose
length ~5 in 25+ dimensions would scale the truncation error by ~25).

Reverse mode (what optimizers and calibration use) is checked on the aggregated dense, the
DP-attention + EP MoE and the MTP designs; forward mode on the pipeline and disaggregated
designs. Reverse mode is the transpose of the same linearization, so the forward checks cover
the derivative rules of those code paths; one reverse-mode compile of a design costs 10-35 s
of CPU, which the suite's time budget does not allow for every design.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_core_cases import (
    OUTPUTS,
    PARAMETERS,
    gradient,
    log_metrics_at,
    tangent,
    to_theta,
)

EPS = 1e-4  # jax._src.public_test_util.EPS
TOL = 1e-5  # jax._src.public_test_util.default_gradient_tolerance[float64]
REVERSE = ("dense", "moe", "mtp")
FORWARD = ("pipeline", "disagg")


def _finite_difference(name: str, theta: dict, direction: dict) -> np.ndarray:
    plus = {k: theta[k] + EPS * direction[k] for k in theta}
    minus = {k: theta[k] - EPS * direction[k] for k in theta}
    return (np.asarray(log_metrics_at(name, plus))
            - np.asarray(log_metrics_at(name, minus))) / (2 * EPS)


def _normalised(direction: dict) -> dict:
    norm = np.sqrt(sum(float(jnp.sum(v**2)) for v in direction.values()))
    return {k: v / norm for k, v in direction.items()}


def _directions(name: str, theta: dict) -> list[dict]:
    """Three random directions mixing every parameter, then each parameter on its own (a
    random direction alone could hide an error in a parameter of small elasticity)."""
    rng = np.random.default_rng(sum(map(ord, name)))
    out = [_normalised({k: jnp.asarray(rng.standard_normal(np.shape(v)))
                        for k, v in theta.items()}) for _ in range(3)]
    for key in PARAMETERS:
        out.append(_normalised({k: jnp.ones_like(v) if k == key else jnp.zeros_like(v)
                                for k, v in theta.items()}))
    return out


def _theta(name: str, point: str) -> dict:
    """The case's parameters; at "power_capped" TDP (and idle power with it) is halved, so the
    TDP cap of the roofline sits in its smooth transition and TDP's gradient is not ~0."""
    theta = dict(to_theta(name))
    if point == "power_capped":
        for key in ("tdp", "idle_power"):
            theta[key] = theta[key] + np.log(0.5)
    return theta


POINTS = ("nominal", "power_capped")


def _grid(names, points=POINTS):
    """(name, point) pairs: the first case at `points` runs by default, the rest are
    marked slow (each compiles its own gradient; `.ci/run` runs them all)."""
    return [pytest.param(n, p, marks=() if n == names[0] and p in points
                         else pytest.mark.slow)
            for n in names for p in POINTS]


@pytest.mark.parametrize("name, point", _grid(REVERSE))
def test_reverse_mode_matches_finite_differences(name, point):
    theta = _theta(name, point)
    weights = jnp.asarray(np.random.default_rng(7).standard_normal(len(OUTPUTS)))
    grad = gradient(name, theta, weights)
    for key, leaf in grad.items():
        assert np.all(np.isfinite(np.asarray(leaf))), key
    for direction in _directions(name, theta):
        analytic = sum(float(jnp.sum(grad[k] * direction[k])) for k in theta)
        numeric = float(np.dot(np.asarray(weights), _finite_difference(name, theta, direction)))
        np.testing.assert_allclose(analytic, numeric, rtol=TOL, atol=TOL,
                                   err_msg=f"case {name}")


# Forward mode runs with the slow tests (20 s of compiling); by default, forward-mode
# derivatives are checked against differences through the fit's Jacobians
# (tests/test_calibrate.py).
@pytest.mark.slow
@pytest.mark.parametrize("name, point", _grid(FORWARD, points=("nominal",)))
def test_forward_mode_matches_finite_differences(name, point):
    theta = _theta(name, point)
    for direction in _directions(name, theta):
        analytic = np.asarray(tangent(name, theta, direction))
        assert np.all(np.isfinite(analytic))
        np.testing.assert_allclose(analytic, _finite_difference(name, theta, direction),
                                   rtol=TOL, atol=TOL, err_msg=f"case {name}")


def _elasticities(name: str, point: str = "nominal") -> dict:
    """d log(output) / d log(parameter), summed over a vector parameter's entries."""
    theta = _theta(name, point)
    if name in REVERSE:
        grads = [gradient(name, theta, jnp.zeros(len(OUTPUTS)).at[i].set(1.0))
                 for i in range(len(OUTPUTS))]
        return {key: np.asarray([float(jnp.sum(g[key])) for g in grads]) for key in PARAMETERS}
    return {key: np.asarray(tangent(name, theta, {k: jnp.ones_like(v) if k == key
                                                   else jnp.zeros_like(v)
                                                   for k, v in theta.items()}))
            for key in PARAMETERS}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == REVERSE[0] else
                                               pytest.mark.slow) for n in REVERSE + FORWARD])
def test_gradient_signs(name):
    """The gradients carry the physics, not only agree with finite differences."""
    d = _elasticities(name)
    tpot, ttft, throughput, power = (OUTPUTS.index(k) for k in
                                     ("tpot", "ttft", "throughput_per_chip", "power_per_chip"))
    # Decode at these batches is memory-bound: bandwidth helps, more concurrency costs.
    assert d["hbm_bandwidth"][tpot] < -0.1
    assert d["concurrency"][tpot] > 0.0
    assert d["concurrency"][throughput] > 0.1
    # Longer prompts cost TTFT; host overhead per step costs TPOT.
    assert d["input_len"][ttft] > 0.1
    assert d["step_overhead"][tpot] > 0.0
    # More peak FLOP/s never hurts, and helps prefill (TTFT).
    assert d["peak_flops"][tpot] <= 0.0
    assert d["peak_flops"][ttft] < 0.0
    # HBM traffic costs energy: power rises with the energy per byte.
    assert d["energy_per_hbm_byte"][power] > 0.0
    # Speculative decoding: a higher acceptance lowers TPOT only when drafts are made.
    if name == "mtp":
        assert d["acceptance"][tpot] < -0.05
    else:
        assert abs(d["acceptance"][tpot]) < 1e-12
    # Under a binding power cap, a higher TDP buys speed and is spent as power.
    capped = _elasticities(name, "power_capped")
    # Below the cap the smooth max still passes a gradient of about r^p to the cap term,
    # where r = (a step's dynamic power) / (TDP - idle): 0.013 at r = 0.83 with p = 24. The
    # pipeline case's compute-bound prefill steps run closest to the cap (-0.074 nominal,
    # -0.62 capped, when written), so the bound leaves room for them.
    assert abs(d["tdp"][tpot]) < 0.1
    assert capped["tdp"][tpot] < -0.1 and capped["tdp"][power] > 0.1
