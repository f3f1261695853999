"""The Jalapeno comparison: reported claims, ratio definitions, modes and the CLI."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from perfmodel.cli import main
from perfmodel.design import Layout
from perfmodel.presets import get_chip
from perfmodel.solvers import value_and_grad_forward
from perfmodel.studies import jalapeno as cmp
from perfmodel.workload import Workload


def test_reported_ratios_match_claims_file():
    # shared/data/jalapeno_claims.csv J01/J02 (GB200), J03-J06 (GB300).
    gpt = cmp.reported_ratios("gpt-oss-120b")
    assert gpt["baseline"] == "gb200"
    assert gpt["reported_ratio_tok_s_per_kw_at_peak"] == pytest.approx(1.9)
    assert gpt["reported_ratio_e2e_latency"] == pytest.approx(1.7)
    assert cmp.reported_ratios("kimi-k2.5")["reported_ratio_e2e_latency"] == pytest.approx(3.4)
    assert cmp.reported_ratios("llama-3.1-8b") == {}


def test_layout_round_trip():
    layout = Layout.parse("2xtp4-ep4-dpa")
    assert (layout.replicas, layout.tp, layout.ep, layout.dp_attention) == (2, 4, 4, True)
    assert Layout.parse(layout.describe()) == layout
    assert Layout.parse("tp8").tp == 8
    assert Layout.parse("tp4-pp2") == Layout(tp=4, pp=2)
    for bad in ("tp8-xp2", "2xtp", "tp4-tp2", ""):
        with pytest.raises(ValueError, match="cannot read"):
            Layout.parse(bad)


@pytest.fixture(scope="module")
def predicted():
    return cmp.compare(["gpt-oss-120b"], reported=True, modes=("predicted",), chips=8,
                       grid=(1.0, 64.0, 1024.0))


def test_predicted_row_keys_and_ratio_definitions(predicted):
    (row,) = predicted
    for key in ("model", "chip", "baseline", "mode", "ratio_tok_s_per_kw_at_peak",
                "ratio_e2e_latency", "ratio_tok_s_per_kw_high_interactivity",
                "interactivity_low_concurrency", "reported_ratio_tok_s_per_kw_at_peak",
                "reported_ratio_e2e_latency"):
        assert key in row
    assert (row["chip"], row["baseline"], row["mode"]) == ("jalapeno", "gb200", "predicted")
    # Per kW of TDP: the per-chip ratio times the TDP ratio (1200 W / 700 W).
    assert row["ratio_tok_s_per_kw_at_peak"] == pytest.approx(
        row["ratio_tok_s_per_chip_at_peak"] * 1200.0 / 700.0, rel=1e-9)
    assert row["ratio_e2e_latency"] == pytest.approx(
        row["baseline_e2e_s_at_peak"] / row["e2e_s_at_peak"], rel=1e-9)
    # The low-concurrency point is the most interactive one, above the peak point's.
    assert row["interactivity_low_concurrency"] > row["interactivity_at_peak"]
    assert row["e2e_s_low_concurrency"] < row["e2e_s_at_peak"]


def test_invalid_mode_and_baselines_raise():
    with pytest.raises(ValueError, match="mode"):
        cmp.compare(["gpt-oss-120b"], modes=("guessed",))
    with pytest.raises(ValueError, match="baselines"):
        cmp.compare(["gpt-oss-120b", "deepseek-r1", "kimi-k2.5"], baselines=["gb200", "gb300"])


def test_cli_rejects_single_chip(capsys):
    assert main(["compare", "--chips", "jalapeno"]) == 2
    assert "baseline" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_acceptance_reported_json(capsys):
    """Issue acceptance and the README's main job: `perfmodel compare --reported --format
    json` on defaults covers the three reported pairs in both modes (about a minute on 2
    cores; in CI since a NaN in the inferred fit broke it unnoticed while it was marked
    slow), with finite inferred values."""
    assert main(["compare", "--reported", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["rows"]
    assert data["inputs"]["chip"] == "jalapeno" and data["inputs"]["isl"] == 8192
    pairs = {(r["model"], r["baseline"], r["mode"]) for r in rows}
    for model, baseline, _, _ in cmp.PAIRS:
        for mode in ("predicted", "inferred"):
            assert (model, baseline, mode) in pairs
    for r in rows:
        assert r["chip"] == "jalapeno"
        assert r["reported_ratio_tok_s_per_kw_at_peak"] > 1.0
        assert all(math.isfinite(r[k]) for k in ("ratio_tok_s_per_kw_at_peak",
                                                  "ratio_e2e_latency"))
        if r["mode"] == "inferred":
            assert r["inferred_result"] in (0, 1) and math.isfinite(r["inferred_hbm_capacity"])


def test_inferred_fit_gradients_finite_where_reverse_mode_was_not():
    """Regression: at this point of the inferred fit (gpt-oss-120b, one TP1 replica at its
    peak concurrency, Jalapeno with these parameters) reverse-mode gradients of HBM
    capacity and slice count were NaN under jit (eager finite), which stopped `perfmodel
    compare` on defaults. The forward-mode gradient `infer` uses is finite and agrees with
    eager reverse mode."""
    chip, workload = get_chip("jalapeno"), Workload(8192.0, 1024.0)
    target = {"model": "gpt-oss-120b", "layout": Layout.parse("tp1"), "concurrency": 647.0,
              "baseline_kw": 86_000.0, "baseline_e2e": 70.0, "reported_kw": 1.9,
              "reported_e2e": 1.7}
    logs = {"efficiency.bandwidth_max": jnp.asarray(-0.22550621297999932),
            "efficiency.compute_max": jnp.asarray(-0.71769600127154),
            "hbm_capacity": jnp.asarray(26.03940786866443),
            "num_slices": jnp.asarray(2.205795519070942)}
    loss = functools.partial(cmp.claim_loss, t=target, chip=chip, workload=workload,
                             runtime=cmp.default_runtime(chip))
    value, grads = value_and_grad_forward(loss)(logs)
    eager = jax.grad(loss)(logs)
    assert np.isfinite(float(value))
    for key in logs:
        assert np.isfinite(float(grads[key])), key
        np.testing.assert_allclose(float(grads[key]), float(eager[key]), rtol=1e-6,
                                   atol=1e-12)
