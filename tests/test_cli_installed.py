"""Issue 19's ten points, each through the installed `perfmodel` console script in a fresh
process (what a user types), not through `main(argv)` in process. The errors run by default
(about a second each); the runs that sweep or optimize are with the slow tests, and
`test_cli*.py` check the same points in process by default."""

import csv
import io
import json
import os
import shutil

import pytest
from installed import run

HF = os.path.join(os.path.dirname(__file__), "..", "perfmodel", "data", "hf_configs")
COLUMNS = "model,hardware,framework,precision,spec_decoding,disagg,isl,osl,conc,tp,ep," \
          "dp_attention"


def one_line_error(err, *words):
    assert err.count("\n") == 1 and err.startswith("perfmodel: error: "), err
    for word in words:
        assert word in err, (word, err)


# 1. Exact names: a typo is an error with the closest names, never another preset.
@pytest.mark.parametrize("flag, name, close", [
    ("--chip", "gb2000", "did you mean gb200"),
    ("--model", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "unknown model"),
    ("--model", "kimi-k2-thinking", "did you mean"),
])
def test_1_typos_exit_2_with_the_closest_names(flag, name, close):
    code, out, err = run("pareto", flag, name)
    assert code == 2 and out == ""
    one_line_error(err, repr(name), close)


# 3. Output paths are checked before any work.
def test_3_plot_into_a_missing_folder_exits_2_at_once(tmp_path):
    plot = str(tmp_path / "missing" / "front.png")
    code, out, err = run("pareto", "--model", "deepseek-r1", "--chip", "h100", "--chips", "16",
                         "--plot", plot, timeout=20)   # the sweep alone takes longer
    assert code == 2 and out == ""
    one_line_error(err, "--plot", "does not exist")


# 4. Hugging Face models: a shipped id and a config path run, named after the id.
@pytest.mark.slow   # a sweep in a fresh process (5-10 s)
def test_4_hugging_face_id_and_config_path(tmp_path):
    code, out, err = run("pareto", "--model", "Qwen/Qwen3-8B", "--chip", "h100", "--isl",
                         "1024", "--osl", "256", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["inputs"]["model"] == "Qwen/Qwen3-8B"
    folder = tmp_path / "my-model"
    folder.mkdir()
    shutil.copy(os.path.join(HF, "Qwen__Qwen3-8B.json"), folder / "config.json")
    code, out, err = run("pareto", "--model", str(folder / "config.json"), "--chip", "h100",
                         "--isl", "1024", "--osl", "256", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["rows"]


# 5. Options a command cannot honour are not offered.
def test_5_optimize_offers_no_csv():
    code, out, _ = run("optimize", "--help")
    assert code == 0 and "--format" in out and "csv" not in out.split("--format", 1)[1][:60]
    code, out, err = run("optimize", "--format", "csv")
    assert code == 2 and out == ""
    one_line_error(err, "--format", "'csv'")


# 6. Physical sanity: lengths past the context, layouts that cannot split the heads, rows
# that do not fit get no numbers.
def test_6_lengths_past_the_context_need_a_flag():
    code, out, err = run("pareto", "--model", "llama-3.1-8b", "--chip", "h100", "--isl",
                         "10000000")
    assert code == 2 and out == ""
    one_line_error(err, "maximum context", "--allow-long-context")


@pytest.mark.slow   # a sweep in a fresh process (5-10 s)
def test_6_rows_that_do_not_fit_or_cannot_split_get_no_numbers(tmp_path):
    rows = tmp_path / "rows.csv"
    rows.write_text(COLUMNS + "\n"
                    "llama-3.1-405b,h200,vllm,fp8,none,False,8192,1024,8,1,1,False\n"
                    "llama-3.1-70b,h200,vllm,fp8,none,False,8192,1024,8,3,1,False\n"
                    "llama-3.1-8b,h200,vllm,fp8,none,False,8192,1024,8,1,1,False\n")
    code, out, err = run("predict", str(rows))
    assert code == 0, err
    got = list(csv.DictReader(io.StringIO(out)))
    assert [r["pred_ttft_s"] == "" for r in got] == [True, True, False]
    assert "does not fit" in got[0]["pred_error"]
    assert "does not divide" in got[1]["pred_error"]
    assert float(got[2]["pred_ttft_s"]) > 0 and got[2]["pred_error"] == ""


# 7 and 8 (optimize): the default target is documented and named; JSON names its inputs.
@pytest.mark.slow   # an optimize run compiles its search kernels (10-40 s cold)
def test_7_8_optimize_default_target_and_inputs():
    code, out, err = run("optimize", "--model", "llama-3.1-8b", "--chip", "h100", "--format",
                         "json")
    assert code == 0 and err == "", err
    result = json.loads(out)
    inputs = result["inputs"]
    assert "MLPerf" in inputs["default_target"] and inputs["targets"]
    assert result["metrics"]["tpot_s"] * 1e3 <= inputs["targets"]["max_tpot_ms"] * (1 + 1e-6)
    for key in ("model", "chip", "chips", "isl", "osl", "perfmodel_version", "fitted_latency",
                "fitted_power"):
        assert inputs[key] not in (None, ""), key
    code, out, err = run("optimize", "--model", "llama-3.1-8b", "--chip", "h100")
    assert code == 0 and "MLPerf" in out


@pytest.mark.slow   # an optimize run (issue 24: its JSON design can be fed back)
def test_optimize_design_fed_back_to_predict(tmp_path):
    saved = tmp_path / "design.json"
    code, out, err = run("optimize", "--model", "gpt-oss-120b", "--chip", "b200", "--chips",
                         "2", "--isl", "1024", "--osl", "1024", "--format", "json")
    assert code == 0, err
    saved.write_text(out)
    code, again, err = run("predict", "--design", str(saved))
    assert code == 0, err
    reported, replayed = json.loads(out)["metrics"], json.loads(again)["metrics"]
    for key, value in reported.items():
        assert replayed[key] == pytest.approx(value, rel=1e-9, abs=1e-300), key


# 2 (piped: no progress bar; the pseudo-terminal case is the slow
# `test_progress_bar_on_a_terminal_only`) and 8 (saved results name their inputs).
@pytest.mark.slow   # a sweep in a fresh process (5-10 s)
def test_2_8_pareto_json_and_csv_name_their_inputs_and_print_no_bar_when_piped():
    argv = ["pareto", "--model", "llama-3.1-8b", "--chip", "h100", "--isl", "2048", "--osl",
            "512"]
    code, out, err = run(*argv, "--format", "json")
    assert code == 0 and err == "", err
    inputs = json.loads(out)["inputs"]
    assert (inputs["model"], inputs["chip"], inputs["isl"], inputs["osl"]) == \
        ("llama-3.1-8b", "h100", 2048, 512)
    for key in ("chips", "precision", "engine", "perfmodel_version", "fitted_latency"):
        assert inputs[key] not in (None, ""), key
    code, out, err = run(*argv, "--format", "csv")
    assert code == 0, err
    row = next(csv.DictReader(io.StringIO(out)))
    assert (row["model"], row["chip"], row["isl"], row["osl"]) == \
        ("llama-3.1-8b", "h100", "2048", "512")


# 9. Columns say what they count, help explains them, tables fit 120 columns.
@pytest.mark.slow   # a sweep in a fresh process (5-10 s)
def test_9_columns_explained_and_tables_fit_120_columns():
    code, out, _ = run("pareto", "--help")
    assert code == 0
    for name in ("tput_per_chip_total", "tok_s_per_kw_tdp", "power_w_modelled"):
        assert name in out
    code, out, err = run("pareto", "--model", "gpt-oss-120b", "--chip", "h100", "--chips", "4",
                         "--isl", "1024", "--osl", "1024")   # MoE: the longest layout labels
    assert code == 0, err
    assert max(len(line) for line in out.splitlines()) <= 120
    assert "TTFT s" in out and "TPOT ms" in out


# 10. --version, the catalogue, input files that are not CSV text.
def test_10_version_list_and_bad_input_files(tmp_path):
    code, out, _ = run("--version")
    assert code == 0 and out.startswith("perfmodel ") and "fitted" in out
    code, out, _ = run("list", "chips", "--format", "json")
    chips = {entry["name"]: entry for entry in json.loads(out)}
    assert code == 0 and "gb200" in chips["gb200"]["aliases"] and chips["gb200"]["source"]
    binary = tmp_path / "rows.csv"
    binary.write_bytes(b"model,hardware\n\xff\xfe,h100\n")
    code, out, err = run("predict", str(binary))
    assert code == 2 and out == ""
    one_line_error(err, str(binary), "not UTF-8")
    code, out, err = run("predict", str(tmp_path))
    assert code == 2
    one_line_error(err, "folder")
