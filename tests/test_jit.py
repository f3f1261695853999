"""Every public function of the core runs jitted (`eqx.filter_jit`) and eagerly, and they agree.

Float64 throughout; XLA may fuse and reorder operations under jit, so agreement is to 1e-10
relative (not bit-exact), far below any modelling tolerance yet far above rounding noise.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_core_cases import CASES, arr, case, step_cost_jit

import perfmodel as pm
from perfmodel.kvcache import kv_growth, weight_bytes_per_chip
from perfmodel.power import apply_power_cap, dynamic_energy
from perfmodel.roofline import operator_time
from perfmodel.serving import COLUMNS

RTOL = 1e-10


def _assert_trees_close(a, b):
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=0)


@pytest.mark.parametrize("name", [c for c in CASES if c != "mtp"])
def test_predict_jit_matches_eager(name):
    model, chip, workload, design = case(name)
    eager = pm.predict(model, chip, workload, design)
    jitted = pm.predict_jit(model, chip, workload, design)
    _assert_trees_close(eager, jitted)
    # Every field has one column name (the vocabulary of rows and CSV files).
    assert set(eager.to_row()) == set(COLUMNS.values())
    assert {f.name for f in dataclasses.fields(pm.Metrics)} == set(COLUMNS)
    assert set(eager.to_row("pred_")) == {"pred_" + k for k in COLUMNS.values()}


@pytest.mark.slow
def test_predict_open_loop_jit_matches_eager():
    """Open-loop arrivals run a fixed-point loop (lax.fori_loop) inside predict."""
    model, chip, _, design = case("dense")
    workload = pm.Workload(arr(2048.0), arr(256.0), request_rate=arr(5.0))
    eager = pm.predict(model, chip, workload, design)
    jitted = pm.predict_jit(model, chip, workload, design)
    _assert_trees_close(eager, jitted)
    # Little's law: in-flight requests = rate x E2E at the fixed point.
    np.testing.assert_allclose(float(eager.concurrency), 5.0 * float(eager.e2e), rtol=1e-3)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_step_cost_and_operators_jit_match_eager(name):
    model, chip, _, design = case(name)
    layout = design.layout
    args = (arr(48.0), arr(3000.0), arr(512.0), arr(1500.0), arr(2.0))
    ops_jit = eqx.filter_jit(pm.operators)
    _assert_trees_close(pm.step_cost(model, chip, design, layout, *args),
                        step_cost_jit(model, chip, design, layout, *args))
    _assert_trees_close(pm.operators(model, chip, design, layout, *args),
                        ops_jit(model, chip, design, layout, *args))
    op = pm.operators(model, chip, design, layout, *args)[0]
    _assert_trees_close(operator_time(op, chip, design, arr(6.0)),
                        eqx.filter_jit(operator_time)(op, chip, design, arr(6.0)))


def test_step_cost_does_not_retrace_on_new_values():
    """Numbers are array leaves: new values reuse the compiled step (STYLE.md: guard hot
    paths with eqx.debug.assert_max_traces)."""
    model, chip, _, design = case("dense")
    step = eqx.filter_jit(eqx.debug.assert_max_traces(pm.step_cost, max_traces=1))
    for scale in (1.0, 1.7, 3.1):
        faster = eqx.tree_at(lambda c: c.hbm_bandwidth, chip, arr(scale * 4.8e12))
        busier = eqx.tree_at(lambda d: d.concurrency, design, arr(scale * 10.0))
        step(model, faster, busier, design.layout, arr(scale * 8.0), arr(scale * 1000.0))
    # The guard bites: a new static structure (another layout) must retrace, and does.
    with pytest.raises(RuntimeError, match="traced 1 times"):
        step(model, chip, design, pm.Layout(tp=4), arr(8.0), arr(1000.0))


def test_kv_and_memory_functions_jit_match_eager():
    model = pm.get_model("gpt-oss-120b")   # sliding-window layers exercise the min()
    chip = pm.get_chip("b200")
    prec = pm.precision(chip, model, "fp4")
    layout = pm.Layout(tp=2, ep=2)
    context = arr([64.0, 128.0, 4096.0, 131072.0])
    for fn, args in [
        (pm.kv_bytes_per_token_layer, (model, prec.kv_bytes)),
        (pm.kv_bytes_per_request, (model, context, prec.kv_bytes)),
        (pm.max_batch, (model, layout, prec, chip.hbm_capacity, context)),
        (weight_bytes_per_chip, (model, layout, prec, pm.mapping(weights="replicated"),
                                 arr(2.0))),
        (kv_growth, (model, arr(1024.0), arr(512.0), prec.kv_bytes)),
        (pm.expected_experts_touched, (arr([0.0, 1.0, 7.5, 4096.0]), 128, 4)),
    ]:
        _assert_trees_close(fn(*args), eqx.filter_jit(fn)(*args))


def test_interconnect_jit_matches_eager():
    message = arr([0.0, 1e3, 1e6, 1e9])
    up = pm.Switch(bandwidth=900e9, latency=1e-6, base_latency=6e-6)
    out = pm.Switch(bandwidth=50e9, latency=10e-6)
    tiers = [up, pm.Ring(bandwidth=100e9, latency=2e-6),
             pm.Torus(bandwidth=400e9, latency=1e-6, dims=(4, 4, 4))]
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        for tier in tiers:
            _assert_trees_close(tier.time(kind, message, 16),
                                eqx.filter_jit(tier.time)(kind, message, 16))
        for n in (8, 72):
            _assert_trees_close(pm.collective_time(kind, message, n, up, out, 8),
                                eqx.filter_jit(pm.collective_time)(kind, message, n, up, out, 8))


def test_smooth_and_power_jit_match_eager():
    x, y = arr([0.0, 1.0, 2.0, 5.0]), arr([0.0, 1.5, 2.0, 0.5])
    for fn in (pm.smooth_max, pm.smooth_min):
        if fn is pm.smooth_min:
            x, y = x + 1.0, y + 1.0
        _assert_trees_close(fn(x, y), jax.jit(fn)(x, y))
        _assert_trees_close(fn(x, y, sharpness=arr(8.0)),
                            jax.jit(fn)(x, y, sharpness=arr(8.0)))
    model, chip, _, design = case("dense")
    cost = pm.step_cost(model, chip, design, design.layout, arr(32.0), arr(8000.0))
    energy = dynamic_energy(chip, cost)
    _assert_trees_close(apply_power_cap(chip, cost.time, energy),
                        eqx.filter_jit(apply_power_cap)(chip, cost.time, energy))
    _assert_trees_close(apply_power_cap(chip, cost.time, 1e3 * energy, hard=True),
                        eqx.filter_jit(apply_power_cap)(chip, cost.time, 1e3 * energy,
                                                        hard=True))


def test_predict_broadcasts_over_a_sweep():
    """A vector of concurrencies runs in one call and matches the scalar calls."""
    model, chip, workload, design = case("dense")
    sweep = eqx.tree_at(lambda d: d.concurrency, design, arr([4.0, 64.0]))
    both = pm.predict(model, chip, workload, sweep)
    for i, c in enumerate((4.0, 64.0)):
        one = pm.predict_jit(model, chip, workload,
                             eqx.tree_at(lambda d: d.concurrency, design, arr(c)))
        np.testing.assert_allclose(float(both.tpot[i]), float(one.tpot), rtol=RTOL)
        np.testing.assert_allclose(float(both.throughput_per_chip[i]),
                                   float(one.throughput_per_chip), rtol=RTOL)
    assert jnp.shape(both.ttft) == (2,)


@pytest.mark.slow   # 20 s of compilation; test_predict_open_loop_jit_matches_eager runs by default
def test_open_loop_flags_saturation_and_differentiates():
    """Below capacity the open-loop point is a steady state (Little's law holds, `steady`);
    past it there is no fixed point: `steady` is False and the queue is held at
    `SATURATED_QUEUE_S` of arrivals instead of a silent, unconverged number. The gradient
    through the fixed point matches a float64 central difference."""
    from perfmodel.serving import SATURATED_QUEUE_S
    model, chip, _, design = case("dense")
    rates = arr([1.0, 5.0, 1e4])
    workload = pm.Workload(arr(2048.0), arr(256.0), request_rate=rates)
    many = eqx.tree_at(lambda d: d.concurrency, design, jnp.ones(3))
    m = pm.predict(model, chip, workload, many)
    np.testing.assert_array_equal(np.asarray(m.steady), [True, True, False])
    np.testing.assert_allclose(np.asarray(m.concurrency)[:2],
                               np.asarray(rates[:2] * m.e2e[:2]), rtol=1e-5)
    assert float(m.concurrency[2]) == pytest.approx(1e4 * SATURATED_QUEUE_S)
    assert bool(pm.predict(model, chip, pm.Workload(arr(2048.0), arr(256.0)), design).steady)

    def e2e(rate):
        return pm.predict(model, chip, pm.Workload(arr(2048.0), arr(256.0),
                                                   request_rate=rate), design).e2e

    h = 1e-4
    numeric = (float(e2e(arr(5.0 + h))) - float(e2e(arr(5.0 - h)))) / (2 * h)
    np.testing.assert_allclose(float(jax.grad(e2e)(arr(5.0))), numeric, rtol=1e-4)
