"""Disaggregated prefill/decode pools under load (`perfmodel.simulate.simulate_disaggregated`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perfmodel as pm
from perfmodel import simulate as sim
from perfmodel.fitted import runtime_for
from perfmodel.serving import kv_transfer_time

CHIP, MODEL = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")


def _design(layout):
    return pm.Design(concurrency=1.0, layout=layout, precision=pm.precision(CHIP, MODEL),
                     runtime=runtime_for("vllm", CHIP.family))


SPLIT = _design(pm.Disaggregated(prefill=pm.Layout(tp=1), decode=pm.Layout(tp=1)))
PREFILL = _design(pm.Layout(tp=1))


def _scaled(chip, factor):
    """`chip` with its networks' bandwidth times `factor` (inf: instantaneous transfers)."""
    def net(link):
        if np.isinf(factor):
            return eqx.tree_at(lambda n: (n.bandwidth, n.latency, n.base_latency), link,
                               (jnp.asarray(1e30), jnp.asarray(0.0), jnp.asarray(0.0)))
        return eqx.tree_at(lambda n: n.bandwidth, link, link.bandwidth * factor)
    return eqx.tree_at(lambda c: (c.scale_up, c.scale_out), chip,
                       (net(chip.scale_up), net(chip.scale_out)))


def _load(n=24, rate=6.0):
    key = jax.random.PRNGKey(5)
    lens = jax.random.randint(key, (n,), 256, 2048).astype(float)
    return sim.gamma(key, rate, 1.5, n, lens, 32)


@pytest.mark.slow   # compiles both pools' loops (about 30 s)
def test_instant_transfer_and_ample_decode_leave_the_prefill_pools_ttft():
    # Bursty arrivals that queue in the prefill pool; an instantaneous transfer and a
    # decode pool with seats and KV to spare: each TTFT is the prefill pool's alone, and
    # the decode pool adds only decode steps.
    chip = _scaled(CHIP, np.inf)
    requests = _load()
    policy = sim.Policy(max_num_batched_tokens=1024)
    result = sim.simulate_disaggregated(MODEL, chip, SPLIT, policy, sim.Policy(), requests,
                                        max_steps=20_000)
    alone = sim.simulate(MODEL, chip, PREFILL, policy, eqx.tree_at(
        lambda r: r.output_len, requests, jnp.ones(requests.size)), max_steps=20_000)
    assert bool(jnp.all(result.finished)) and float(jnp.max(alone.queue_delay)) > 0.01
    np.testing.assert_allclose(result.ttft, alone.ttft, rtol=1e-9)
    # 31 decode steps after the first token, none waiting: a few ms each on an H100.
    assert 0.002 < float(jnp.min(result.tpot)) and float(jnp.max(result.tpot)) < 0.02
    s = sim.summarize(result)
    assert float(s.goodput_per_chip) == pytest.approx(float(s.throughput) / 2.0)
    # Little's law on the combined records: the pools' clocks and the transfers' time.
    np.testing.assert_allclose(float(s.mean_in_system * s.duration),
                               float(jnp.sum(result.e2e)), rtol=1e-9)


@pytest.mark.slow   # compiles both pools' loops once per bandwidth (about 60 s)
def test_ttft_falls_as_transfer_bandwidth_grows():
    requests = _load()
    ttfts, transfers = [], []
    for factor in (0.001, 0.01, 0.1, 1.0):
        chip = _scaled(CHIP, factor)
        result = sim.simulate_disaggregated(MODEL, chip, SPLIT, sim.Policy(), sim.Policy(),
                                            requests, max_steps=20_000)
        s = sim.summarize(result)
        assert bool(jnp.all(result.finished))
        # Little's law, the transfers' time in the system included.
        np.testing.assert_allclose(float(s.mean_in_system * s.duration),
                                   float(jnp.sum(result.e2e)), rtol=1e-9)
        ttfts.append(float(s.ttft.mean))
        transfers.append(float(jnp.mean(kv_transfer_time(MODEL, chip, SPLIT, SPLIT.layout,
                                                         requests.input_len))))
    assert np.all(np.diff(ttfts) < 0), ttfts
    # At a thousandth of NVLink's bandwidth a 1K-token prompt's 128 MiB take about 0.3 s.
    assert transfers[0] > 0.1 and ttfts[0] - ttfts[-1] > 0.5 * (transfers[0] - transfers[-1])


def test_disaggregated_arguments_are_checked():
    requests = sim.trace(jnp.zeros(2), jnp.full(2, 64), jnp.full(2, 4))
    with pytest.raises(ValueError, match="Disaggregated"):
        sim.simulate_disaggregated(MODEL, CHIP, PREFILL, sim.Policy(), sim.Policy(), requests)
    with pytest.raises(ValueError, match="prefix_caching"):
        sim.simulate_disaggregated(MODEL, CHIP, SPLIT, sim.Policy(),
                                   sim.Policy(prefix_caching=False), requests)
    with pytest.raises(ValueError, match="closed loop"):
        sim.simulate_disaggregated(MODEL, CHIP, SPLIT, sim.Policy(), sim.Policy(),
                                   sim.closed_loop(2, 4, 64, 4))
    numbers = eqx.tree_at(lambda d: d.layout, SPLIT, SPLIT.layout.numbers())
    with pytest.raises(ValueError, match="static pools"):
        sim.simulate_disaggregated(MODEL, CHIP, numbers, sim.Policy(), sim.Policy(), requests)
