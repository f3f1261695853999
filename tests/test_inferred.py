"""The inferred mode of the Jalapeno comparison: parameters, the Levenberg-Marquardt fit and
the identification it reports (`perfmodel.studies.inferred`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from perfmodel.design import Layout
from perfmodel.presets import get_chip
from perfmodel.solvers import RESULTS, succeeded
from perfmodel.studies.inferred import (
    INFERRED,
    PRIOR_WIDTH,
    TOP,
    InferredParams,
    Problem,
    apply,
    infer,
    ratios,
    residuals,
)
from perfmodel.studies.targets import PointTarget, Target, band_miss, point_value
from perfmodel.sweep import default_runtime
from perfmodel.workload import Workload

# At the priors, not the shipped fit: the synthetic checks test the inference, and a refit
# that moves the chip's fractions (a bandwidth fraction near 1, where a logit shift of 0.5
# changes it by 4 %) would change what the three concurrencies can identify.
CHIP = get_chip("jalapeno", calibrated=False)
RUNTIME = default_runtime(CHIP)
# Short requests keep the compile small; three concurrencies spread the step between fixed
# costs (one request) and HBM streaming (hundreds), so overheads and bandwidth separate.
WORKLOAD = Workload(1024.0, 256.0)
CONCURRENCIES = (1.0, 32.0, 512.0)
# The data fix one combination of the three fixed costs per concurrency: the kernel
# overhead is held by a tight prior (a known parameter) so the step overhead is
# identified; memory latency and attention keep the default width and stay unidentified.
WIDTHS = {"kernel_overhead": 0.01}
DATA_WIDTH = 0.01


def _targets(reported_kw, reported_e2e):
    return [Target("gpt-oss-120b", Layout(tp=1), c, 1.0, 1.0, kw, e2e)
            for c, kw, e2e in zip(CONCURRENCIES, reported_kw, reported_e2e, strict=True)]


def _truth():
    start = InferredParams.of(CHIP, RUNTIME)
    return eqx.tree_at(lambda p: (p.step_overhead, p.bandwidth_max), start,
                       (start.step_overhead + 0.5, start.bandwidth_max + 0.5))


@pytest.fixture(scope="module")
def synthetic():
    """Targets whose reported ratios the model itself gives at `_truth` (against baselines
    of 1 tokens/s per kW and 1 s), and the fit from the predicted chip."""
    placeholder = _targets((1.0,) * 3, (1.0,) * 3)
    kw, e2e = eqx.filter_jit(ratios)(_truth(), placeholder, CHIP, RUNTIME, WORKLOAD)
    targets = _targets(tuple(kw), tuple(e2e))
    return targets, infer(CHIP, RUNTIME, targets, WORKLOAD, widths=WIDTHS,
                          data_width=DATA_WIDTH)


def test_params_round_trip_jitted_and_eager():
    p = _truth()

    def there_and_back(p):
        chip, runtime = apply(p, CHIP, RUNTIME)
        return InferredParams.of(chip, runtime).flat()

    eager, jitted = there_and_back(p), jax.jit(there_and_back)(p)
    np.testing.assert_allclose(eager, p.flat(), rtol=1e-12)
    np.testing.assert_allclose(jitted, eager, rtol=1e-12)
    values = p.values()
    assert values["step_overhead"] == pytest.approx(1e-3 * np.exp(0.5))
    b0 = float(CHIP.efficiency.bandwidth_max)     # a logit shift of 0.5, below 1
    assert values["bandwidth_max"] == pytest.approx(1.0 / (1.0 + (1.0 - b0) / b0 * np.exp(-0.5)))
    chip, _ = apply(eqx.tree_at(lambda q: q.bandwidth_max, p, jnp.asarray(50.0)), CHIP,
                    RUNTIME)
    assert float(chip.efficiency.bandwidth_max) <= 1.0


def test_invalid_widths_and_targets_raise():
    with pytest.raises(ValueError, match="slices"):
        InferredParams.widths({"slices": 1.0})
    with pytest.raises(ValueError, match="step_overhead"):
        InferredParams.widths({"step_overhead": 0.0})
    with pytest.raises(ValueError, match="target"):
        infer(CHIP, RUNTIME, [], WORKLOAD)
    edge = eqx.tree_at(lambda c: c.efficiency.bandwidth_max, CHIP, jnp.asarray(1.0))
    with pytest.raises(ValueError, match="chip.efficiency.bandwidth_max"):
        infer(edge, RUNTIME, _targets((1.0,) * 3, (1.0,) * 3), WORKLOAD)
    with pytest.raises(ValueError, match="data_width"):
        infer(CHIP, RUNTIME, _targets((1.0,) * 3, (1.0,) * 3), WORKLOAD, data_width=-1.0)


@pytest.mark.slow   # with the module's fit: the solve compiles the serving model (10-30 CPU s)
def test_fit_recovers_synthetic_parameters(synthetic):
    """Started at the predicted chip, 0.5 (log or logit) away from the truth in step
    overhead and bandwidth fraction, the fit returns to the truth and succeeds."""
    _, fit = synthetic
    assert succeeded(fit.result)
    truth, start = _truth(), InferredParams.of(CHIP, RUNTIME)
    for name in ("step_overhead", "bandwidth_max"):
        got = float(getattr(fit.params, name))
        assert abs(got - float(getattr(start, name))) > 0.4, name     # it moved
        assert got == pytest.approx(float(getattr(truth, name)), abs=0.05), name
    # The reported ratios are reproduced (log misses, at 1 % data width).
    assert float(jnp.max(jnp.abs(fit.misses))) < 0.01
    np.testing.assert_allclose(fit.chip.efficiency.bandwidth_max,
                               jax.nn.sigmoid(fit.params.bandwidth_max), rtol=1e-12)
    np.testing.assert_allclose(fit.runtime.step_overhead, jnp.exp(fit.params.step_overhead),
                               rtol=1e-12)


@pytest.mark.slow   # with the module's fit: the solve compiles the serving model (10-30 CPU s)
def test_fit_reports_identification(synthetic):
    """The bandwidth fraction and step overhead are identified (posterior width far below
    the prior's); the memory latency and attention efficiency, which barely move these
    ratios, are not (posterior width close to the prior's) and stay at their priors."""
    _, fit = synthetic
    identified = fit.identified()
    assert identified["bandwidth_max"] and identified["step_overhead"]
    assert not identified["memory_latency"] and not identified["attention_max"]
    ratio = dict(zip(INFERRED, np.asarray(fit.width_ratio), strict=True))
    assert ratio["memory_latency"] > 0.9 and ratio["bandwidth_max"] < 0.3
    start = InferredParams.of(CHIP, RUNTIME)
    assert float(fit.params.attention_max) == pytest.approx(float(start.attention_max),
                                                            abs=0.1)
    row = fit.report()
    assert row["inferred_result"] == "successful"
    assert row["inferred_memory_latency_identified"] is False
    assert row["inferred_step_overhead_prior"] == pytest.approx(1e-3)    # the centre
    assert row["inferred_step_overhead"] == pytest.approx(1e-3 * np.exp(0.5), rel=0.05)
    assert row["inferred_step_overhead_posterior_width"] < row[
        "inferred_step_overhead_prior_width"]
    # 0.5 from the centre at width 1: within the plausible range.
    assert row["inferred_step_overhead_widths_from_prior"] == pytest.approx(0.5, abs=0.05)
    assert row["inferred_implausible"] == ""


@pytest.mark.slow   # with the module's fit: the solve compiles the serving model (10-30 CPU s)
def test_nonfinite_residual_is_not_silent(synthetic):
    """A reported ratio of 0 (log -inf) gives a non-finite residual: the result says so,
    and `throw` (the default) raises. The same targets' structure: no recompile."""
    targets, _ = synthetic
    bad = [eqx.tree_at(lambda t: t.reported_kw, targets[0], jnp.asarray(0.0, dtype=float))] \
        + targets[1:]
    out = infer(CHIP, RUNTIME, bad, WORKLOAD, widths=WIDTHS, data_width=DATA_WIDTH,
                throw=False)
    assert out.result == RESULTS.nonfinite
    with pytest.raises(RuntimeError, match="infer"):
        infer(CHIP, RUNTIME, bad, WORKLOAD, widths=WIDTHS, data_width=DATA_WIDTH)


@pytest.mark.slow   # with the module's fit: the solve compiles the serving model (10-30 CPU s)
def test_residuals_jitted_agree_with_eager(synthetic):
    targets, fit = synthetic
    # One target: the eager serving model runs op by op (seconds per target).
    problem = Problem(targets=tuple(targets[:1]), chip=CHIP, runtime=RUNTIME,
                      workload=WORKLOAD, centre=InferredParams.of(CHIP, RUNTIME),
                      width=InferredParams.widths(WIDTHS), data_width=jnp.asarray(DATA_WIDTH))
    eager = residuals(fit.params, problem)
    np.testing.assert_allclose(eqx.filter_jit(residuals)(fit.params, problem), eager,
                               rtol=1e-9, atol=1e-12)
    assert eager.shape == (2 + len(INFERRED),)
    # Fitted on exact ratios: the data residuals are small, the prior ones are the
    # parameters' distances from the centre in widths.
    np.testing.assert_allclose(eager[2:], (fit.params.flat() - fit.centre.flat())
                               / InferredParams.widths(WIDTHS).flat(), rtol=1e-12)


@pytest.mark.slow   # with the module's fit: the solve compiles the serving model (10-30 CPU s)
def test_posterior_widths_are_those_of_a_fresh_jacobian(synthetic):
    """`infer` reads the Jacobian from the solver's state: it is that of the solution."""
    targets, fit = synthetic
    problem = Problem(targets=tuple(targets), chip=CHIP, runtime=RUNTIME, workload=WORKLOAD,
                      centre=InferredParams.of(CHIP, RUNTIME),
                      width=InferredParams.widths(WIDTHS),
                      data_width=jnp.asarray(DATA_WIDTH))
    jac = eqx.filter_jit(jax.jacfwd(residuals))(fit.params, problem).flat()
    np.testing.assert_allclose(fit.posterior_width,
                               np.sqrt(np.diag(np.linalg.inv(jac.T @ jac))), rtol=1e-6)


# One pair with its top concurrency fitted: Little's law ties its two ratios at a fixed top,
# and the top unties them, so the pair fixes both the top and the step overhead; the other
# parameters are held by tight priors (known).
TOP_WIDTHS = {"memory_latency": 0.01, "kernel_overhead": 0.01, "attention_max": 0.01,
              "bandwidth_max": 0.01}
TOP_TARGET = Target("gpt-oss-120b", Layout(tp=2), 64.0, 1.0, 1.0, 1.0, 1.0, top=32.0,
                    claims=("J01", "J02"))


@pytest.mark.slow   # the fit compiles the serving model for about 10 s
def test_fit_recovers_top_concurrency():
    """Targets generated by the model at a known top (0.7 in log below the prior centre)
    and step overhead (0.5 above): started at the prior, the fit recovers both, succeeds,
    and reports the top identified."""
    start = InferredParams.of(CHIP, RUNTIME, [32.0])
    truth = eqx.tree_at(lambda p: (p.step_overhead, p.top_requests), start,
                        (start.step_overhead + 0.5, start.top_requests - 0.7))
    kw, e2e = eqx.filter_jit(ratios)(truth, [TOP_TARGET], CHIP, RUNTIME, WORKLOAD)
    target = eqx.tree_at(lambda t: (t.reported_kw, t.reported_e2e), TOP_TARGET,
                         (kw[0], e2e[0]))
    fit = infer(CHIP, RUNTIME, [target], WORKLOAD, widths=TOP_WIDTHS, data_width=DATA_WIDTH)
    assert succeeded(fit.result)
    assert fit.names == INFERRED + (f"{TOP}[0]",)
    assert float(fit.params.top_requests[0]) == pytest.approx(
        float(truth.top_requests[0]), abs=0.05)
    assert float(fit.params.step_overhead) == pytest.approx(float(truth.step_overhead),
                                                            abs=0.05)
    assert float(jnp.max(jnp.abs(fit.misses))) < 0.01
    top = fit.report_top(0)
    assert top["inferred_top_requests_per_chip"] == pytest.approx(32.0 * np.exp(-0.7),
                                                                  rel=0.05)
    assert top["inferred_top_requests_per_chip_prior"] == pytest.approx(32.0)
    assert top["inferred_top_requests_per_chip_prior_width"] == pytest.approx(
        PRIOR_WIDTH[TOP])
    assert top["inferred_top_requests_per_chip_identified"] is True
    assert fit.unmet("J01") == "" or "J01" in fit.unmet("J01")
    assert fit.report_top(1) == {}


def test_band_miss_one_sided():
    low, inf = 700.0, jnp.inf
    assert float(band_miss(800.0, low, inf)) == 0.0
    assert float(band_miss(350.0, low, inf)) == pytest.approx(np.log(0.5))
    # A value ("~1400": low == high) gives the signed log miss on both sides.
    assert float(band_miss(1540.0, 1400.0, 1400.0)) == pytest.approx(np.log(1.1))
    assert float(band_miss(2.0, 2.1, 4.1)) == pytest.approx(np.log(2.0 / 2.1))
    assert float(band_miss(3.0, 2.1, 4.1)) == 0.0
    grad = jax.grad(band_miss)(800.0, low, inf)   # met: no pull, and no NaN from the inf
    assert float(grad) == 0.0


@pytest.mark.slow   # traces the residuals through the serving model (8 CPU s)
def test_speed_residual_zero_when_met_and_not_otherwise():
    """A per-user speed target ("> low" tokens/s/user, one request on one TP1 replica):
    its residual is 0 when the model's speed is above the bound and the whitened log
    shortfall (negative: below) when it is not; the same compiled residuals serve both."""
    speed = PointTarget("J08", "gpt-oss-120b", Layout(tp=1), 1.0, "interactivity", 1.0,
                        1.0, jnp.inf)
    value = float(eqx.filter_jit(point_value)(speed, CHIP, RUNTIME, WORKLOAD))
    assert 50.0 < value < 5000.0     # tokens/s/user of one request
    params = InferredParams.of(CHIP, RUNTIME)
    run = eqx.filter_jit(residuals)
    out = []
    for low in (0.5 * value, 2.0 * value):
        problem = Problem(targets=(_targets((1.0,) * 3, (1.0,) * 3)[1],), chip=CHIP,
                          runtime=RUNTIME,
                          workload=WORKLOAD, centre=params, width=InferredParams.widths(),
                          data_width=jnp.asarray(DATA_WIDTH),
                          points=(eqx.tree_at(lambda p: p.low, speed,
                                              jnp.asarray(low, dtype=float)),))
        assert problem.claims() == ("", "", "J08")
        out.append(run(params, problem))
    met, short = out
    assert met.shape == (2 + 1 + len(INFERRED),)
    assert float(met[2]) == 0.0
    assert float(short[2]) == pytest.approx(np.log(0.5) / DATA_WIDTH, rel=1e-9)
    with pytest.raises(ValueError, match="metric"):
        PointTarget("J07", "gpt-oss-120b", Layout(tp=1), 1.0, "speed", 1.0, 1.0, 2.0)
