"""`calibration/mlperf_serving.py`: its row mapping and length assumptions are well formed,
and one small row simulates to finite latencies."""

import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "calibration"))

import mlperf_serving as ms  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    rows, _ = ms.mlperf_rows()
    return rows


def test_every_kept_row_maps_to_an_engine_that_holds_the_system(rows):
    assert len(rows) > 100
    for row in rows:
        model, chip, design, framework, replicas = ms.engine(row)
        assert framework in ("trt", "vllm")
        assert replicas >= 1 and replicas * design.layout.tp <= row["accelerators"]
        assert row["ttft_limit"] > 0.1 and 0.005 < row["tpot_limit"] < 0.5
        assert row["scenario"] in ("Server", "Interactive")


def test_nvidia_llama2_layout_is_the_submitted_one(rows):
    # NVIDIA's v4.1 Llama-2-70B Server configuration: H100 TP2, H200 TP1, FP8 weights.
    for chip, tp in (("h100", 2), ("h200", 1)):
        row = next(r for r in rows if r["model"] == "llama-2-70b" and r["chip"] == chip
                   and "TensorRT" in r["software"])
        _, _, design, framework, _ = ms.engine(row)
        assert (design.layout.tp, framework, design.precision.names[0]) == (tp, "trt", "fp8")


def test_lengths_follow_the_data_sets():
    rng = np.random.default_rng(1)
    r1 = ms.output_lengths("deepseek-r1", 20000, rng)
    # The documented percentiles (report.txt: median 2108, cap 20000, mean about 3.8-3.9k).
    assert 125 <= r1.min() and r1.max() <= 20000
    assert abs(np.median(r1) / 2108 - 1) < 0.05
    assert abs(r1.mean() / 3886.2 - 1) < 0.1
    fixed = ms.output_lengths("llama-2-70b", 10, rng)
    assert np.all(fixed == 294.0)


def test_inputs_are_the_derived_means_predict_uses(rows):
    # The same lengths as `perfmodel predict` (perfmodel/data/mlperf_lengths.csv), not the
    # earlier ASSUMED means (512 tokens for Llama-2-70B's OpenOrca).
    from perfmodel.mlperf import dataset_lengths
    assert ms.INPUT["llama-2-70b"] == float(dataset_lengths()["llama2-70b"]["input_tokens_mean"])
    assert ms.INPUT["llama-2-70b"] != ms.ASSUMED_INPUT["llama-2-70b"]
    row = next(r for r in rows if r["model"] == "llama-2-70b")
    requests, _ = ms.requests_for(row, replicas=1)
    inputs = np.asarray(requests.input_len)[np.asarray(requests.valid)]
    assert np.all(inputs == round(ms.INPUT["llama-2-70b"]))   # whole tokens


def test_tensorrt_rows_run_tensorrt_llms_scheduler():
    trt, vllm = ms.policy_for("trt", 64, 8192.0), ms.policy_for("vllm", 64, 8192.0)
    assert (trt.engine, trt.chunked_prefill, float(trt.output_reserve)) == ("trtllm", False, 1.0)
    assert vllm.engine == "vllm" and float(vllm.max_num_seqs) == float(trt.max_num_seqs) == 64
    # A prompt longer than the budget runs only with chunked prefill (Llama-3.1-405B).
    assert ms.policy_for("trt", 64, 8192.0, prompt=9650.0).chunked_prefill
    assert not ms.policy_for("trt", 64, 8192.0, prompt=8192.0).chunked_prefill


def test_requests_share_a_poisson_stream_round_robin(rows):
    row = next(r for r in rows if r["accelerators"] >= 8 and r["model"] == "llama-2-70b")
    requests, scored = ms.requests_for(row, replicas=4, seed=3)
    valid = np.asarray(requests.valid)
    arrival = np.asarray(requests.arrival)[valid]
    assert ms.MIN_REQUESTS <= valid.sum() <= ms.MAX_REQUESTS
    assert np.all(np.diff(arrival) >= 0)
    # Every 4th arrival of a Poisson stream at rate qps: mean gap 4 / qps, CV 1/2.
    gaps = np.diff(arrival)
    assert abs(gaps.mean() * row["qps"] / 4 - 1) < 0.1
    assert abs(gaps.std() / gaps.mean() - 0.5) < 0.1
    assert 0.3 < scored.sum() / valid.sum() < 0.5 and not np.any(scored & ~valid)


def test_dedupe_merges_only_identical_systems(rows):
    keys = {ms.dedupe_key(r) for r in rows}
    assert len(rows) / 3 < len(keys) < len(rows)


@pytest.mark.slow
def test_one_small_row_gives_finite_latencies(rows):
    # Compiles the simulator for one structure (~10 s on 2 cores).
    row = min((r for r in rows if r["model"] == "llama-3.1-8b"), key=lambda r: r["qps"])
    out = ms.predict_row(row)
    for key in ms.METRICS:
        assert np.isfinite(out[key]) and out[key] > 0, key
    assert out["ttft50"] <= out["ttft99"] and out["tpot50"] <= out["tpot99"]
    assert out["seqs"] in ms.SEQS


def test_medians_report_errors_and_p99_ratios():
    rows = [{"ttft50": 1.0, "ttft99": 2.0, "tpot50": 0.1, "tpot99": 0.2,
             "pred_ttft50": 1.5, "pred_ttft99": 1.0, "pred_tpot50": 0.1, "pred_tpot99": 0.6}]
    m = ms.medians(rows)
    assert m["n"] == 1 and m["ttft50"] == 0.5 and m["ttft99"] == 0.5 and m["tpot50"] == 0.0
    assert m["ratio_ttft99"] == 0.5 and abs(m["ratio_tpot99"] - 3.0) < 1e-12


def _system(name, **values):
    return {**dict(zip(ms.SYSTEM_KEY, (name, "b200", "x", "v5.1", 8, "trt", "fp8"), strict=True)),
            **values}


def test_capacity_bins_group_rows_by_their_systems_offline_ratio():
    offline = [_system("a", tput=100.0, after=80.0),      # 0.8: the first bin
               _system("a", tput=100.0, after=float("nan")),   # a failed prediction
               _system("b", tput=100.0, after=100.0),     # 1.0
               _system("c", tput=100.0, after=120.0),     # 1.2
               _system("d", tput=100.0, after=200.0)]     # 2.0: the last bin
    rows = [_system(name, ttft99=1.0, tpot99=1.0, pred_ttft99=r, pred_tpot99=2 * r)
            for name, r in (("a", 0.9), ("b", 0.5), ("c", 0.3), ("d", 0.1), ("e", 1.0))]
    out = ms.capacity_bins(rows, offline)
    assert out["matched"] == 4                             # "e" has no Offline row
    assert [b["n"] for b in out["bins"]] == [1, 1, 1, 1]
    assert [b["ratio_ttft99"] for b in out["bins"]] == [0.9, 0.5, 0.3, 0.1]
    assert [b["ratio_tpot99"] for b in out["bins"]] == [1.8, 1.0, 0.6, 0.2]
    assert out["spearman_ttft99"] == pytest.approx(-1.0)
    table = ms.capacity_table(out)
    assert "| <= 0.9 | 1 | 0.90 | 1.80 |" in table and "| > 1.25 | 1 |" in table


def test_spearman_ranks_ties_and_skips_nans():
    assert ms.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert ms.spearman([1, 2, 2, 4], [1, 3, 3, np.inf]) == pytest.approx(1.0)
    assert ms.spearman([1, 2, np.nan, 4, 5], [5, 4, 0, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(ms.spearman([1, 2], [2, 1]))
