"""Names resolve exactly: a preset key, a documented alias or Hugging Face id, optionally
with qualifier tokens; anything else is an error naming the closest presets, never a
prefix match that silently runs another chip or model."""

import csv
import io
import subprocess
import sys

import pytest

from perfmodel import presets
from perfmodel.cli import main

NOT_A_CHIP = ["gb2000", "b2000x", "h2000", "rubin-cpx", "jalapeno2", "tpu-v7x-pro"]
NOT_A_MODEL = ["kimi-k2-thinking", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "gpt-oss-1200b",
               "llama-3.1-70b-vision"]


@pytest.mark.parametrize("name", NOT_A_CHIP)
def test_typos_and_other_chips_are_errors(name):
    with pytest.raises(ValueError, match="unknown chip .*did you mean"):
        presets.chip_key(name)
    with pytest.raises(ValueError, match="unknown chip"):
        presets.get_chip(name)


@pytest.mark.parametrize("name", NOT_A_MODEL)
def test_other_models_are_errors(name):
    with pytest.raises(ValueError, match="unknown model"):
        presets.model_key(name)
    with pytest.raises(ValueError, match="unknown model"):
        presets.find_model(name)


@pytest.mark.parametrize("name,key", [
    ("GB200", "gb200"), ("b200-trt", "b200"), ("h200_sxm", "h200"), ("B200-SXM-180GB", "b200"),
    ("GB200-186GB_aarch64", "gb200"), ("mi300x-nps1-spx-192gb-750w", "mi300x"),
    ("NVIDIA H100", "h100")])
def test_qualified_chip_names(name, key):
    assert presets.chip_key(name) == key


@pytest.mark.parametrize("name,key", [
    ("DeepSeek-R1-0528", "deepseek-r1"), ("nvidia/DeepSeek-R1-0528-FP4", "deepseek-r1"),
    ("Qwen/Qwen3-235B-A22B-Instruct-2507-FP8", "qwen3-235b-a22b"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"), ("llama2-70b-99.9", "llama-2-70b"),
    ("meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8", "llama-4-maverick")])
def test_qualified_model_names(name, key):
    assert presets.model_key(name) == key


def test_measurement_labels_need_label_mode():
    label = "Dell PowerEdge XE9680 (8x H100-SXM-80GB, TensorRT)"
    assert presets.chip_key(label, label=True) == "h100"
    with pytest.raises(ValueError):
        presets.chip_key(label)
    assert presets.model_key("llama3.1-8b (Llama-3.1-8B-Instruct, CNN-DailyMail)",
                             label=True) == "llama-3.1-8b"
    # A label names a chip only through an exact name, not a longer word.
    with pytest.raises(ValueError):
        presets.chip_key("Acme (8x B2000-SXM)", label=True)


def test_non_string_name_is_a_clear_error():
    with pytest.raises(ValueError, match="chip name must be a string"):
        presets.chip_key(200)


def test_cli_refuses_a_typo_before_any_work(capsys):
    assert main(["pareto", "--chip", "gb2000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("perfmodel: error: unknown chip 'gb2000'; did you mean gb200")
    assert "\n" not in err


def test_cli_runs_a_shipped_hugging_face_model(capsys):
    assert main(["pareto", "--model", "Qwen/Qwen3-8B", "--chip", "h100", "--chips", "1",
                 "--isl", "1024", "--osl", "256", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) > 1 and all(r["model"] == "Qwen/Qwen3-8B" for r in rows)


def test_installed_command_exits_2_on_a_typo():
    done = subprocess.run([sys.executable, "-m", "perfmodel.cli", "pareto", "--model",
                           "kimi-k2-thinking"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "unknown model 'kimi-k2-thinking'; did you mean kimi-k2" in done.stderr
    assert "Traceback" not in done.stderr


#: Each command that takes --model and --chip, with what else it needs to reach them.
_NAMED = {"pareto": [], "optimize": [], "simulate": ["--rate", "1"],
          "policy": ["--rate", "1", "--max-ttft-p99-ms", "500", "--max-tpot-p99-ms", "50"]}


@pytest.mark.parametrize("option,name", [("--chip", "gb2000"), ("--model", "kimi-k2-thinking")])
def test_every_command_refuses_a_bad_name_alike(capsys, option, name):
    errors = {}
    for command, needs in _NAMED.items():
        assert main([command, *needs, option, name]) == 2
        errors[command] = capsys.readouterr().err.strip()
    assert len(set(errors.values())) == 1, errors
    assert "did you mean" in errors["pareto"] and "\n" not in errors["pareto"]


def test_every_command_reads_names_alike():
    # The same alias and qualified names give the same presets through every parser.
    from perfmodel.cli import build_parser
    from perfmodel.commands import model_and_chip

    parser = build_parser()
    found = {(m.name, c.name) for m, c in (
        model_and_chip(parser.parse_args([command, *needs, "--model", "DeepSeek-R1-0528",
                                          "--chip", "h200_sxm"]), "h100")
        for command, needs in _NAMED.items())}
    assert found == {(presets.find_model("deepseek-r1").name, presets.get_chip("h200").name)}
