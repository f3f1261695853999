"""Shared serving cases of the core-model tests, and the log-parameter map the gradient and
property tests differentiate through.

Every case is built once per process, and every test calls the same jitted functions
(`perfmodel.predict_jit`, `step_cost_jit`, `gradient`, `tangent`) with float64 array leaves,
so XLA compiles each case's structure once for the whole suite (a weakly typed or
Python-float leaf would recompile or turn static: `arr` avoids both).
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perfmodel as pm


def arr(x):
    """A strongly typed float64 array (never weak: a weak leaf would recompile)."""
    return jnp.asarray(x, dtype=jnp.float64)


@functools.cache
def case(name: str):
    """(model, chip, workload, design) of a named case.

    - dense: Llama-3.1-70B, FP8, TP8 on H200 (aggregated, chunked prefill).
    - moe: DeepSeek-R1, FP4, DP attention + EP8 on GB200.
    - mtp: the moe case with two MTP draft tokens at 70 % acceptance (same structure as moe,
      so the same compiled functions serve both).
    - pipeline: Llama-3.1-70B, FP8, TP4 x PP2 on H200.
    - disagg: DeepSeek-R1, FP4, prefill TP4/EP4 and decode TP8/EP8, both DP attention, GB200.
    """
    if name in ("dense", "pipeline"):
        chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-70b")
        layout = pm.Layout(tp=8) if name == "dense" else pm.Layout(tp=4, pp=2)
        design = pm.Design(concurrency=arr(32.0), layout=layout,
                           precision=pm.precision(chip, model, "fp8"))
        return model, chip, pm.Workload(arr(8192.0), arr(1024.0)), design
    chip, model = pm.get_chip("gb200"), pm.get_model("deepseek-r1")
    prec = pm.precision(chip, model, "fp4")
    if name == "disagg":
        layout = pm.Disaggregated(prefill=pm.Layout(tp=4, ep=4, dp_attention=True),
                                  decode=pm.Layout(tp=8, ep=8, dp_attention=True))
        design = pm.Design(concurrency=arr(64.0), layout=layout, precision=prec)
        return model, chip, pm.Workload(arr(8192.0), arr(1024.0)), design
    spec = pm.SpecDecode(draft_tokens=arr(2.0 if name == "mtp" else 0.0), acceptance=arr(0.7))
    design = pm.Design(concurrency=arr(64.0), layout=pm.Layout(tp=8, ep=8, dp_attention=True),
                       precision=prec, speculative=spec)
    if name not in ("moe", "mtp"):
        raise ValueError(f"unknown case {name!r}")
    return model, chip, pm.Workload(arr(8192.0), arr(1024.0)), design


CASES = ("dense", "moe", "mtp", "pipeline", "disagg")

#: One jitted step for the whole suite; call it with all five step arguments as float64
#: arrays so every call hits the same compiled program per case.
step_cost_jit = eqx.filter_jit(pm.step_cost)

# -- log-parameter map -----------------------------------------------------------------------
# name -> (where in (chip, design, workload), transform). Positive quantities live in log
# space, the acceptance probability in logit space (STYLE.md "Numbers").
_LOG, _LOGIT = "log", "logit"
PARAMETERS = {
    "hbm_bandwidth": (lambda a: a[0].hbm_bandwidth, _LOG),
    "peak_flops": (lambda a: a[0].peak_flops, _LOG),
    "hbm_capacity": (lambda a: a[0].hbm_capacity, _LOG),
    "tdp": (lambda a: a[0].tdp, _LOG),
    "idle_power": (lambda a: a[0].idle_power, _LOG),
    "compute_max": (lambda a: a[0].efficiency.compute_max, _LOG),
    "compute_rows_half": (lambda a: a[0].efficiency.compute_rows_half, _LOG),
    "bandwidth_max": (lambda a: a[0].efficiency.bandwidth_max, _LOG),
    "memory_latency": (lambda a: a[0].efficiency.memory_latency, _LOG),
    "kernel_overhead": (lambda a: a[0].efficiency.kernel_overhead, _LOG),
    "attention_max": (lambda a: a[0].efficiency.attention_max, _LOG),
    "scaleup_bandwidth": (lambda a: a[0].scale_up.bandwidth, _LOG),
    "scaleup_latency": (lambda a: a[0].scale_up.latency, _LOG),
    "energy_per_flop": (lambda a: a[0].energy.per_flop, _LOG),
    "energy_per_hbm_byte": (lambda a: a[0].energy.per_hbm_byte, _LOG),
    "concurrency": (lambda a: a[1].concurrency, _LOG),
    "weight_bytes": (lambda a: a[1].precision.weight_bytes, _LOG),
    "expert_bytes": (lambda a: a[1].precision.expert_bytes, _LOG),
    "kv_bytes": (lambda a: a[1].precision.kv_bytes, _LOG),
    "activation_bytes": (lambda a: a[1].precision.activation_bytes, _LOG),
    "acceptance": (lambda a: a[1].speculative.acceptance, _LOGIT),
    "step_overhead": (lambda a: a[1].runtime.step_overhead, _LOG),
    "max_batched_tokens": (lambda a: a[1].runtime.max_batched_tokens, _LOG),
    "input_len": (lambda a: a[2].input_len, _LOG),
    "output_len": (lambda a: a[2].output_len, _LOG),
}

#: Metrics differentiated (their logs: elasticities, so JAX's absolute tolerance means the
#: same on every output). The percentiles are included: a metric left out gets a zero
#: cotangent, and reverse mode would then skip (and never check) its code path.
OUTPUTS = ("tpot", "ttft", "throughput_per_chip", "power_per_chip", "p99_tpot", "p99_ttft")


def _forward(value, kind):
    return jnp.log(value) if kind == _LOG else jnp.log(value) - jnp.log1p(-value)


def _inverse(theta, kind):
    return jnp.exp(theta) if kind == _LOG else jax.nn.sigmoid(theta)


def to_theta(name: str) -> dict:
    """The case's parameters in log/logit space."""
    _, chip, workload, design = case(name)
    args = (chip, design, workload)
    return {key: _forward(where(args), kind) for key, (where, kind) in PARAMETERS.items()}


def from_theta(name: str, theta: dict):
    """(chip, design, workload) of the case with the parameters replaced by `theta`."""
    _, chip, workload, design = case(name)
    return _rebuild((chip, design, workload), theta)


def log_metrics(model, chip, design, workload, metrics_fn=pm.predict):
    # The smooth continuation past the memory limit: property tests draw designs that do
    # not fit, and their derivatives must be finite too (NaN metrics would hide them).
    m = metrics_fn(model, chip, workload, design, unfit="value")
    return jnp.stack([jnp.log(getattr(m, key)) for key in OUTPUTS])


@eqx.filter_jit
def _gradient(model, base, theta, weights):
    def f(th):
        chip, design, workload = _rebuild(base, th)
        return jnp.dot(weights, log_metrics(model, chip, design, workload))
    return jax.grad(f)(theta)


@eqx.filter_jit
def _tangent(model, base, theta, direction):
    def f(th):
        chip, design, workload = _rebuild(base, th)
        return log_metrics(model, chip, design, workload)
    return jax.jvp(f, (theta,), (direction,))[1]


def _rebuild(base, theta):
    wheres = [PARAMETERS[key][0] for key in PARAMETERS]
    values = [_inverse(theta[key], PARAMETERS[key][1]) for key in PARAMETERS]
    return eqx.tree_at(lambda a: [w(a) for w in wheres], base, values)


def gradient(name: str, theta: dict, weights) -> dict:
    """Reverse mode: the gradient of `weights . OUTPUTS` (logs) w.r.t. `theta` (a VJP, as
    `jax.test_util.check_vjp` tests it). Jitted once per case structure."""
    model, chip, workload, design = case(name)
    return _gradient(model, (chip, design, workload), theta, weights)


def tangent(name: str, theta: dict, direction: dict):
    """Forward mode: the derivative of `OUTPUTS` (logs) along `direction` (a JVP)."""
    model, chip, workload, design = case(name)
    return _tangent(model, (chip, design, workload), theta, direction)


def log_metrics_at(name: str, theta: dict):
    """`OUTPUTS` (log) at `theta` through `perfmodel.predict_jit` (compiled once per case)."""
    model = case(name)[0]
    chip, design, workload = from_theta(name, theta)
    return log_metrics(model, chip, design, workload, pm.predict_jit)


@pytest.mark.parametrize("name", CASES)
def test_cases_are_valid_deployments(name):
    """Each shared case fits in memory, is not capped by it, and yields finite metrics."""
    model, chip, workload, design = case(name)
    m = pm.predict_jit(model, chip, workload, design)
    assert bool(m.fits)
    # Away from the memory cap, so monotonicity and gradients test the intended regime.
    assert float(m.running_batch) < 0.5 * float(m.max_batch)
    for leaf in jax.tree_util.tree_leaves(m):
        assert bool(jnp.all(jnp.isfinite(leaf)))


def test_theta_round_trip():
    """from_theta(to_theta(case)) rebuilds the case's leaves exactly (up to exp/log)."""
    theta = to_theta("mtp")
    chip, design, workload = from_theta("mtp", theta)
    _, chip0, workload0, design0 = case("mtp")
    for leaf, leaf0 in zip(jax.tree_util.tree_leaves((chip, design, workload)),
                           jax.tree_util.tree_leaves((chip0, design0, workload0)), strict=True):
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(leaf0), rtol=1e-13)
