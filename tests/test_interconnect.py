"""Collectives against the alpha-beta formulas of the ring algorithms.

Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005), with alpha the per-step latency and B the per-chip bandwidth:
    all-reduce      2 (n-1)/n M/B + 2 (n-1) alpha
    all-gather      (n-1)/n M/B + (n-1) alpha    (reduce-scatter and all-to-all alike)
    point-to-point  M/B + alpha
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import perfmodel as pm

ALPHA, BANDWIDTH, BASE = 2e-6, 100e9, 5e-6


def alpha_beta(kind, message, n, bandwidth=BANDWIDTH, alpha=ALPHA):
    if kind == "p2p":
        return message / bandwidth + alpha
    if n == 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * message / bandwidth + 2 * (n - 1) * alpha
    return (n - 1) / n * message / bandwidth + (n - 1) * alpha


TIERS = {
    "switch": pm.Switch(bandwidth=BANDWIDTH, latency=ALPHA, efficiency=1.0),
    "ring": pm.Ring(bandwidth=BANDWIDTH, latency=ALPHA, efficiency=1.0),
}


@pytest.mark.parametrize("tier", ["switch", "ring"])
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "p2p"])
@pytest.mark.parametrize("n", [1, 2, 8, 72])
def test_ring_collectives_match_alpha_beta(tier, kind, n):
    message = 64e6
    got = float(TIERS[tier].time(kind, message, n))
    np.testing.assert_allclose(got, alpha_beta(kind, message, n), rtol=1e-12)


def test_ring_all_reduce_worked_numbers():
    # 8 chips, 1 GB each, 100 GB/s, 2 us: 2 * 7/8 * 10 ms + 14 * 2 us = 17.528 ms.
    t = float(TIERS["ring"].time("all_reduce", 1e9, 8))
    np.testing.assert_allclose(t, 17.528e-3, rtol=1e-12)


def test_base_latency_and_efficiency():
    """Every collective pays the fixed base latency; efficiency scales the bandwidth."""
    link = pm.Switch(bandwidth=BANDWIDTH, latency=ALPHA, efficiency=0.8, base_latency=BASE)
    got = float(link.time("all_reduce", 8e6, 4))
    want = BASE + alpha_beta("all_reduce", 8e6, 4, bandwidth=0.8 * BANDWIDTH)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert float(link.time("all_reduce", 8e6, 1)) == 0.0   # one chip: no collective at all


def test_ring_all_to_all_pays_the_hops():
    """On a ring an all-to-all message crosses n/4 links on average (bidirectional)."""
    n, message = 16, 32e6
    got = float(TIERS["ring"].time("all_to_all", message, n))
    want = (n - 1) / n * message * (n / 4) / BANDWIDTH + (n - 1) * ALPHA
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # A switch has no hops to pay.
    np.testing.assert_allclose(float(TIERS["switch"].time("all_to_all", message, n)),
                               alpha_beta("all_to_all", message, n), rtol=1e-12)


def test_torus_uses_the_links_of_the_axes_it_spans():
    """A 1-D torus is a ring; a group on one axis of a 2-D torus gets half the links."""
    one_d = pm.Torus(bandwidth=BANDWIDTH, latency=ALPHA, efficiency=1.0, dims=(8,))
    np.testing.assert_allclose(float(one_d.time("all_reduce", 1e9, 8)),
                               alpha_beta("all_reduce", 1e9, 8), rtol=1e-12)
    two_d = pm.Torus(bandwidth=BANDWIDTH, latency=ALPHA, efficiency=1.0, dims=(4, 4))
    np.testing.assert_allclose(float(two_d.time("all_reduce", 1e9, 4)),
                               alpha_beta("all_reduce", 1e9, 4, bandwidth=BANDWIDTH / 2),
                               rtol=1e-12)
    # Spanning both axes: full bandwidth, latency steps add over the axes (3 + 3 per phase).
    want = 2 * 15 / 16 * 1e9 / BANDWIDTH + 2 * (3 + 3) * ALPHA
    np.testing.assert_allclose(float(two_d.time("all_reduce", 1e9, 16)), want, rtol=1e-12)


def test_hierarchical_all_reduce():
    """Past the scale-up domain: reduce-scatter inside, all-reduce of the shards across
    domains, all-gather inside (NCCL's tree/ring hierarchy, alpha-beta per tier)."""
    up = pm.Switch(bandwidth=900e9, latency=1e-6, efficiency=1.0)
    out = pm.Switch(bandwidth=50e9, latency=10e-6, efficiency=1.0)
    message, n, domain = 256e6, 32, 8
    outer = n // domain
    want = (2 * ((domain - 1) / domain * message / 900e9 + (domain - 1) * 1e-6)
            + alpha_beta("all_reduce", message / domain, outer, 50e9, 10e-6))
    got = float(pm.collective_time("all_reduce", message, n, up, out, domain))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # Inside the domain only the fast tier is used.
    np.testing.assert_allclose(float(pm.collective_time("all_reduce", message, 8, up, out, 8)),
                               alpha_beta("all_reduce", message, 8, 900e9, 1e-6), rtol=1e-12)
    # Point-to-point between domains rides the scale-out tier.
    np.testing.assert_allclose(float(pm.collective_time("p2p", message, 16, up, out, 8)),
                               message / 50e9 + 10e-6, rtol=1e-12)


@given(message=st.floats(1.0, 1e10), extra=st.floats(1.0, 1e9),
       n=st.integers(2, 512), faster=st.floats(1.0, 100.0),
       kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                             "p2p"]))
def test_collective_time_monotone(message, extra, n, faster, kind):
    """More bytes never take less time, more bandwidth never takes more."""
    up = pm.Switch(bandwidth=450e9, latency=1e-6, base_latency=5e-6)
    out = pm.Switch(bandwidth=50e9, latency=10e-6, base_latency=5e-6)
    quick = pm.Switch(bandwidth=450e9 * faster, latency=1e-6, base_latency=5e-6)
    base = float(pm.collective_time(kind, message, n, up, out, 8))
    assert float(pm.collective_time(kind, message + extra, n, up, out, 8)) >= base
    assert float(pm.collective_time(kind, message, n, quick, out, 8)) <= base * (1 + 1e-12)
    assert np.isfinite(base) and base > 0


@pytest.mark.parametrize("kind, n", [("broadcast", 8), ("all_reduce", 0),
                                     ("all_reduce", 2.5)])
def test_invalid_collective_raises(kind, n):
    with pytest.raises(ValueError, match="collective"):
        TIERS["switch"].time(kind, jnp.asarray(1e6), n)


ALL = pm.Switch(bandwidth=BANDWIDTH, latency=ALPHA, efficiency=1.0,
                algorithms=("ring", "tree", "one_shot", "nvls"), direct_max_group=8, hard=True)


@pytest.mark.parametrize("message, n", [(16e3, 8), (16e3, 64), (1e6, 64), (1e9, 8),
                                        (1e9, 72)])
def test_all_reduce_takes_the_cheapest_algorithm(message, n):
    """Hard mode: the exact minimum of the ring, recursive halving/doubling, one-shot (up to
    8 chips) and switch-reduction formulas of the interconnect module docstring."""
    log_n = np.ceil(np.log2(n))
    options = [2 * (n - 1) / n * message / BANDWIDTH + 2 * (n - 1) * ALPHA,
               2 * (n - 1) / n * message / BANDWIDTH + 2 * log_n * ALPHA,
               2 * ALPHA + message / BANDWIDTH]
    if n <= 8:
        options.append(ALPHA + (n - 1) * message / BANDWIDTH)
    np.testing.assert_allclose(float(ALL.time("all_reduce", message, n)), min(options),
                               rtol=1e-12)
    # Traced group sizes select the same algorithm.
    traced = ALL.time("all_reduce", message, jnp.asarray([float(n)]))
    np.testing.assert_allclose(float(traced[0]), min(options), rtol=1e-12)


def test_smooth_selection_bounds_and_ring_only_default():
    """The smooth minimum lies within n_algorithms^(1/p) below the exact one; a switch
    offering only the ring (the default, and every other collective) is the ring formula."""
    smooth = pm.Switch(bandwidth=BANDWIDTH, latency=ALPHA, efficiency=1.0,
                       algorithms=ALL.algorithms)
    for message, n in ((16e3, 8), (1e9, 8), (1e6, 64)):
        exact = float(ALL.time("all_reduce", message, n))
        got = float(smooth.time("all_reduce", message, n))
        assert exact / 4 ** (1 / 24) <= got <= exact
        np.testing.assert_allclose(float(ALL.time("all_gather", message, n)),
                                   alpha_beta("all_gather", message, n), rtol=1e-12)
    np.testing.assert_allclose(float(TIERS["switch"].time("all_reduce", 16e3, 64)),
                               alpha_beta("all_reduce", 16e3, 64), rtol=1e-12)
    with pytest.raises(ValueError, match="Switch.algorithms"):
        pm.Switch(bandwidth=BANDWIDTH, latency=ALPHA, algorithms=("tree",))
    with pytest.raises(ValueError, match="Switch.algorithms"):
        pm.Switch(bandwidth=BANDWIDTH, latency=ALPHA, algorithms=("ring", "magic"))


@pytest.mark.parametrize("model", ["deepseek-r1", "llama-3.1-70b"])
def test_wide_tensor_parallelism_lowers_batch1_latency_on_jalapeno(model):
    """On Jalapeno's low-latency 128-chip switch (one-shot and tree all-reduce), a batch-1
    decode step gets faster from tp8 to tp32: each chip reads less weight while the
    all-reduce stays a few steps long. With ring all-reduce only it gets slower (2 (n-1)
    steps per all-reduce)."""
    import dataclasses

    import equinox as eqx
    chip, m = pm.get_chip("jalapeno"), pm.get_model(model)
    ring = eqx.tree_at(lambda c: c.scale_up, chip,
                       dataclasses.replace(chip.scale_up, algorithms=("ring",)))
    workload = pm.Workload(8192, 1024)

    def tpot(c, tp):
        design = pm.Design(concurrency=1.0, layout=pm.Layout(tp=tp),
                           precision=pm.precision(c, m, "fp4"))
        return float(pm.predict(m, c, workload, design).tpot)

    assert tpot(chip, 32) < tpot(chip, 8)
    assert tpot(ring, 32) > tpot(ring, 8)


def test_gpu_fabrics_keep_the_ring_their_fit_was_made_with():
    """GPU scale-up tiers offer only the ring (their latencies are fitted with it; see the
    interconnect module docstring); Jalapeno's offers the tree and one-shot across its
    domain."""
    for name in ("h100", "b200", "gb200", "gb300", "mi355x"):
        assert pm.get_chip(name).scale_up.algorithms == ("ring",), name
    up = pm.get_chip("jalapeno").scale_up
    assert up.algorithms == ("ring", "tree", "one_shot") and up.direct_max_group == 128


def test_collectives_of_one_fabric_share_one_reciprocal():
    """An all-reduce and an all-gather over one fabric whose bandwidth varies per
    configuration divide once between them (`_time`: the fabric's seconds per byte, then
    each collective's traffic factor): a division each was a kernel of its own under a
    wide vmap."""
    import jax

    def times(bandwidth):
        link = pm.Switch(bandwidth=bandwidth, latency=ALPHA, efficiency=0.8)
        return link.time("all_reduce", 1e6, 8) + link.time("all_gather", 1e6, 8)

    kernel = jax.jit(jax.vmap(times)).lower(jnp.linspace(1e11, 9e11, 1000)).compile()
    assert kernel.as_text().count(" divide(") == 1


def test_group_sizes_known_to_fit_the_domain_never_price_scale_out():
    """Group sizes as a concrete array (an eager evaluation of many layouts): when every
    group fits in the scale-up domain the scale-out tier is not evaluated, when some do not
    both tiers are, and either way the times equal those of the traced sizes (where both
    are computed and selected) and of each size alone."""
    import jax

    class Refuses(pm.Switch):
        def time(self, kind, message_bytes, n):
            raise AssertionError("scale-out priced for groups that fit in the domain")

    up = pm.Switch(bandwidth=900e9, latency=1e-6, efficiency=1.0)
    out = pm.Switch(bandwidth=50e9, latency=10e-6, efficiency=1.0)
    refuses = Refuses(bandwidth=50e9, latency=10e-6, efficiency=1.0)
    for kind in ("all_reduce", "all_to_all", "all_gather"):
        inside = jnp.asarray([1.0, 2.0, 8.0])
        eager = pm.collective_time(kind, 1e6, inside, up, refuses, 8)
        traced = jax.jit(lambda n, kind=kind: pm.collective_time(kind, 1e6, n, up, out, 8))
        np.testing.assert_array_equal(eager, traced(inside))
        np.testing.assert_array_equal(
            eager, [float(pm.collective_time(kind, 1e6, int(n), up, out, 8)) for n in inside])
        with pytest.raises(AssertionError, match="scale-out priced"):
            pm.collective_time(kind, 1e6, jnp.asarray([2.0, 16.0]), up, refuses, 8)
        mixed = jnp.asarray([2.0, 16.0])
        np.testing.assert_array_equal(pm.collective_time(kind, 1e6, mixed, up, out, 8),
                                      traced(mixed))
