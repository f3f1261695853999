"""What the worst tenth of held-out rows have in common (`calibration/validate.py`,
`tail`)."""

import pathlib
import sys

import numpy as np

import perfmodel.datasets as ds

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "calibration"))

import validate  # noqa: E402


def _row(index, isl, mtp, dp, measured):
    pool = ds.PoolLayout(8, 8, dp)
    return ds.BenchRow(index, index + 2, "DeepSeek-R1-0528", "gb200", "dynamo-trt", "fp4",
                       isl, 1024.0, 64.0, mtp, None, ds.PoolLayout(4, 4, False), pool,
                       measured)


def test_tail_groups_the_worst_tenth_by_layout_length_and_mtp():
    # Twenty rows within 1 %, two 40 % slow (TPOT over-predicted) at 8K with MTP under DP
    # attention, one 30 % fast at 1K without MTP; one row without a TPOT measurement.
    rows = [_row(k, 1024.0, False, False, {"median_tpot_s": 0.01}) for k in range(20)]
    rows += [_row(20, 8192.0, True, True, {"median_tpot_s": 0.01}),
             _row(21, 8192.0, True, True, {"median_tpot_s": 0.01}),
             _row(22, 1024.0, False, False, {"median_tpot_s": 0.01}),
             _row(23, 1024.0, False, False, {})]
    predicted = np.array([0.0101] * 20 + [0.014, 0.014, 0.007, 0.01])
    pairs = [(r, k) for k, r in enumerate(rows)]
    out = validate.tail(pairs, {"median_tpot_s": predicted}, np.ones(len(rows), bool),
                        "median_tpot_s")
    assert out["n"] == 3
    assert out["groups"] == [
        {"model": "deepseek-r1", "chip": "gb200", "framework": "dynamo-trt",
         "attention": "DP", "serving": "disaggregated", "isl": 8192, "mtp": "MTP",
         "under": 0, "over": 2},
        {"model": "deepseek-r1", "chip": "gb200", "framework": "dynamo-trt",
         "attention": "-", "serving": "disaggregated", "isl": 1024, "mtp": "-",
         "under": 1, "over": 0}]
    text = validate.tail_markdown("t", out, "median TPOT")
    assert "| deepseek-r1 | gb200 | dynamo-trt | DP | disaggregated | 8,192 | MTP | 0 | 2 |" \
        in text


def test_tail_of_rows_without_the_metric_is_empty():
    rows = [_row(0, 1024.0, False, False, {})]
    out = validate.tail([(rows[0], 0)], {"median_ttft_s": np.array([1.0])}, np.ones(1, bool),
                        "median_ttft_s")
    assert out["n"] == 0 and out["groups"] == []
