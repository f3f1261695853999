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
        # The Offline run's drain reads the output cap and LoadGen's least sample count.
        assert "mlperf.conf" in entry["run_basis"] or "ASSUMED" in entry["run_basis"], name
        assert float(entry["output_tokens_max"]) >= float(entry["output_tokens_mean"])
        assert int(entry["min_query_count"]) >= 1000
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
    assert "data-set means" in offline["pred_basis"] and "drain" in offline["pred_basis"]
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


def test_output_spread_reaches_the_spec_where_the_data_set_publishes_one():
    lengths = mlperf.dataset_lengths()
    assert all(e["output_cv2_basis"] for e in lengths.values())
    r1 = mlperf.interpret(row(model="deepseek-r1", accelerator="NVIDIA B200-SXM-180GB",
                              weight_data_types="fp4", software="TensorRT 10.11"))
    assert r1.output_cv2 == pytest.approx(1.42)
    assert mlperf.interpret(row()).output_cv2 == 0.0
    assert r1.structure()[-1] == r1.output_cv2
    # A censored lognormal with the data set's median and mean: the stated spread.
    import numpy as np

    z = np.linspace(-8.0, 8.0, 200_001)
    w = np.exp(-0.5 * z ** 2) / np.exp(-0.5 * z ** 2).sum()
    out = np.minimum(np.exp(np.log(2108.0) + 1.2117 * z), 20_000.0)
    mean = float(w @ out)
    assert mean == pytest.approx(float(lengths["deepseek-r1"]["output_tokens_mean"]), rel=1e-3)
    assert float(w @ out ** 2) / mean ** 2 - 1.0 == pytest.approx(1.42, abs=0.01)


def test_length_biased_context_costs_throughput_and_batch():
    """A spread of output lengths at the same means lengthens the running batch's context:
    less throughput at the same batch, a smaller batch that fits; no spread is the mean
    lengths exactly."""
    import jax.numpy as jnp

    from perfmodel import Design, Layout, get_chip, get_model, precision, predict
    from perfmodel.sweep import batch_that_fits
    from perfmodel.workload import Workload

    chip, model = get_chip("h200"), get_model("llama-3.1-8b")
    design = Design(concurrency=64.0, layout=Layout(tp=1), precision=precision(chip, model))
    base = mlperf.fixed_lengths(800.0, 3886.0)
    assert float(base.decode_context) == 800.0 + 3886.0 / 2.0
    plain = Workload(800.0, 3886.0, 1.0, 1.0, first_wave_fraction=1e-6)
    same = predict(model, chip, plain, design, hard=True)
    zero = predict(model, chip, base, design, hard=True)
    assert float(zero.throughput_per_chip) == float(same.throughput_per_chip)
    spread = predict(model, chip, mlperf.fixed_lengths(800.0, 3886.0, 1.42), design,
                     hard=True)
    assert float(spread.throughput_per_chip) < 0.97 * float(zero.throughput_per_chip)
    fits = [batch_that_fits(model, chip, design.precision, design.runtime, design.layout,
                            float(w.decode_context))
            for w in (base, mlperf.fixed_lengths(800.0, 3886.0, 1.42))]
    assert fits[1] < 0.6 * fits[0]
    with pytest.raises(ValueError, match="output_cv2"):
        Workload(800.0, 3886.0, output_cv2=jnp.asarray(-0.1))


def test_every_layout_of_a_structure_in_one_evaluation(monkeypatch):
    """`configurations` evaluates all candidate layouts of a structure together (layouts
    as numbers, padded to `LAYOUT_ROWS`): one `over_concurrency` call per speculative
    setting, each layout's numbers those of its own static-layout evaluation."""
    import dataclasses

    import numpy as np

    from perfmodel import fitted
    from perfmodel.design import Design, Layout, SliceMapping, precision
    from perfmodel.presets import get_chip, get_model

    spec = mlperf.interpret(row(accel_per_node="8", total_accelerators="8",
                                software="TensorRT-LLM 1.0"))
    calls = []
    real = mlperf.over_concurrency
    monkeypatch.setattr(mlperf, "over_concurrency",
                        lambda *a: calls.append(a[-1].shape) or real(*a))
    mlperf._configurations.cache_clear()
    configs = mlperf.configurations(spec)
    mlperf._configurations.cache_clear()
    assert len(calls) == 1
    assert calls[0][0] % mlperf.LAYOUT_ROWS == 0
    assert len(configs.labels) >= 3             # several tensor-parallel degrees
    model, chip = get_model(spec.model), get_chip(spec.chip)
    kv = "fp8" if "fp8" in chip.native_classes else None
    prec = precision(chip, model, spec.weights, kv=kv)
    runtime = fitted.runtime_for(spec.framework, reserve_output=0.0)
    workload = mlperf.fixed_lengths(spec.input_len, spec.output_len, spec.output_cv2)
    for i, label in enumerate(configs.labels):
        layout = dataclasses.replace(Layout.parse(label), replicas=1)
        design = Design(concurrency=1.0, layout=layout, precision=prec, runtime=runtime,
                        mapping=SliceMapping())
        m = real(model, chip, workload, design, np.asarray(configs.concurrency[i]))
        want = np.broadcast_to(np.asarray(m.output_throughput_per_chip),
                               configs.concurrency[i].shape)
        got = configs.values["output_tput_per_chip"][i]
        ok = np.isfinite(got)
        assert ok.any()
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-12)


def test_deepseek_r1_outputs_as_a_censored_lognormal_match_the_reported_median():
    """The output distribution the Offline drain reads: a lognormal censored at the
    20,000-token cap, fitted to the data set's mean (3,886) and Var/mean^2 (1.42) only,
    puts its median at NVIDIA's reported 2,108 (v6.1 report.txt, not an input) and more
    than 1 % of outputs at the cap (reported p99: 20,000)."""
    import numpy as np

    lengths = mlperf.censored_lognormal(3886.2274, 1.42, 20000.0)
    assert lengths.mean() == pytest.approx(3886.2274, rel=1e-6)
    assert lengths.var() / lengths.mean() ** 2 == pytest.approx(1.42, rel=1e-4)
    assert np.median(lengths) == pytest.approx(2108.0, rel=0.02)
    assert 0.01 < np.mean(lengths >= 20000.0) < 0.05
    # The remainder of a request in flight has mean E[L^2] / (2 E[L]) (renewal theory).
    mean, longest = mlperf.residual_tail(3886.2274, 1.42, 20000.0, 2048.0)
    assert mean == pytest.approx(2.42 * 3886.2274 / 2.0, rel=1e-6)
    assert 19000.0 < longest <= 20000.0
    assert mlperf.residual_tail(300.0, 0.0, 1024.0, 1000.0) == pytest.approx((150.0, 299.7))


def _drain(lengths, batch, t0, per_seq):
    """Output tokens/s of a run that starts `batch` requests and refills each finished
    slot from the queue until it is empty, every step lasting t0 + per_seq x (requests
    running), over the whole run (event by event: one step per token of the shortest)."""
    import numpy as np

    queue = np.asarray(lengths, dtype=np.int64)
    left, issued, clock = queue[:batch].copy(), batch, 0.0
    while left.size:
        steps = left.min()
        clock += steps * (t0 + per_seq * left.size)
        left = left - steps
        done = int((left == 0).sum())
        left = left[left > 0]
        take = min(done, len(queue) - issued)
        left = np.concatenate([left, queue[issued:issued + take]])
        issued += take
    return queue.sum() / clock


@pytest.mark.parametrize("mean, cv2, cap, batch", [
    (3886.2274, 1.42, 20000.0, 256),    # DeepSeek-R1: the drain takes about a fifth of the run
    (3886.2274, 1.42, 20000.0, 2048),
    (144.84, 0.606, 1024.0, 256),       # Mixtral: bounded outputs, a per cent or two
])
def test_offline_run_efficiency_matches_a_simulated_drain(mean, cv2, cap, batch):
    """`run_efficiency`'s closed form (the steady part plus t0 x (longest - mean remainder))
    against a run simulated request by request with the same step-time law, lengths drawn
    from the same distribution and a sample count that makes the steady part 700 s."""
    import numpy as np

    t0, per_seq = 0.012, 5e-5
    steady = batch / (t0 + per_seq * batch)            # tokens/s
    samples = int(700.0 * steady / mean)
    draws = np.random.default_rng(0).choice(
        np.maximum(np.round(mlperf.censored_lognormal(mean, cv2, cap)), 1.0), samples)
    simulated = _drain(draws, batch, t0, per_seq) / steady
    spec = mlperf.RowSpec(
        benchmark="x", model="m", chip="c", scenario="Offline", weights="fp8",
        framework="vllm", accelerators=1, domain=1, input_len=1.0, output_len=mean,
        ttft_limit=math.inf, tpot_limit=math.inf, speculative=False, output_cv2=cv2,
        output_max=cap, min_samples=samples)
    efficiency = mlperf.run_efficiency(spec, steady / draws.mean(), batch, t0 + per_seq)
    assert efficiency == pytest.approx(simulated, abs=0.012)
    assert efficiency < 1.0
    # No tail, no loss; a slower tail, a longer drain.
    assert mlperf.run_efficiency(spec, steady / draws.mean(), batch, 0.0) == 1.0
    assert mlperf.run_efficiency(spec, steady / draws.mean(), batch, 2 * t0) < efficiency
