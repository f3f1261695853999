"""`perfmodel.mlperf`: MLPerf rows read into specs (with reasons for the rows it cannot
predict), the data-set lengths carry sources, and each scenario's prediction is its own
metric: Offline the best throughput, Server the capacity under the row's limits."""

import csv
import math

import pytest

from perfmodel import mlperf
from perfmodel.cli import main

#: A 1-accelerator H100 row (one layout, so each structure evaluates in a few seconds).
BASE = {"mlperf_version": "v5.1", "submitter": "x", "model": "llama3.1-8b",
        "scenario": "Offline", "accelerator": "NVIDIA H100-SXM-80GB", "nodes": "1",
        "accel_per_node": "1", "total_accelerators": "1", "weight_data_types": "fp8",
        "software": "vLLM 0.10.0", "ttft_constraint_ms": "", "tpot_constraint_ms": "",
        "target_qps": "", "result_per_accelerator": "5777"}


def row(**kw):
    return dict(BASE, **kw)


def test_lengths_have_sources_and_cover_the_shared_benchmarks():
    lengths = mlperf.dataset_lengths()
    for name, entry in lengths.items():
        assert entry["source"] and entry["input_basis"] and entry["output_basis"], name
        assert float(entry["output_tokens_mean"]) > 1
        if entry["input_tokens_mean"]:
            assert float(entry["input_tokens_mean"]) >= 1
    with open("calibration/data/benchmarks_mlperf.csv", newline="") as handle:
        shared = {mlperf.benchmark_of(r["model"]) for r in csv.DictReader(handle)}
    assert all(lengths[b]["input_tokens_mean"] for b in shared)


def test_benchmark_names():
    assert mlperf.benchmark_of("llama2-70b-99.9") == "llama2-70b"
    assert mlperf.benchmark_of("llama3.1-405b") == "llama3.1-405b"
    with pytest.raises(ValueError, match="no data-set lengths"):
        mlperf.benchmark_of("resnet50")


@pytest.mark.parametrize("kw, words", [
    ({"accelerator": "NVIDIA H100-NVL-94GB"}, "variant"),
    ({"accelerator": "Cerebras WSE-3"}, "unknown chip"),
    ({"model": "gpt-oss-120b"}, "no input-length statistic"),
    ({"weight_data_types": "UNSET"}, "weight type"),
    ({"scenario": "Server"}, "ttft_constraint_ms"),
    ({"scenario": "SingleStream"}, "scenario"),
])
def test_rows_it_cannot_predict_say_why(kw, words):
    with pytest.raises(ValueError, match=words):
        mlperf.interpret(row(**kw))
    out = mlperf.predict_row(row(**kw))
    assert words in out["pred_error"] and out["pred_result_per_accelerator"] == ""


def test_interpretation_rules():
    spec = mlperf.interpret(row(software="TensorRT 10.8", weight_data_types="fp16"))
    assert (spec.framework, spec.weights) == ("trt", "fp8")
    assert mlperf.interpret(row(weight_data_types="fp16")).weights == "bf16"
    eight = row(accel_per_node="8", total_accelerators="16")
    assert mlperf.interpret(eight).domain == 8       # scale-up domain: one node
    rack = row(accelerator="NVIDIA GB200", accel_per_node="4", total_accelerators="72")
    assert mlperf.interpret(rack).domain == 72       # NVL72 spans nodes
    # Speculative decoding only where the round's rules allow it.
    ds = row(model="deepseek-r1", accelerator="NVIDIA B200-SXM-180GB", scenario="Interactive",
             ttft_constraint_ms="1500", tpot_constraint_ms="15")
    assert mlperf.interpret(dict(ds, mlperf_version="v6.0")).speculative
    assert not mlperf.interpret(ds).speculative
    assert not mlperf.interpret(dict(ds, scenario="Server", mlperf_version="v6.0")).speculative


@pytest.mark.slow   # about 11 s: one structure evaluated over the grid, then three rows
def test_offline_is_the_best_throughput_and_server_capacity_obeys_its_limits():
    offline = mlperf.predict_row(row())
    assert offline["pred_error"] == "" and offline["pred_config"] == "tp1"
    best = float(offline["pred_result_per_accelerator"])
    assert 1e3 < best < 3e4
    assert "data-set means" in offline["pred_basis"]
    server = dict(row(scenario="Server", ttft_constraint_ms="2000",
                      tpot_constraint_ms="100", target_qps="20"))
    strict = dict(server, tpot_constraint_ms="30")
    loose, tight = (float(mlperf.predict_row(r)["pred_result_per_accelerator"])
                    for r in (server, strict))
    assert tight < loose <= best * (1 + 1e-9)
    out = mlperf.predict_row(strict)
    assert float(out["pred_p99_tpot_ms"]) <= 30.0 * (1 + 1e-6) or "saturation" in \
        out["pred_basis"]
    # The capacity does not read target_qps; only the latencies at it do.
    other = mlperf.predict_row(dict(strict, target_qps="2"))
    assert other["pred_result_per_accelerator"] == out["pred_result_per_accelerator"]
    assert float(other["pred_p50_ttft_ms"]) <= float(out["pred_p50_ttft_ms"])
    assert all(math.isfinite(float(out[k])) for k in (
        "pred_p50_ttft_ms", "pred_p99_ttft_ms", "pred_p50_tpot_ms", "pred_p99_tpot_ms"))


def _write(path, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(BASE))
        writer.writeheader()
        writer.writerows(rows)


def _read(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_predict_command_gives_reasons_not_crashes(tmp_path):
    path, out = tmp_path / "in.csv", tmp_path / "out.csv"
    _write(path, [row(accelerator="Cerebras WSE-3"), row(model="gpt-oss-120b")])
    assert main(["predict", str(path), "--out", str(out)]) == 0
    got = _read(out)
    assert [r["pred_result_per_accelerator"] for r in got] == ["", ""]
    assert "unknown chip" in got[0]["pred_error"]
    assert "no input-length statistic" in got[1]["pred_error"]
    assert {"pred_basis", "pred_config", "pred_p99_tpot_ms", "pred_fit"} <= set(got[0])


@pytest.mark.slow   # about 10 s: one structure evaluated over the grid
def test_predict_command_reads_an_mlperf_csv(tmp_path):
    path, out = tmp_path / "in.csv", tmp_path / "out.csv"
    _write(path, [row(), row(accelerator="Cerebras WSE-3")])
    assert main(["predict", str(path), "--out", str(out)]) == 0
    got = _read(out)
    assert float(got[0]["pred_result_per_accelerator"]) > 0 and got[0]["pred_error"] == ""
    assert got[1]["pred_result_per_accelerator"] == "" and "unknown chip" in got[1][
        "pred_error"]
