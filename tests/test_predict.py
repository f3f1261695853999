"""`perfmodel predict`: every row out, predictions or a reason, deterministic, fast."""

import csv
import math
import pathlib
import time

import pytest

from perfmodel import calibration as cal
from perfmodel.commands import predict as command
from perfmodel.datasets import DataError

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "calibration" / "data" / "benchmarks_inferencemax.csv"

AGG = ("model,hardware,framework,precision,spec_decoding,disagg,isl,osl,conc,tp,ep,"
       "dp_attention,prefill_tp,prefill_ep,prefill_dp_attention,prefill_num_workers,decode_tp,"
       "decode_ep,decode_dp_attention,decode_num_workers,num_prefill_gpu,num_decode_gpu,"
       "tput_per_gpu\n")
ROWS = [
    "gpt-oss-120b,b200,vllm,fp4,none,False,1024,1024,64,2,1,False,,,,,,,,,,,8575",
    "gpt-oss-120b,h100,vllm,fp4,none,False,1024,1024,64,2,1,False,,,,,,,,,,,",
    "DeepSeek-R1-0528,gb200,dynamo-trt,fp4,mtp,True,8192,1024,64,,,,4,4,False,1,8,8,False,"
    "3,4,24,",
    "DeepSeek-R1-0528,jalapeno,trt,fp4,none,False,8192,1024,64,8,8,True,,,,,,,,,,,",
    "gpt-oss-120b,nonesuch-chip,vllm,fp4,none,False,1024,1024,64,2,1,False,,,,,,,,,,,",
    "no-such-model,b200,vllm,fp4,none,False,1024,1024,64,2,1,False,,,,,,,,,,,",
]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("predict") / "in.csv"
    path.write_text(AGG + "\n".join(ROWS) + "\n")
    return path


@pytest.fixture(scope="module")
def result(small):
    return command.predict_file(str(small))


def test_every_row_out_with_predictions_or_reason(result):
    columns, rows = result
    assert len(rows) == len(ROWS)
    for key in cal.PREDICTION_KEYS + ("pred_basis", "pred_error"):
        assert key in columns
    for row in rows[:4]:
        for key in cal.PREDICTION_KEYS:
            value = float(row[key])
            assert math.isfinite(value) and value > 0, (key, row)
    for row, word in ((rows[4], "chip"), (rows[5], "model")):
        assert row["pred_tput_per_chip_total"] == ""
        assert f"unknown {word}" in row["pred_error"]


def test_basis_says_how_unmeasured_chips_are_predicted(result):
    _, rows = result
    assert rows[0]["pred_basis"].startswith(("fitted:blackwell", "specs"))
    assert "jalapeno" in rows[3]["pred_basis"]
    if cal_params():
        assert "blackwell" in rows[3]["pred_basis"]
    if "measured_chips" in cal_params():
        assert "h100 not measured" in rows[1]["pred_basis"]


def cal_params():
    from perfmodel import fitted
    return fitted.read(fitted.LATENCY_FILE)


def test_input_columns_kept(result, small):
    _, rows = result
    with open(small) as handle:
        original = list(csv.DictReader(handle))
    for out, inp in zip(rows, original, strict=True):
        for key, value in inp.items():
            assert out[key] == value


def test_metrics_consistent(result):
    _, rows = result
    row = rows[0]
    tpot = float(row["pred_tpot_s"])
    assert float(row["pred_interactivity"]) == pytest.approx(1 / tpot, rel=1e-5)
    assert float(row["pred_p99_tpot_s"]) >= tpot * (1 - 1e-6)
    assert float(row["pred_output_tput_per_chip"]) < float(row["pred_tput_per_chip_total"])


def test_deterministic(small, result):
    again = command.predict_file(str(small))
    assert again == result


def test_corrupt_input_names_line_and_column(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(AGG + ROWS[0].replace(",1024,1024,64,", ",1024,1024,lots,") + "\n")
    with pytest.raises(DataError, match=r"bad\.csv, line 2, column 'conc'"):
        command.predict_file(str(path))
    path.write_text("model,hardware\nx,y\n")
    with pytest.raises(DataError, match="missing column"):
        command.predict_file(str(path))


def test_measured_columns_prediction_does_not_read_may_hold_anything(tmp_path):
    """A NaN or a note in a measured column rejected the whole file; prediction does not
    read those columns, so the rows are predicted as they would be without them."""
    path = tmp_path / "in.csv"
    path.write_text(AGG + ROWS[0].replace(",8575", ",nan") + "\n"
                    + ROWS[0].replace(",8575", ",n/a") + "\n" + ROWS[0] + "\n")
    _, rows = command.predict_file(str(path))
    assert [r["pred_error"] for r in rows] == ["", "", ""]
    assert len({r["pred_tput_per_chip_total"] for r in rows}) == 1
    assert rows[0]["tput_per_gpu"] == "nan"   # the input is repeated as it was


def test_cli_writes_csv(small, tmp_path):
    from perfmodel import cli
    assert "predict" in cli._COMMANDS
    out = tmp_path / "out.csv"
    assert cli.main(["predict", str(small), "--out", str(out)]) == 0
    with open(out) as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(ROWS) and "pred_tput_per_chip_total" in rows[0]
    assert cli.main(["predict", str(tmp_path / "missing.csv")]) == 2


def test_power_rows_are_delegated(tmp_path):
    path = tmp_path / "power.csv"
    path.write_text("model,hardware,num_gpus,parallelism,framework,precision,max_batch_size,"
                    "osl\nmeta-llama/Llama-3.1-8B-Instruct,H100,1,TP1,vLLM 0.11.1,bfloat16,"
                    "64,400\n")
    columns, rows = command.predict_file(str(path))
    assert "pred_power_w_modelled" in columns
    assert rows[0]["pred_status"] == "ok"
    # --interval reaches them too: power, J per output token and output tokens/s.
    columns, rows = command.predict_file(str(path), interval=0.9)
    for key in ("pred_power_w_modelled", "pred_j_per_output_token",
                "pred_output_tput_per_chip"):
        assert {key + "_lo", key + "_hi"} <= set(columns)
        assert rows[0][key + "_lo"] < rows[0][key] <= rows[0][key + "_hi"]


@pytest.mark.slow
def test_whole_inferencemax_file_under_a_minute():
    start = time.time()
    _, rows = command.predict_file(str(DATA))
    elapsed = time.time() - start
    assert elapsed < 60.0
    assert all(r["pred_tput_per_chip_total"] != "" for r in rows)


@pytest.mark.slow
def test_cli_interval_columns_bracket_the_predictions(small, tmp_path):
    """`--interval 0.9` (the shipped fitted_intervals.json): lo <= prediction <= hi for
    every latency and throughput column of rows with a prediction, empty bounds where there
    is none; a level outside (0, 1) is refused."""
    from perfmodel import cli
    from perfmodel.calibration.intervals import INTERVAL_KEYS
    out = tmp_path / "out.csv"
    assert cli.main(["predict", str(small), "--interval", "0.9", "--out", str(out)]) == 0
    with open(out) as handle:
        rows = list(csv.DictReader(handle))
    from perfmodel.calibration.predict import POWER_INTERVAL_KEYS
    for row in rows:
        for key in INTERVAL_KEYS + POWER_INTERVAL_KEYS:
            if row[key] == "":
                assert row[key + "_lo"] == row[key + "_hi"] == ""
                continue
            lo, pred, hi = (float(row[key + s]) for s in ("_lo", "", "_hi"))
            assert all(math.isfinite(v) for v in (lo, pred, hi))
            assert lo <= pred * (1 + 1e-5) and pred <= hi * (1 + 1e-5), (key, row)
    # The b200 row (its family's own fit) is narrower than the jalapeno one (predicted with
    # blackwell's fit: the between-family spread is added).
    width = [float(r["pred_tpot_s_hi"]) / float(r["pred_tpot_s_lo"]) for r in rows[:4]]
    assert width[0] < width[3]
    assert cli.main(["predict", str(small), "--interval", "1.5"]) == 2


def test_one_eager_evaluation_per_model_chip_and_precision(monkeypatch):
    """`predict_rows` evaluates the rows of one model, chip and precision together, their
    layouts (disaggregated pools too) as per-row numbers: one evaluation for several
    layouts, with the numbers of each row evaluated on its own static layout."""
    import numpy as np

    from perfmodel import fitted
    from perfmodel.calibration import data
    from perfmodel.calibration import predict as module
    from perfmodel.calibration.params import from_json
    from perfmodel.datasets import load_benchmarks

    rows = [r for r in load_benchmarks(str(DATA)) if r.hardware == "gb200" and r.disaggregated
            and r.model == "DeepSeek-R1" and r.precision == "fp8"][:24]
    rows += [r for r in load_benchmarks(str(DATA)) if r.hardware == "b200"
             and r.model == "gpt-oss-120b"][:24]
    groups, errors = data.build_groups(rows)
    assert not errors and len(groups) >= 4       # several layouts of each model and chip
    calls = []
    monkeypatch.setattr(module, "row_metrics",
                        lambda *a, **k: calls.append(1) or cal.row_metrics(*a, **k))
    out = module.predict_rows(rows)
    assert len(calls) == 2
    params = from_json(fitted.read(fitted.LATENCY_FILE))
    position = {r.index: k for k, r in enumerate(rows)}
    for g in groups:
        raw = params.family_raw[params.families.index(g.family)]
        chip = fitted.apply(g.chip, latency={})
        want = cal.row_metrics(g.model, chip, g.design, raw,
                               data.framework_rows(g.rows, params),
                               **data.row_inputs(g.rows)).to_row("pred_")
        for j, row in enumerate(g.rows):
            got = out[position[row.index]]
            for key in module.PREDICTION_KEYS:
                expected = np.broadcast_to(want[key], (len(g.rows),))[j]
                assert got[key] == pytest.approx(float(expected), rel=1e-12), key
