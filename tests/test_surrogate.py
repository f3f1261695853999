"""The serving surrogate (`perfmodel.surrogate`): limits, monotonicity, gradients, and
agreement with the simulator."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perfmodel as pm
from perfmodel import simulate as sim
from perfmodel import surrogate
from perfmodel.fitted import runtime_for
from perfmodel.power import apply_power_cap, dynamic_energy

CHIP, MODEL = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
DESIGN = pm.Design(concurrency=1.0, layout=pm.Layout(tp=1),
                   precision=pm.precision(CHIP, MODEL),
                   runtime=runtime_for("vllm", CHIP.family))
ISL, OSL = 1024, 128
POLICY = sim.Policy(max_num_seqs=64, max_num_batched_tokens=2048)


def _load(rate, cv=1.0):
    return surrogate.Load(rate=rate, input_len=ISL, output_len=OSL, cv=cv)


@eqx.filter_jit
def _compiled(policy, rate, cv, max_ttft, max_tpot):
    return surrogate.estimate(MODEL, CHIP, DESIGN, policy, _load(rate, cv),
                              max_ttft=max_ttft, max_tpot=max_tpot)


def _estimate(policy, rate, cv=1.0, max_ttft=jnp.inf, max_tpot=jnp.inf):
    # Arrays, not Python floats: filter_jit would compile once per float value.
    return _compiled(policy, *(jnp.asarray(x, dtype=float) for x in
                               (rate, cv, max_ttft, max_tpot)))


@pytest.fixture(scope="module")
def capacity():
    return float(surrogate.capacity(MODEL, CHIP, DESIGN, POLICY, _load(1.0)))


#: Loads (fractions of capacity) of `sweep`: below capacity, then past it.
FRACTIONS = jnp.asarray([0.05, 0.2, 0.5, 0.8, 0.95, 1.1, 2.0])


@pytest.fixture(scope="module")
def sweep(capacity):
    # One compiled function, called per load (a vmap would compile another).
    estimates = [_estimate(POLICY, f * capacity) for f in FRACTIONS]
    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *estimates)


@pytest.mark.slow
def test_low_load_ttft_is_the_prefill_of_one_request():
    # Requests far apart: the TTFT is one prefill step of the whole prompt, costed by the
    # core model as the simulator costs it; the simulator agrees on the same requests.
    cost = pm.step_cost(MODEL, CHIP, DESIGN, DESIGN.layout, decode_seqs=0.0,
                        decode_context=ISL + OSL / 2.0, prefill_tokens=float(ISL),
                        prefill_context=ISL / 2.0, prefill_seqs=1.0, hard=True)
    prefill = float(apply_power_cap(CHIP, cost.time, dynamic_energy(CHIP, cost),
                                    hard=True).time)
    e = _estimate(POLICY, 1e-4)
    np.testing.assert_allclose(e.ttft.mean, prefill, rtol=1e-3)
    np.testing.assert_allclose(e.ttft.p99, prefill, rtol=1e-2)
    requests = sim.trace(100.0 * jnp.arange(3), jnp.full(3, ISL), jnp.full(3, 4))
    result = sim.simulate(MODEL, CHIP, DESIGN, POLICY, requests, max_steps=100)
    np.testing.assert_allclose(e.ttft.p50, np.asarray(result.ttft), rtol=0.02)


@pytest.mark.slow
def test_percentiles_are_ordered_and_finite(sweep):
    for stats in (sweep.ttft, sweep.tpot):
        q = np.stack([stats.p50, stats.p90, stats.p95, stats.p99])
        assert np.all(np.isfinite(q)) and np.all(q[0] > 0), q
        assert np.all(np.diff(q, axis=0) >= -1e-12), q
    assert np.all(np.asarray(sweep.ttft.p99) >= np.asarray(sweep.ttft.mean) * 0.999)


@pytest.mark.slow
def test_waits_grow_with_load_and_are_flagged_past_capacity(sweep, capacity):
    mean, p99 = np.asarray(sweep.ttft.mean), np.asarray(sweep.ttft.p99)
    assert np.all(np.diff(mean) > 0) and np.all(np.diff(p99) > 0), (mean, p99)
    np.testing.assert_array_equal(np.asarray(sweep.unstable), [False] * 5 + [True] * 2)
    # Past capacity the wait is held finite and large (1 - rho floored at MIN_GAP).
    assert np.all(np.isfinite(mean)) and mean[-1] > 100 * mean[0]
    load = np.asarray(sweep.load)
    assert np.all(np.diff(load) > 0) and load[4] < 1.0 < load[5], load
    assert bool(jnp.all(sweep.converged))
    # Burstier arrivals wait longer at the same rate.
    bursty = _estimate(POLICY, FRACTIONS[3] * capacity, 2.0)
    steady = _estimate(POLICY, FRACTIONS[3] * capacity, 1.0)
    assert float(bursty.ttft.p99) > float(steady.ttft.p99)


def test_capacity_is_where_the_load_reaches_one(capacity):
    e = _estimate(POLICY, capacity)
    np.testing.assert_allclose(e.load, 1.0, rtol=1e-4)
    smaller = float(surrogate.capacity(MODEL, CHIP, DESIGN, eqx.tree_at(
        lambda p: p.max_num_seqs, POLICY, sim.Policy(max_num_seqs=16).max_num_seqs), _load(1.0)))
    assert smaller < capacity


@pytest.mark.slow   # the eager fixed point dispatches op by op (15 s)
def test_jit_and_eager_agree(capacity):
    eager = surrogate.estimate(MODEL, CHIP, DESIGN, POLICY, _load(0.7 * capacity),
                               max_ttft=0.5, max_tpot=0.02)
    jitted = _estimate(POLICY, 0.7 * capacity, 1.0, 0.5, 0.02)
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9)
    assert 0.0 < float(eager.goodput) <= float(eager.throughput) * (1 + 1e-12)


@pytest.mark.slow   # compiles for 10 s or more (CI's slow stage runs it)
def test_gradients_match_central_differences(capacity):
    # Log-space parameters: rate, max_num_seqs, max_num_batched_tokens,
    # long_prefill_token_threshold, kv_blocks.
    def outputs(theta):
        x = jnp.exp(theta)
        policy = sim.Policy(max_num_seqs=x[1], max_num_batched_tokens=x[2],
                            long_prefill_token_threshold=x[3], kv_blocks=x[4])
        e = surrogate.estimate(MODEL, CHIP, DESIGN, policy, _load(x[0]), max_ttft=0.3,
                               max_tpot=0.02)
        return jnp.stack([e.ttft.p99, e.tpot.p99, e.ttft.mean, e.goodput])

    # One compiled function: values and the derivative along v (forward mode).
    both = jax.jit(lambda t, v: jax.jvp(outputs, (t,), (v,)))
    for fraction, key in ((0.4, 0), (0.8, 1)):
        theta = jnp.log(jnp.asarray([fraction * capacity, 48.0, 1536.0, 700.0, 20000.0]))
        v = jax.random.normal(jax.random.PRNGKey(key), (5,))
        v = v / jnp.linalg.norm(v)
        h = 1e-5
        fd = (both(theta + h * v, v)[0] - both(theta - h * v, v)[0]) / (2 * h)
        jv = both(theta, v)[1]
        assert np.all(np.isfinite(jv))
        # The fixed point is solved to 1e-12 relative, so differences of 1e-5 steps carry
        # about 1e-7 of noise; 1e-5 relative is JAX's float64 derivative tolerance.
        np.testing.assert_allclose(jv, fd, rtol=1e-5, atol=1e-9)
        # More load: longer p99 TTFT and p99 TPOT.
        along_rate = both(theta, jnp.eye(5)[0])[1]
        assert float(along_rate[0]) > 0 and float(along_rate[1]) > 0, along_rate


def test_invalid_input_raises():
    with pytest.raises(ValueError, match="Load.cv"):
        surrogate.Load(rate=1.0, input_len=10, output_len=10, cv=-1.0)
    with pytest.raises(ValueError, match="Load.input_len"):
        surrogate.Load(rate=1.0, input_len=0.5, output_len=10)
    with pytest.raises(ValueError, match="policy must be a perfmodel Policy"):
        surrogate.estimate(MODEL, CHIP, DESIGN, None, _load(1.0))
    three = eqx.tree_at(lambda d: d.layout, DESIGN, pm.Layout(tp=3))   # 32 heads
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        surrogate.estimate(MODEL, CHIP, three, sim.Policy(), _load(1.0))


@pytest.mark.slow
def test_agrees_with_the_simulator_at_moderate_load(capacity):
    # 600 Poisson requests at 60 % of capacity (64 seats). Tolerances from the check
    # (calibration/surrogate_check.py): its worst p99 errors in the 50-70 % band.
    rate = 0.6 * capacity
    requests = sim.poisson(jax.random.PRNGKey(7), rate, 600, ISL, OSL)
    result = sim.simulate_jit(MODEL, CHIP, DESIGN, POLICY, requests, max_steps=30_000,
                              window=192)
    s = sim.summarize(result)
    e = _estimate(POLICY, rate)
    assert int(s.unfinished) == 0 and not bool(result.window_overflow)
    np.testing.assert_allclose(e.ttft.p99, s.ttft.p99, rtol=0.3)
    np.testing.assert_allclose(e.tpot.p99, s.tpot.p99, rtol=0.2)
    np.testing.assert_allclose(e.tpot.p50, s.tpot.p50, rtol=0.1)


@pytest.mark.slow   # compiles the surrogate
def test_seats_count_the_output_that_admission_reserves():
    """A running request holds I + O/2 tokens of KV on average, and an engine that
    reserves a share r of each request's output at admission (SGLang's ratio, 1 for
    TensorRT-LLM's GUARANTEED_NO_EVICT) holds r O/2 more: the seats are the engine's
    blocks over that (max_num_seqs far above them)."""
    for reserve in (0.0, 0.7, 1.0):
        policy = sim.Policy(max_num_seqs=10_000, max_num_batched_tokens=2048,
                            kv_blocks=4001.0, block_size=16, output_reserve=reserve)
        e = _estimate(policy, 0.01)
        want = 4000 * 16 / (ISL + (1 + reserve) * OSL / 2 + 8)
        np.testing.assert_allclose(float(e.seats), want, rtol=1e-6)
