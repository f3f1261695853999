"""Power calibration: row parsing, the fit's predictions being `serving.predict`'s through
`fitted_power.json`, the solve (convergence, result codes, throw), its derivatives against
finite differences, and the shipped fit's held-out accuracy figures."""

import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from perfmodel import calibration_power as cp
from perfmodel import fitted as fitted_params
from perfmodel.presets import get_chip
from perfmodel.solvers import RESULTS, succeeded

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROWS = [  # ML.ENERGY v3 rows (calibration/power/power_measurements.csv row_id 1-4 style)
    dict(model="meta-llama/Llama-3.1-8B-Instruct", hardware="H100", num_gpus="1",
         parallelism="TP1 EP1 DP1", framework="vLLM 0.11.1", precision="bfloat16",
         workload="lm-arena-chat: LM Arena", max_batch_size=str(b), avg_batch_size=str(b),
         osl="400", avg_power_w_per_gpu="500", energy_j_per_output_token="0.2")
    for b in (8, 64, 512)]
#: Pipelined MoE rows of the ML.ENERGY v2 leaderboard kind (Mixtral-8x22B, 16 A100s).
PIPELINED = [dict(model="mistralai/Mixtral-8x22B-Instruct-v0.1", hardware="A100-SXM4-40GB",
                  num_gpus="16", parallelism="TP8 PP2",
                  framework="vLLM (version not recorded in data; v2 benchmark era 2024)",
                  precision="bfloat16", workload="chat: ShareGPT", max_batch_size=str(b),
                  avg_batch_size=str(b), osl="300", avg_power_w_per_gpu="200",
                  energy_j_per_output_token="1.0") for b in (64, 512)]
CHIPS = {"ampere": get_chip("a100", calibrated=False),
         "hopper": get_chip("h100", calibrated=False)}


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


def _params(eff=0.9, overlap=0.9, kernel=0.9, delta=0.0):
    """Prior parameters with the 2024 vLLM engine terms, A100 kernels and the family
    offsets set."""
    prior = cp.PowerParams.prior()
    k, ampere = cp.RUNTIMES.index("vllm-2024"), cp.FAMILIES.index("ampere")
    logit = lambda p: float(np.log(p / (1.0 - p)))  # noqa: E731
    return type(prior)(**{
        **prior.__dict__,
        "logit_engine": prior.logit_engine.at[k].set(jnp.asarray([logit(eff), logit(overlap)])),
        "logit_kernel": prior.logit_kernel.at[k, ampere].set(logit(kernel)),
        "family_delta": prior.family_delta + delta * jnp.arange(15.0).reshape(3, 5) / 15.0})


@pytest.fixture(scope="module")
def problem():
    specs, skipped = cp.specs_of(ROWS + PIPELINED)
    assert not skipped and len(cp.groups_of(specs)) == 2
    return cp.build_problem(specs)


@pytest.mark.parametrize("holdout", [None, "ampere"])
def test_fit_predictions_are_serving_predict(problem, holdout):
    """The fit's own predictions (the model its residuals use) are what the fitted chip and
    runtime give through `fitted_power.json` (`to_fitted`, `fitted.apply`,
    `predict_power_rows`, the serving model the commands run), held-out family included."""
    params = _params(eff=0.6, overlap=0.3, kernel=0.7, delta=0.2)
    ours = cp.evaluate(params, problem, holdout=holdout)
    power, joules, tok_s = ours.power, ours.joules, ours.tok_s
    full = cp.predict_power_rows(ROWS + PIPELINED, cp.to_fitted(params, CHIPS, holdout))
    order = [problem.index.index(i) for i in range(len(full))]
    assert all(r["pred_status"] == "ok" for r in full)
    for ours, key in ((power, "pred_power_w_modelled"),
                      (joules, "pred_j_per_output_token"),
                      (tok_s, "pred_output_tput_per_chip")):
        np.testing.assert_allclose(np.asarray(ours)[order], [r[key] for r in full], rtol=1e-9)
    # Power rises with batch and stays at or under TDP.
    h100 = np.asarray(power)[order][:3]
    assert np.all(np.diff(h100) > 0) and np.all(h100 <= 700 + 1e-6)


def test_engine_terms_move_predictions_the_physical_way(problem):
    """Expert-kernel efficiency, pipeline overlap and kernel efficiency of the 2024 vLLM
    engine, on the pipelined Mixtral rows."""
    rows = [problem.index.index(i) for i in (3, 4)]

    def run(**kw):
        out = cp.evaluate(_params(**kw), problem)
        return np.asarray(out.tok_s)[rows], np.asarray(out.power)[rows]

    base, slow_experts, serial, slow_kernels = run(), run(eff=0.4), run(overlap=0.1), \
        run(kernel=0.5)
    # Slower expert kernels cost throughput; so does less pipeline overlap, but only at a
    # large batch: at 64 sequences the stages re-read their weights per micro-batch, and
    # splitting the batch buys nothing.
    assert np.all(slow_experts[0] < 0.9 * base[0])
    assert serial[0][1] < 0.8 * base[0][1] and serial[0][0] == pytest.approx(base[0][0],
                                                                              rel=0.1)
    # Slower kernels: less throughput, and the same work spread over more time draws less.
    assert np.all(slow_kernels[0] < 0.8 * base[0]) and np.all(slow_kernels[1] < base[1])


@pytest.mark.parametrize("holdout", [None, pytest.param("ampere", marks=pytest.mark.slow)])
def test_gaussian_priors_are_the_documented_rows(problem, holdout):
    """The physical priors close the residual vector: each measured chip's energy per HBM
    byte, then each fitted (engine, family) kernel efficiency, as z-scores in log space
    scaled by RESIDUAL_SCALE / sqrt(weighted row groups); a held-out family has none."""
    params = _params(kernel=0.7, delta=0.2)
    # Compiled (one program instead of thousands of eager operations: 18 s -> a few).
    r = eqx.filter_jit(cp.residuals)(params, problem, holdout=holdout)
    fitted = cp.to_fitted(params, CHIPS)
    scale = cp.RESIDUAL_SCALE / np.sqrt(2.0)  # two row groups, both weighted
    hbm, hbm_width = cp.GAUSSIAN_PRIORS["per_hbm_byte"]
    kernel, kernel_width = cp.GAUSSIAN_PRIORS["kernel_efficiency"]
    keep = 0.0 if holdout == "ampere" else 1.0
    # Chips in group order (H100 rows first), then (vllm, hopper), (vllm-2024, ampere).
    expected = [np.log(fitted["families"]["hopper"]["energy"]["per_hbm_byte"] / hbm)
                / hbm_width,
                keep * np.log(fitted["families"]["ampere"]["energy"]["per_hbm_byte"] / hbm)
                / hbm_width,
                np.log(fitted["runtimes"]["vllm"]["kernel_efficiency"]["hopper"] / kernel)
                / kernel_width,
                keep * np.log(0.7 / kernel) / kernel_width]
    np.testing.assert_allclose(np.asarray(r[-4:]), scale * np.asarray(expected), rtol=1e-9,
                               atol=1e-15)
    # The check can fail: the rows are not zero where they apply.
    assert (float(jnp.abs(r[-1])) > 1e-3) == (holdout is None)


@pytest.mark.slow   # compiles the Levenberg-Marquardt solve (about a minute)
def test_small_fit_recovers_known_parameters(problem):
    """Measurements made by known parameters are fitted back, with a successful result."""
    truth = cp.PowerParams.prior()
    truth = type(truth)(**{**truth.__dict__,
                           "log_fraction": truth.log_fraction
                           + jnp.asarray([0.3, -0.2, 0.0, 0.5]),
                           "logit_idle": truth.logit_idle + 0.4,
                           "log_overheads": truth.log_overheads + 0.5})
    made = cp.evaluate(truth, problem)
    power, joules = made.power, made.joules
    synthetic = type(problem)(**{**problem.__dict__, "power": power, "joules": joules})
    fit = cp.fit_power(synthetic)
    assert isinstance(fit, cp.PowerFit) and succeeded(fit.result)
    assert fit.result == RESULTS.successful and 0 < int(fit.steps) < 256
    # The priors pull the fit off the truth by the trade of a few data rows against them
    # (the old fit's tolerance); the optimum itself is at least as good as the truth.
    back = cp.evaluate(fit.params, synthetic)
    np.testing.assert_allclose(back.power, power, rtol=0.03)
    np.testing.assert_allclose(back.joules, joules, rtol=0.03)
    # The reported loss is half the residuals' sum of squares at the solution.
    r = cp.residuals(fit.params, synthetic)
    assert float(fit.loss) == pytest.approx(0.5 * float(jnp.sum(r ** 2)), rel=1e-9)
    assert float(fit.loss) <= 0.5 * float(jnp.sum(cp.residuals(truth, synthetic) ** 2))


@pytest.mark.slow   # compiles the Levenberg-Marquardt solve
def test_fit_throws_unless_asked_not_to(problem):
    with pytest.raises(RuntimeError, match="power fit: The maximum number of steps"):
        cp.fit_power(problem, max_steps=2)
    fit = cp.fit_power(problem, max_steps=2, throw=False)
    assert not succeeded(fit.result)
    assert fit.result == RESULTS.nonlinear_max_steps_reached


def test_fit_refuses_bad_weights_and_holdouts(problem):
    with pytest.raises(ValueError, match="weights has shape"):
        cp.fit_power(problem, weights=jnp.ones(3))
    with pytest.raises(ValueError, match="no measured row"):
        cp.fit_power(problem, weights=jnp.zeros(5))
    with pytest.raises(ValueError, match="holdout='tpu'"):
        cp.fit_power(problem, holdout="tpu")


@pytest.mark.slow   # compiles for 10 s or more (CI's slow stage runs it)
def test_residuals_jit_matches_eager_and_derivative_matches_finite_differences(problem):
    """The derivative the solver uses (forward-mode Jacobian of `serving.predict`) against
    float64 central differences along a random direction in log/logit-parameter space."""
    params = _params(eff=0.6, overlap=0.5, kernel=0.8, delta=0.1)
    weights = problem.weights([0, 2, 3, 4])
    eager = cp.residuals(params, problem, weights)
    f = jax.jit(lambda p: cp.residuals(p, problem, weights))
    np.testing.assert_allclose(f(params), eager, rtol=1e-12, atol=1e-15)
    assert float(jnp.abs(eager[1])) == 0.0 and float(jnp.abs(eager[6])) == 0.0  # unweighted
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    direction = jax.tree.unflatten(tree, [jax.random.normal(k, x.shape)
                                          for k, x in zip(keys, leaves, strict=True)])
    _, analytic = jax.jvp(f, (params,), (direction,))
    assert bool(jnp.all(jnp.isfinite(analytic)))
    eps = 1e-6
    shifted = [f(jax.tree.map(lambda x, d, s=s: x + s * eps * d, params, direction))
               for s in (1.0, -1.0)]
    numeric = (shifted[0] - shifted[1]) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-9)


def test_shipped_fit_and_report():
    """The shipped fit is physical and its recorded held-out errors of power and J per
    output token meet the issue's 15% bar (`calibration/power/fit.py` writes the held-out
    errors of the fit it ships under "test")."""
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
    held = report["heldout_random"]["test"]
    assert held["power"]["median_abs_pct"] <= 15.0
    assert held["j_per_token"]["median_abs_pct"] <= 15.0
    assert held["power"]["n"] >= 50
    for runtime in fitted["runtimes"].values():
        assert all(0.0 < v <= 1.0 for v in runtime["kernel_efficiency"].values())
        assert 0.0 < runtime["expert_efficiency"] <= 1.0


