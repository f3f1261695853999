"""The TensorRT-LLM Offline table check (`calibration/trtllm_check.py`)."""

import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "calibration"))

import trtllm_check  # noqa: E402


def test_rows_are_the_offline_output_table_per_gpu():
    rows = trtllm_check.load_rows()
    assert len(rows) == 210
    assert {r["chip"] for r in rows} == {"b200", "gb200", "h100", "h200"}
    assert all(r["measured"] > 0 and r["tp"] * r["pp"] == r["gpus"] for r in rows)
    # Llama-3.1-8B FP8 on one H200, 128/128: the table's 27,911 tokens/s of one GPU.
    one = [r for r in rows if r["model"] == "llama-3.1-8b" and r["chip"] == "h200"
           and r["isl"] == 128 and r["osl"] == 128]
    assert [r["measured"] for r in one] == [27911.0]


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
