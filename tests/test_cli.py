"""The `perfmodel` command line: `pareto` on every chip preset, output formats, the plot, and
one-line errors."""

import csv
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import perfmodel as pm
from perfmodel.cli import _COMMANDS, build_parser, compilation_cache_dir, main
from perfmodel.serving import METRIC_KEYS

MODELS = ("gpt-oss-120b", "deepseek-r1", "kimi-k2.5")
# Covers every kind of path in the default run: HGX (pipeline + DP attention), NVL72, AMD,
# a torus TPU, SRAM-only Groq (thousands of chips), Jalapeno's slices. The other pairs
# (B200 is another HGX, TPU v6e a smaller torus) run with the slow tests.
FAST = {("deepseek-r1", "gb200"), ("gpt-oss-120b", "h100"), ("gpt-oss-120b", "mi355x"),
        ("deepseek-r1", "groq-lpu"), ("kimi-k2.5", "jalapeno"), ("gpt-oss-120b", "tpu-v7")}


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _check_front(rows, chip_name):
    assert rows, f"empty front on {chip_name}"
    for row in rows:
        for key in METRIC_KEYS:
            assert isinstance(row[key], float) and np.isfinite(row[key]) and row[key] > 0, key
        assert re.fullmatch(r"(\d+x)?tp\d+(-ep\d+)?(-pp\d+)?(-dpa)?", row["layout"]), row
        assert row["chips"] == row["tp"] * row["pp"] * row["replicas"]
    tput = np.array([r["tput_per_chip_total"] for r in rows])
    inter = np.array([r["interactivity"] for r in rows])
    assert np.all(np.diff(tput) > 0) and np.all(np.diff(inter) < 0)
    # Within one layout, moving along the front means adding concurrency.
    for layout in {r["layout"] for r in rows}:
        conc = [r["concurrency"] for r in rows if r["layout"] == layout]
        assert np.all(np.diff(conc) > 0), layout
    # Tokens/s per kW of TDP is throughput per chip / TDP by definition.
    chip = pm.get_chip(chip_name)
    np.testing.assert_allclose([r["tok_s_per_kw_tdp"] for r in rows],
                               tput / float(chip.tdp) * 1e3, rtol=1e-12)


COMBOS = [pytest.param(m, c, marks=() if (m, c) in FAST else pytest.mark.slow)
          for m in MODELS for c in pm.chip_names()]


@pytest.mark.parametrize("model_name, chip_name", COMBOS)
def test_pareto_json_front_on_every_chip(capsys, model_name, chip_name):
    code, out, err = _run(capsys, "pareto", "--model", model_name, "--chip", chip_name,
                          "--format", "json")
    assert code == 0, err
    assert err == ""
    data = json.loads(out)
    _check_front(data["rows"], chip_name)
    # A saved result names what it was computed from.
    inputs = data["inputs"]
    assert (inputs["model"], inputs["chip"]) == (pm.get_model(model_name).name,
                                                 pm.get_chip(chip_name).name)
    assert (inputs["isl"], inputs["osl"]) == (8192, 1024)
    assert inputs["perfmodel_version"] and "fitted_params.json" in inputs["fitted_latency"]


def test_fast_subset_is_in_the_matrix():
    assert FAST <= {(m, c) for m in MODELS for c in pm.chip_names()}


def test_default_pareto_table_and_plot(capsys, tmp_path):
    plot = tmp_path / "front.png"
    code, out, err = _run(capsys, "pareto", "--plot", str(plot))
    assert code == 0, err
    lines = out.strip().splitlines()
    header = " ".join(line.lstrip("# ") for line in lines if line.startswith("#"))
    columns, *body = [line for line in lines if not line.startswith("#")]
    assert max(len(line) for line in lines) <= 120
    assert header.startswith("deepseek-r1 on ") and "gb200" in header and "nvfp4" in header
    for name in ("conc", "layout", "tok/s/chip", "tok/s/user", "TTFT", "TPOT", "E2E", "model W",
                 "tok/s/kW", "J/out"):
        assert name in columns
    assert len(body) >= 3 and "nan" not in out.lower()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_csv_matches_json(capsys):
    argv = ("pareto", "--model", "llama-3.1-8b", "--chip", "h200", "--isl", "1024", "--osl",
            "256", "--chips", "2", "--precision", "fp8")
    code, out_json, _ = _run(capsys, *argv, "--format", "json")
    code_csv, out_csv, _ = _run(capsys, *argv, "--format", "csv")
    assert code == code_csv == 0
    data = json.loads(out_json)
    rows = data["rows"]
    table = list(csv.DictReader(io.StringIO(out_csv)))
    assert len(table) == len(rows)
    for a, b in zip(rows, table, strict=True):
        # Every CSV row carries the inputs, as the JSON does once.
        for key in ("model", "chip", "isl", "osl", "precision", "engine", "fitted_power"):
            assert b[key] == str(data["inputs"][key]), key
        assert a["layout"] == b["layout"] and a["chips"] == 2
        assert float(b["tput_per_chip_total"]) == pytest.approx(a["tput_per_chip_total"], rel=1e-12)
        assert a["precision"] == "fp8/fp8/bf16"   # weights/experts/KV


@pytest.mark.parametrize("flag, values, isl, osl, metric, sign", [
    # --output-cv2: a longer running context (Workload.decode_context: ISL + OSL (1 + cv2)
    # / 2), so each concurrency decodes more slowly.
    ("--output-cv2", ("0", "1.5"), "1024", "1024", "tpot_s", 1.0),
    # --cached-fraction: half of each 4K prompt cached, so the first token comes sooner.
    ("--cached-fraction", ("0", "0.5"), "4096", "256", "ttft_s", -1.0),
])
def test_workload_shape_flags_move_the_same_front(capsys, flag, values, isl, osl, metric,
                                                  sign):
    """The same layouts and concurrencies with the flag at two values: the metric moves in
    its direction at every shared point, and the inputs record the value."""
    argv = ("pareto", "--model", "llama-3.1-8b", "--chip", "h200", "--isl", isl, "--osl",
            osl, "--chips", "1", "--precision", "fp8", "--format", "json")
    fronts = []
    for value in values:
        code, out, err = _run(capsys, *argv, flag, value)
        assert code == 0, err
        data = json.loads(out)
        assert data["inputs"][flag[2:].replace("-", "_")] == float(value)
        fronts.append({(r["layout"], r["concurrency"]): r for r in data["rows"]})
    shared = set(fronts[0]) & set(fronts[1])
    assert shared
    for key in shared:
        assert sign * (fronts[1][key][metric] - fronts[0][key][metric]) > 0, key


@pytest.mark.parametrize("argv, names", [
    (("pareto", "--chip", "nonesuch"), ("'nonesuch'", "gb200", "h100")),
    (("pareto", "--model", "gpt-5"), ("'gpt-5'", "deepseek-r1")),
    (("pareto", "--isl", "0"), ("--isl", "0")),
    (("pareto", "--osl", "-5"), ("--osl", "-5")),
    (("pareto", "--isl", "8k"), ("--isl", "'8k'")),
    (("pareto", "--chips", "0"), ("--chips", "0")),
    (("pareto", "--model", "deepseek-r1", "--chip", "h100", "--chips", "1"),
     ("does not fit in 1 h100", "smallest count")),
    (("pareto", "--format", "xml"), ("'xml'", "table", "json", "csv")),
    (("pareto", "--precision", "fp3"), ("'fp3'", "fp8", "bf16")),
    (("pareto", "--plot", "front.txt"), ("front.txt", ".png")),
    (("pareto", "--output-cv2", "-1"), ("--output-cv2", "-1", ">= 0")),
    (("pareto", "--output-cv2", "wide"), ("--output-cv2", "'wide'")),
    (("optimize", "--output-cv2", "inf"), ("--output-cv2", "inf", "finite")),
    (("pareto", "--cached-fraction", "1"), ("--cached-fraction", "1", "[0, 1)")),
    (("optimize", "--cached-fraction", "most"), ("--cached-fraction", "'most'")),
    (("pareto", "--at-interactivity", "-1"), ("--at-interactivity", "-1", ">= 0")),
    (("predict", "calibration/data/benchmarks_inferencemax.csv", "--interval", "1"),
     ("--interval", "1", "(0, 1)", "0.9")),
    (("simulate", "--seed", "-1"), ("--seed", "-1", "[0, 2,147,483,648)")),
    (("simulate", "--rate", "0"), ("--rate", "0", "positive")),
    (("frobnicate",), ("'frobnicate'", "pareto")),
    ((), ("COMMAND",)),
])
def test_errors_are_one_line_with_the_bad_value_and_choices(capsys, argv, names):
    code, out, err = _run(capsys, *argv)
    assert code != 0
    assert out == ""
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("perfmodel: error: "), err
    for name in names:
        assert name in lines[0]
    assert "Traceback" not in err and "nan" not in err.lower()


def test_console_process_prints_no_traceback():
    done = subprocess.run([sys.executable, "-m", "perfmodel.cli", "pareto", "--chip", "tpu-v99"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("perfmodel: error: unknown chip")


def test_compilation_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("PERFMODEL_CACHE_DIR", "off")
    assert compilation_cache_dir() is None
    folder = tmp_path / "a" / "b"
    monkeypatch.setenv("PERFMODEL_CACHE_DIR", str(folder))
    assert compilation_cache_dir() == str(folder) and folder.is_dir()
    monkeypatch.delenv("PERFMODEL_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compilation_cache_dir() == str(tmp_path / ".cache" / "perfmodel" / "xla")


@pytest.mark.slow
def test_second_optimize_run_loads_compiled_kernels(tmp_path):
    """A fresh process writes the optimizer's kernels to the cache; the next one reads them
    (same answer, fewer seconds)."""
    argv = [sys.executable, "-m", "perfmodel.cli", "optimize", "--model", "llama-3.1-8b",
            "--chip", "h200", "--chips", "1", "--max-tpot-ms", "8", "--format", "json"]
    env = dict(os.environ, PERFMODEL_CACHE_DIR=str(tmp_path))
    runs = [json.loads(subprocess.run(argv, capture_output=True, text=True, env=env,
                                      timeout=600, check=True).stdout) for _ in range(2)]
    assert any(tmp_path.iterdir())
    assert runs[0]["design"] == runs[1]["design"]
    assert runs[1]["wall_s"] < runs[0]["wall_s"]


def test_help_lists_every_registered_command(capsys):
    assert "pareto" in _COMMANDS
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in _COMMANDS:
        assert name in out


@pytest.mark.parametrize("kwargs, good, bad", [
    (dict(low=0.0, high=1.0, high_open=True), ("0", "0.5", "0.999"), ("1", "-0.0001", "nan")),
    (dict(low=0.0, low_open=True), ("1e-9", "3"), ("0", "-1", "inf")),
    (dict(low=1, high=10, integer=True), ("1", "10"), ("0", "11", "2.5", "1e1")),
    (dict(high=5.0), ("-7", "5"), ("5.5", "-inf")),
])
def test_number_type_takes_its_range_and_refuses_the_rest(kwargs, good, bad):
    """The argparse number type the commands share (counts, rates, seeds, shares): each
    bound open or closed as asked, integers only when asked, never NaN or an infinity, and
    the refusal names the value as typed."""
    import argparse

    from perfmodel.commands import number

    parse = number(**kwargs)
    for text in good:
        assert parse(text) == (int(text) if kwargs.get("integer") else float(text))
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=f"^'?{re.escape(text)}"):
            parse(text)
