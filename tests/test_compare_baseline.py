"""The GPU baseline of the Jalapeno comparison: the InferenceMAX Dynamo + TensorRT-LLM recipe
(perfmodel.studies.baseline), its check against the measured tops, and the wide sweep of
the compared chip."""

import pathlib

import numpy as np
import pytest

from perfmodel import calibration, datasets, fitted
from perfmodel.design import Disaggregated
from perfmodel.presets import get_chip, get_model
from perfmodel.studies import baseline
from perfmodel.studies import jalapeno as cmp
from perfmodel.workload import Workload

W = Workload(8192, 1024)


def test_recipe_space_is_disaggregated_wide_ep_within_nvl72():
    model, chip = get_model("deepseek-r1"), get_chip("gb200")
    layouts = baseline.layouts(model, chip)
    assert layouts and all(isinstance(x, Disaggregated) for x in layouts)
    assert all(x.chips <= chip.domain_size for x in layouts)
    # Prefill TP4 EP4 with DP attention; decode wide EP (tp = ep) with DP attention, as the
    # measured rows; the low-concurrency pool of 3 TP8 workers without it.
    assert {(x.prefill.tp, x.prefill.ep, x.prefill.dp_attention) for x in layouts} == {
        (4, 4, True)}
    wide = {x.decode.tp for x in layouts if x.decode.dp_attention}
    assert wide == {8, 16, 32}
    assert all(x.decode.ep == x.decode.tp for x in layouts)
    assert any(not x.decode.dp_attention and x.decode.replicas == 3 for x in layouts)
    # A 4-GPU domain holds none of them.
    small = get_chip("b200")
    assert baseline.layouts(model, small) == ()


def test_mtp_only_where_the_model_has_an_mtp_head():
    assert baseline.drafts(get_model("deepseek-r1")) == (0, 1, 2, 3)
    assert baseline.drafts(get_model("kimi-k2.5")) == (0,)
    assert baseline.applies(get_model("kimi-k2.5"))
    assert not baseline.applies(get_model("gpt-oss-120b"))


def test_recipe_design_formats_runtime_and_spec():
    model, chip = get_model("deepseek-r1"), get_chip("gb200")
    config = baseline.Config(baseline.layouts(model, chip)[1], draft_tokens=2)
    d = baseline.design_of(model, chip, config)
    assert d.precision.names[1:] == ("nvfp4", "fp8")           # experts NVFP4, KV FP8
    assert float(d.precision.kv_bytes) == pytest.approx(1.0)
    assert d.runtime.framework == "dynamo-trt"
    assert float(d.speculative.draft_tokens) == 2.0
    # MTP acceptance as the calibration fits it for the same (dynamo-trt) rows.
    assert float(d.speculative.acceptance) == pytest.approx(fitted.mtp_acceptance("dynamo-trt"))
    assert 0.3 < float(d.speculative.acceptance) < 0.9
    assert config.describe().startswith("dynamo-trt mtp2 P[")


def test_measured_top_rederived_from_rows():
    rows = {r["mtp"]: r for r in baseline.measured_top("deepseek-r1", "gb200")}
    assert rows[False]["conc"] == 2150.0 and rows[False]["gpus"] == 28.0
    assert rows[False]["requests_per_gpu"] == pytest.approx(
        cmp.gpu_top_concurrency("deepseek-r1")[0])
    assert rows[True]["gpus"] == 32.0
    assert baseline.measured_top("deepseek-r1", "gb300") == []


def test_compared_chip_sweeps_its_local_network():
    assert cmp.compared_chips("deepseek-r1", get_chip("jalapeno"), W) == 128
    assert cmp.compared_chips("deepseek-r1", get_chip("jalapeno"), W, wide=8) == 8
    assert cmp.compared_chips("deepseek-r1", get_chip("gb200"), W) == 64   # NVL72: 64
    assert cmp.compared_chips("deepseek-r1", get_chip("jalapeno"), W, chips=16) == 16
    with pytest.raises(ValueError, match="wide"):
        cmp.compare(["deepseek-r1"], wide=0)


@pytest.fixture(scope="module")
def check():
    return {r["measured_mtp"]: r for r in baseline.check_top(
        "deepseek-r1", get_chip("gb200"), get_model("deepseek-r1"), W)}


@pytest.mark.slow   # about 16 eager evaluations of disaggregated layouts
@pytest.mark.xfail(strict=True, reason="issue 21: 0.82x throughput, 0.84x interactivity "
                   "since the baseline runs the attention math the fit reads the rows with")
def test_baseline_within_15_percent_of_measured_top_without_mtp(check):
    """Issue 21's bar. Missed since 2026-12-06 (0.82x throughput, 0.84x interactivity since
    the fit hops between minima, 0.81x and 0.82x since the MLA kernel launches refit; 0.86x
    and 0.81x at first):
    the baseline had run FP8 attention at the rate the fit had taken from rows read with
    BF16 attention, 1.5x the rate the rows showed, and so met it (0.98x and 0.97x; 0.93x
    and 0.92x before the MTP rows carried their recipes' draft lengths, 0.97x and 0.86x
    when decode and prompt attention were first fitted apart, 0.81x and 0.79x with one
    attention term). Now both read Blackwell's MLA as FP8 (`design.attention_class`)."""
    r = check[False]
    assert r["predicted_config"].startswith("dynamo-trt no-mtp P[")
    assert r["ratio_tput"] == pytest.approx(1.0, abs=0.15)
    assert r["ratio_interactivity"] == pytest.approx(1.0, abs=0.15)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="issue 21: 0.77x throughput, 0.77x interactivity "
                   "since the baseline runs the attention math the fit reads the rows with")
def test_baseline_within_15_percent_of_measured_top_with_mtp(check):
    """Issue 21's bar at the MTP top. Missed since 2026-12-06 (0.77x throughput, 0.77x
    interactivity since the fit hops between minima, 0.76x and 0.75x since the MLA kernel
    launches refit; 0.79x and 0.72x at first), as the top
    without MTP; met before only with the baseline's attention
    1.5x the fitted rate (0.92x and 0.88x once the fit read each GB200 Dynamo-TRT MTP row
    with its recipe's draft length, 0.86x and 0.85x with two drafts everywhere)."""
    r = check[True]
    assert r["predicted_config"].startswith("dynamo-trt mtp")
    assert r["ratio_tput"] == pytest.approx(1.0, abs=0.15)
    assert r["ratio_interactivity"] == pytest.approx(1.0, abs=0.15)


@pytest.mark.slow
def test_baseline_points_take_the_recipe_at_the_top():
    top = cmp.gpu_top_concurrency("deepseek-r1")[0]
    plain = cmp.baseline_points("deepseek-r1", get_chip("gb300"), W, 8, (1.0, 64.0),
                                peak="top", top=top, recipe=False)
    points = cmp.baseline_points("deepseek-r1", get_chip("gb300"), W, 8, (1.0, 64.0),
                                 peak="top", top=top)
    assert points.peak_tput_per_chip >= plain.peak_tput_per_chip
    assert points.peak_layout.startswith("dynamo-trt")
    assert points.peak_concurrency / points.peak_chips <= top * (1 + 1e-9)
    assert points.low_interactivity >= plain.low_interactivity


def test_recipe_runs_the_precision_the_fit_reads_its_rows_with():
    """The baseline's recipe and the calibration's reading of the rows it reproduces (GB200
    DeepSeek-R1 Dynamo-TRT) build the same cache format and attention math: before
    2026-12-06 the recipe ran FP8 attention at a rate fitted on rows read with BF16 math."""
    path = pathlib.Path(__file__).resolve().parents[1] / "calibration" / "data" \
        / "benchmarks_inferencemax.csv"
    rows = [r for r in datasets.load_benchmarks(path)
            if baseline.is_recipe_row("deepseek-r1", "gb200", r.model, r.hardware,
                                      r.framework, r.precision, r.isl, r.osl)]
    groups, errors = calibration.build_groups(rows)
    assert rows and groups and not errors
    model, chip = get_model("deepseek-r1"), get_chip("gb200")
    recipe = baseline.design_of(model, chip, baseline.Config(baseline.layouts(model, chip)[0],
                                                             draft_tokens=0)).precision
    for g in groups:
        read = g.design.precision
        np.testing.assert_array_equal(read.attention_compute, recipe.attention_compute)
        assert float(read.kv_bytes) == float(recipe.kv_bytes)
