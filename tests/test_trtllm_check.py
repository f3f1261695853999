"""The TensorRT-LLM Offline table check (`calibration/trtllm_check.py`)."""

import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "calibration"))

import trtllm_check  # noqa: E402


def test_rows_are_the_offline_output_tables_per_gpu():
    rows = trtllm_check.load_rows()
    new = [r for r in rows if r["table"] == "~v1.0"]
    old = [r for r in rows if r["table"] == "v0.17"]
    assert len(new) == 210 and len(old) == 328   # v0.17's 27 Mistral 7B rows: no preset
    assert {r["chip"] for r in new} == {"b200", "gb200", "h100", "h200"}
    assert {r["chip"] for r in old} == {"a100-80gb", "gh200", "h100", "h200", "l40s"}
    assert all(r["measured"] > 0 and r["tp"] * r["pp"] == r["gpus"] for r in rows)
    # Llama-3.1-8B FP8 on one H200, 128/128: the ~v1.0 table's 27,911 tokens/s of one GPU.
    one = [r for r in new if r["model"] == "llama-3.1-8b" and r["chip"] == "h200"
           and r["isl"] == 128 and r["osl"] == 128]
    assert [r["measured"] for r in one] == [27911.0]
    # Llama-3.1-70B FP8 on L40S, TP4, 128/128: v0.17's 1,523.52 tokens/s of the group.
    four = [r for r in old if r["model"] == "llama-3.1-70b" and r["chip"] == "l40s"
            and r["tp"] == 4 and r["isl"] == 128 and r["osl"] == 128]
    assert [r["measured"] for r in four] == [pytest.approx(1523.52 / 4)]
    assert trtllm_check.load_rows(tables=("~v1.0",)) == new


def test_the_v017_table_counts_output_tokens():
    """Where both tables measured the same H100 configuration, v0.17 agrees with ~v1.0's
    output tokens/s; had it counted input tokens too it would read (ISL + OSL) / OSL times
    more (up to 17x at 2048/128)."""
    checks = trtllm_check.metric_check()
    assert len(checks) == 18
    assert {c[0] for c in checks} == {"llama-3.1-8b", "llama-3.1-70b"}
    assert all(0.9 < c[-1] < 1.1 for c in checks)
    assert max((isl + osl) / osl for _, _, isl, osl, _ in checks) > 10


def test_the_deepseek_blog_rows_carry_their_published_configuration():
    """The five DeepSeek-R1 runs of TensorRT-LLM's best-practice blog, each configuration
    read from its own row: the B200 FP8-KV max-throughput run is DP8 attention with EP8,
    FP4 weights and an FP8 cache at 7,168 requests; the min-latency runs are one request
    with three MTP draft tokens; nothing else in the data file is taken."""
    rows = {r["label"]: r for r in trtllm_check.load_blog_rows()}
    assert len(rows) == 5
    fp8 = rows["B200 max-throughput R1-0528 FP8 KV"]
    assert (fp8["chip"], fp8["tp"], fp8["ep"], fp8["dp_attention"], fp8["weights"],
            fp8["kv"], fp8["draft"], fp8["concurrency"]) == ("b200", 8, 8, True, "fp4",
                                                              "fp8", 0.0, 7168.0)
    assert fp8["measured"] == pytest.approx(43146.2042)
    assert rows["B200 max-throughput R1 FP16 KV"]["kv"] == "bf16"
    for label in ("B200 min-latency", "H200 min-latency"):
        r = rows[label]
        assert (r["concurrency"], r["draft"], r["dp_attention"]) == (1.0, 3.0, False)
    assert rows["H200 min-latency"]["weights"] == "fp8"
    assert {(r["isl"], r["osl"], r["gpus"]) for r in rows.values()} == {(1024.0, 2048.0, 8)}


def test_gemm_fractions_are_below_peak_and_narrow_formats_reach_less():
    text = trtllm_check.gemm_fractions()
    spans = {" ".join(p.split()[:2]): tuple(map(float, p.split()[2].split("-")))
             for p in text.split("; ")}
    assert all(0 < lo <= hi <= 100 for lo, hi in spans.values())
    assert spans["b200 nvfp4"][1] < spans["b200 bfloat16"][1]


@pytest.mark.slow   # compiles the serving model over the batch grid
def test_a_row_is_predicted_at_its_own_layout_and_fits():
    row = next(r for r in trtllm_check.load_rows()
               if r["model"] == "llama-3.1-70b" and r["chip"] == "h200" and r["isl"] == 1000
               and r["osl"] == 1000)
    out = trtllm_check.predict_row(row)
    assert out["error"] == "" and math.isfinite(out["predicted"]) and out["batch"] >= 1
    # Per GPU, within a factor of two of the measured table (0.95x when written).
    assert 0.5 < out["predicted"] / row["measured"] < 2.0


@pytest.mark.slow   # compiles the serving model over the batch grid
def test_long_prompts_are_not_biased_low():
    """Llama's full attention runs at FlashAttention's efficiency, not the fitted one of
    MLA and windowed kernels: the prefill-heavy rows of one H100 (Llama-3.1-8B FP8, ~v1.0)
    sit within 25 % of the table (0.52-0.79x when every attention kernel ran at the fitted
    0.07 of peak)."""
    rows = [r for r in trtllm_check.load_rows(tables=("~v1.0",))
            if r["model"] == "llama-3.1-8b" and r["chip"] == "h100"
            and (r["isl"], r["osl"]) in ((2048, 128), (5000, 500), (20000, 2000))]
    assert len(rows) == 3
    for row in rows:
        ratio = trtllm_check.predict_row(row)["predicted"] / row["measured"]
        assert 0.8 < ratio < 1.25, (row["isl"], row["osl"], ratio)


def test_engine_limits_follow_trtllm_bench_rules():
    rows = trtllm_check.load_rows()
    short = next(r for r in rows if r["model"] == "qwen3-30b-a3b" and r["chip"] == "b200"
                 and r["isl"] == 128 and r["osl"] == 128)
    # Memory for far more than 4,096 requests: the cap, and 4,096 x (1 + 128/128) tokens.
    assert trtllm_check.engine_limits(short) == (4096, 8192)
    long = next(r for r in rows if r["model"] == "llama-3.1-405b" and r["chip"] == "h200"
                and r["isl"] == 20000)
    bs, tokens = trtllm_check.engine_limits(long)
    # Few requests of 22k tokens fit: the floor of 64 and rounding up to a multiple of 32.
    assert bs >= 64 and bs % 32 == 0 and tokens >= 2048 and tokens % 256 == 0


def _fit_row():
    rows = trtllm_check.load_rows()
    return next(r for r in trtllm_check.bench_rows(rows)
                if r.model == "llama-3.1-8b" and r.hardware == "h200" and r.isl == 1000
                and r.osl == 1000)


def test_bench_rows_carry_the_engine_and_the_total_throughput():
    rows = trtllm_check.load_rows(tables=("~v1.0",))
    fit_rows = trtllm_check.bench_rows(rows)
    assert len(fit_rows) == sum(r["pp"] == 1 for r in rows)
    assert len({r.index for r in fit_rows}) == len(fit_rows)
    assert all(r.index >= trtllm_check.INDEX_BASE for r in fit_rows)
    row = _fit_row()
    table = next(r for r in rows if r["line"] == row.line)
    cap, tokens = trtllm_check.engine_limits(table)
    assert row.framework == "trtllm-bench" and row.kv == "fp8"
    assert row.range_ratio == 1.0 and row.first_wave < 1e-3
    assert row.max_batched_tokens == tokens and 1 <= row.conc <= cap
    # InferenceMAX's metric: input and output tokens per second per GPU.
    assert row.measured["tput_per_gpu"] == pytest.approx(table["measured"] * 2.0)


def test_the_fit_path_reads_a_rows_lengths_budget_and_kv_format():
    """A fit row's prediction is `serving.predict` of its own workload (fixed lengths, no
    opening burst), token budget and KV format under the same parameters; changing the
    lengths, the KV format or the budget changes it (none is dropped on the way)."""
    import dataclasses

    import numpy as np

    from perfmodel import calibration as cal
    from perfmodel import fitted
    from perfmodel.design import Design, Layout, Runtime, precision
    from perfmodel.presets import get_chip, get_model
    from perfmodel.serving import predict
    from perfmodel.workload import Workload

    row = _fit_row()
    params = cal.from_json(fitted.read(fitted.LATENCY_FILE))

    def via_fit(r, metric="tput_per_gpu"):
        problem = cal.Calibration([r])
        return float(problem.predict(params)[metric][0])

    chip = cal.with_family(get_chip("h200", calibrated=False),
                           params.family_raw[params.families.index("hopper")])
    raw = params.framework_raw[params.frameworks.index("trt")]
    # TensorRT-LLM's memory rules (`FRAMEWORK_SETTINGS`): KV from the free memory, the
    # whole output reserved at admission.
    runtime = Runtime(**cal.runtime_values(cal.framework_values(raw)),
                      max_batched_tokens=row.max_batched_tokens,
                      fraction_of_free=1.0, reserve_output=1.0)
    model = get_model("llama-3.1-8b")
    design = Design(concurrency=row.conc, layout=Layout(tp=1),
                    precision=precision(chip, model, "fp8", kv="fp8", emulate=True),
                    runtime=runtime)
    workload = Workload(row.isl, row.osl, input_range_ratio=1.0, output_range_ratio=1.0,
                        first_wave_fraction=row.first_wave)
    direct = predict(model, chip, workload, design, check=False, unfit="value")
    got = via_fit(row)
    np.testing.assert_allclose(got, float(direct.throughput_per_chip), rtol=1e-9)
    for change in ({"range_ratio": 0.5}, {"kv": None}):
        assert abs(via_fit(dataclasses.replace(row, **change)) / got - 1.0) > 1e-4, change
    np.testing.assert_allclose(via_fit(row, "median_ttft_s"), float(direct.ttft), rtol=1e-9)
    # The token budget: one request's 1,000-token prompt split over two steps of 512 tokens
    # takes longer to its first token. (The opening burst shapes the p99 TTFT only, which
    # the fit does not read.)
    alone = dataclasses.replace(row, conc=1.0)
    assert via_fit(dataclasses.replace(alone, max_batched_tokens=512.0), "median_ttft_s") \
        > 1.01 * via_fit(alone, "median_ttft_s")


@pytest.mark.slow   # compiles the serving model for five structures
def test_the_deepseek_blog_runs_are_predicted_at_their_own_configuration():
    """Each blog run predicted at its own concurrency fits in memory with a finite output
    rate, and a max-throughput run's system output is above a min-latency run's."""
    rows = {r["label"]: dict(r, **trtllm_check.predict_blog_row(r))
            for r in trtllm_check.load_blog_rows()}
    assert all(r["fits"] and math.isfinite(r["predicted"]) and r["predicted"] > 0
               for r in rows.values())
    assert rows["B200 max-throughput R1 FP16 KV"]["predicted"] \
        > 50 * rows["B200 min-latency"]["predicted"]
