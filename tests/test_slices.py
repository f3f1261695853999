"""Slice mapping: where weights and KV live across a chip's slices matters where it should
(a slow slice fabric) and nowhere else (a single-slice GPU)."""

import itertools

import equinox as eqx
import numpy as np
import pytest

import perfmodel as pm
from perfmodel import search as ps
from perfmodel.design import PLACEMENTS, Layout, mapping


def _metrics(model, chip, workload, design):
    return pm.predict_jit(model, chip, workload, design, hard=True)


def test_single_slice_gpu_mapping_has_no_effect():
    chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-8b")
    assert float(chip.num_slices) == 1.0
    workload = pm.Workload(1024, 256)
    values = []
    for weights, kv in itertools.product(PLACEMENTS, PLACEMENTS):
        d = pm.Design(concurrency=32.0, layout=Layout(tp=1),
                      precision=pm.precision(chip, model, "fp8"), mapping=mapping(weights, kv))
        m = _metrics(model, chip, workload, d)
        values.append((float(m.throughput_per_chip), float(m.tpot), float(m.max_batch)))
    np.testing.assert_allclose(np.array(values), np.array(values[:1]).repeat(9, 0), rtol=1e-12)


def test_gpu_default_is_interleaved_and_unchanged():
    """GPUs interleave (the hardware's choice): the default mapping is interleaved and the
    optimizer's default space on a GPU offers nothing else."""
    chip, model = pm.get_chip("gb300"), pm.get_model("deepseek-r1")
    workload = pm.Workload(8192, 1024)
    layout = Layout(tp=8, ep=8, dp_attention=True)
    prec = pm.precision(chip, model, "fp4")
    default = _metrics(model, chip, workload, pm.Design(64.0, layout, prec))
    explicit = _metrics(model, chip, workload,
                        pm.Design(64.0, layout, prec, mapping=mapping("interleaved")))
    assert float(default.tpot) == pytest.approx(float(explicit.tpot), rel=1e-12)
    space = ps.design_space(model, chip, 8, layouts=(layout,))
    assert set(space.placements.values()) == {("interleaved",)}


def test_partitioned_kv_idles_slices_at_low_batch():
    """The KV of a request lives on one slice: with fewer sequences than slices, partitioned
    KV leaves slices idle and decode attention slows down (fast fabric: interleaving wins)."""
    # The preset Jalapeno is power-capped at this point (its 700 W TDP stretches the step):
    # lift the cap so the roofline itself is compared.
    chip = eqx.tree_at(lambda c: c.tdp, pm.get_chip("jalapeno"), 1e5)
    model = pm.get_model("llama-3.1-70b")
    workload = pm.Workload(8192, 256)
    prec = pm.precision(chip, model, "fp8")
    tpot = {}
    for kv in ("interleaved", "partitioned"):
        d = pm.Design(2.0, Layout(tp=1), prec, mapping=mapping("interleaved", kv))
        tpot[kv] = float(_metrics(model, chip, workload, d).tpot)
    assert tpot["partitioned"] > tpot["interleaved"]


@pytest.mark.slow
def test_slow_fabric_moves_state_to_local_slices():
    """With a slow slice fabric (1/16 of HBM bandwidth), the optimizer moves KV and weights off
    the interleaved placement to local ones (partitioned, or for the KV cache replicated where
    the batch is small enough for a copy per slice; replicated weights do not fit
    DeepSeek-R1) and gains throughput over the best all-interleaved design."""
    base = pm.get_chip("jalapeno")
    slow = eqx.tree_at(lambda c: c.slice_bandwidth, base, base.hbm_bandwidth / 16)
    # Lift the 700 W cap (as above): under the fitted energy figures the preset is
    # power-bound, and a power-bound step hides where its bytes come from.
    slow = eqx.tree_at(lambda c: c.tdp, slow, 1e5)
    model = pm.get_model("deepseek-r1")
    layout = Layout(tp=8, ep=8, dp_attention=True)
    workload = pm.Workload(8192, 1024)
    common = dict(layouts=(layout,), concurrency=[2 ** (k / 2) for k in range(0, 23)],
                  formats={"weights": ("fp8",), "experts": ("fp8", "fp4"), "kv": ("fp8",)},
                  power_caps=(0.7, 0.85, 1.0))
    tgt = ps.targets(max_tpot_ms=25)
    free = ps.design_space(model, slow, 8, **common)
    result = ps.optimize(model, slow, workload, free, tgt, steps=120, blocks=4)
    assert result.feasible
    placed = result.design["placements"]
    # Both local KV placements read without crossing the fabric (since the MLA kernel
    # launches refit of 2026-12-07 the search keeps a copy per slice at this batch).
    assert placed["kv"] in ("partitioned", "replicated"), placed
    # Every weight class reads locally; the expert weights (most of the bytes) cannot be
    # replicated on 8 slices, so they are partitioned.
    assert placed["experts"] == "partitioned"
    assert "interleaved" not in (placed["attention"], placed["dense"]), placed
    interleaved = ps.design_space(model, slow, 8, placements={"weights": ("interleaved",),
                                                              "kv": ("interleaved",)}, **common)
    best_interleaved = ps.exhaustive(model, slow, workload, interleaved, tgt)
    assert result.objective_value > 1.2 * best_interleaved.objective_value
