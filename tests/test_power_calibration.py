"""Power calibration: row parsing, the reduced model against the full serving model, the fit
recovering known coefficients, and the shipped fit's held-out accuracy figures."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from perfmodel import calibration_power as cp
from perfmodel import fitted as fitted_params
from perfmodel.presets import get_chip

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROWS = [  # ML.ENERGY v3 rows (calibration/power/power_measurements.csv row_id 1-4 style)
    dict(model="meta-llama/Llama-3.1-8B-Instruct", hardware="H100", num_gpus="1",
         parallelism="TP1 EP1 DP1", framework="vLLM 0.11.1", precision="bfloat16",
         workload="lm-arena-chat: LM Arena", max_batch_size=str(b), avg_batch_size=str(b),
         osl="400", avg_power_w_per_gpu="500", energy_j_per_output_token="0.2")
    for b in (8, 64, 512)]


def test_row_spec_layout_and_assumed_isl():
    row = dict(ROWS[0], model="Qwen/Qwen3-235B-A22B-Instruct-2507-FP8", num_gpus="8",
               parallelism="TP1 EP8 DP8", precision="fp8")
    spec, why = cp.row_spec(row)
    assert why == ""
    assert (spec.layout.tp, spec.layout.ep, spec.layout.dp_attention) == (8, 8, True)
    assert spec.weights == "fp8" and spec.isl_assumed and spec.isl == cp.ASSUMED_ISL[
        "lm-arena-chat"]
    spec, why = cp.row_spec(dict(ROWS[0], model="acme/unknown-1b"))
    assert spec is None and "unknown model" in why


def test_unknown_rows_are_reported_not_dropped():
    out = cp.predict_power_rows([dict(ROWS[0], model="acme/unknown-1b"), ROWS[1]])
    assert out[0]["pred_power_w_modelled"] is None
    assert out[0]["pred_status"].startswith("unknown model")
    assert out[1]["pred_status"] == "ok"
    assert 0 < out[1]["pred_power_w_modelled"] <= 700.0 + 1e-6


@pytest.fixture(scope="module")
def features():
    specs, _ = cp.specs_of(ROWS)
    return cp.features_of(specs)


def test_reduced_model_matches_full_serving_model(features):
    """The fit's reduced model reproduces `predict_power_rows` (full `serving.predict`)."""
    params = cp.PowerParams.prior()
    chips = {"hopper": get_chip("h100", calibrated=False)}
    fitted = cp.to_fitted(params, chips)
    batch = cp.make_batch(features, sorted(features))
    power, joules, tok_s = cp.reduced_predict(params, batch, hard=True)
    full = cp.predict_power_rows(ROWS, fitted)
    np.testing.assert_allclose(power, [r["pred_power_w_modelled"] for r in full], rtol=0.03)
    np.testing.assert_allclose(joules, [r["pred_j_per_output_token"] for r in full],
                               rtol=0.05)
    # Power rises with batch and stays at or under TDP.
    assert np.all(np.diff(np.asarray(power)) > 0) and np.all(np.asarray(power) <= 700 + 1e-6)


#: Pipelined MoE rows of the ML.ENERGY v2 leaderboard kind (Mixtral-8x22B, 16 A100s).
PIPELINED = [dict(model="mistralai/Mixtral-8x22B-Instruct-v0.1", hardware="A100-SXM4-40GB",
                  num_gpus="16", parallelism="TP8 PP2",
                  framework="vLLM (version not recorded in data; v2 benchmark era 2024)",
                  precision="bfloat16", workload="chat: ShareGPT", max_batch_size=str(b),
                  avg_batch_size=str(b), osl="300", avg_power_w_per_gpu="200",
                  energy_j_per_output_token="1.0") for b in (64, 512)]


def test_reduced_model_follows_engine_terms_through_the_full_model():
    """Expert-kernel efficiency, kernel efficiency, pipeline overlap and active power: the
    reduced model's linearization (expert time), scaling (busy time) and interpolation
    (micro-batches in flight) agree with the full serving model, and each term moves the
    prediction the physical way."""
    specs, skipped = cp.specs_of(PIPELINED)
    assert not skipped and specs[0].layout.pp == 2 and specs[0].framework == "vllm-2024"
    feats = cp.features_of(specs)
    batch = cp.make_batch(feats, sorted(feats))
    chips = {"ampere": get_chip("a100", calibrated=False)}
    prior = cp.PowerParams.prior()
    k = cp.RUNTIMES.index("vllm-2024")
    outs, powers = [], []
    ampere = cp.FAMILIES.index("ampere")
    for eff, overlap, kernel in ((0.9, 0.9, 0.9), (0.4, 0.9, 0.9), (0.9, 0.1, 0.9),
                                 (0.9, 0.9, 0.5)):
        logits = prior.logit_engine.at[k].set(jnp.log(jnp.asarray([eff, overlap])
                                                      / (1 - jnp.asarray([eff, overlap]))))
        kernels = prior.logit_kernel.at[k, ampere].set(jnp.log(kernel / (1 - kernel)))
        params = type(prior)(**{**prior.__dict__, "logit_engine": logits,
                                "logit_kernel": kernels})
        power, joules, tok_s = cp.reduced_predict(params, batch, hard=True)
        full = cp.predict_power_rows(PIPELINED, cp.to_fitted(params, chips))
        assert full[0]["pred_status"] == "ok"
        np.testing.assert_allclose(tok_s, [r["pred_output_tput_per_chip"] for r in full],
                                   rtol=0.06)
        np.testing.assert_allclose(power, [r["pred_power_w_modelled"] for r in full],
                                   rtol=0.06)
        np.testing.assert_allclose(joules, [r["pred_j_per_output_token"]
                                            for r in full], rtol=0.06)
        outs.append(np.asarray(tok_s))
        powers.append(np.asarray(power))
    # Slower expert kernels cost throughput; so does less pipeline overlap, but only at a
    # large batch: at 64 sequences the stages re-read their weights per micro-batch, and
    # splitting the batch buys nothing.
    assert np.all(outs[1] < 0.9 * outs[0])
    assert outs[2][1] < 0.8 * outs[0][1] and outs[2][0] == pytest.approx(outs[0][0], rel=0.1)
    # Slower kernels: less throughput, and the same work spread over more time draws less.
    assert np.all(outs[3] < 0.8 * outs[0]) and np.all(powers[3] < powers[0])


def test_fit_recovers_known_parameters(features):
    """Synthetic measurements from known parameters are fitted back (result code 0/1)."""
    truth = cp.PowerParams.prior()
    truth = type(truth)(**{**truth.__dict__,
                           "log_fraction": truth.log_fraction
                           + jnp.asarray([0.3, -0.2, 0.0, 0.5]),
                           "logit_idle": truth.logit_idle + 0.4,
                           "log_overheads": truth.log_overheads + 0.5})
    batch = cp.make_batch(features, sorted(features))
    power, joules, _ = cp.reduced_predict(truth, batch, hard=True)
    batch = type(batch)(**{**batch.__dict__, "power": power, "joules": joules})
    fit = cp.fit_power(batch, steps=3000, learning_rate=0.05)
    assert fit.result in (0, 1)
    p2, j2, _ = cp.reduced_predict(fit.params, batch, hard=True)
    np.testing.assert_allclose(p2, power, rtol=0.03)
    np.testing.assert_allclose(j2, joules, rtol=0.03)


def test_reduced_model_jit_matches_eager_and_gradients_finite(features):
    params = cp.PowerParams.prior()
    batch = cp.make_batch(features, sorted(features))
    eager = cp.reduced_predict(params, batch)
    jitted = jax.jit(cp.reduced_predict)(params, batch)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    grads = jax.grad(lambda p: cp._loss(p, batch, jnp.ones(3)))(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    # Central finite differences along a random direction, in log-parameter space.
    leaves, tree = jax.tree.flatten(params)
    key = jax.random.PRNGKey(0)
    direction = [jax.random.normal(k, x.shape) for k, x in
                 zip(jax.random.split(key, len(leaves)), leaves, strict=True)]
    f = lambda t: cp._loss(jax.tree.unflatten(tree, [x + t * d for x, d in
                                                      zip(leaves, direction, strict=True)]),
                           batch, jnp.ones(3))
    eps = 1e-5
    numeric = (f(eps) - f(-eps)) / (2 * eps)
    analytic = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), direction,
                                                  strict=True))
    np.testing.assert_allclose(analytic, numeric, rtol=1e-4, atol=1e-8)


def test_shipped_fit_and_report():
    """The shipped fit is physical and its recorded held-out errors of power and J per
    output token meet the issue's 15% bar."""
    fitted = fitted_params.read(fitted_params.POWER_FILE)
    assert set(fitted["families"]) == {"ampere", "hopper", "blackwell"}
    for fam in fitted["families"].values():
        assert 0.0 < fam["idle_fraction"] < 0.5
        # Active power: positive and well under TDP (idle plus active stays below it).
        assert 0.0 < fam["tdp_fractions"]["active"] < 0.6
        assert fam["tdp_fractions"]["active"] + fam["idle_fraction"] < 0.8
        assert 1e-14 < fam["energy"]["per_flop"][0] < 1e-11
        assert 1e-12 < fam["energy"]["per_hbm_byte"] < 1e-9
    report = json.loads((ROOT / "calibration" / "power" / "report.json").read_text())
    held = report["heldout_random"]["full_model"]
    assert held["power"]["median_abs_pct"] <= 15.0
    assert held["j_per_token"]["median_abs_pct"] <= 15.0
    assert held["power"]["n"] >= 50
    for runtime in fitted["runtimes"].values():
        assert all(0.0 < v <= 1.0 for v in runtime["kernel_efficiency"].values())
        assert 0.0 < runtime["expert_efficiency"] <= 1.0


