"""The command line's files and catalogue: output paths checked before any work, input files
that are not CSV text, formats a command cannot write, `--version` and `perfmodel list`."""

import json
import os
import subprocess

import pytest
from installed import command, run

import perfmodel as pm
from perfmodel.cli import main
from perfmodel.presets import find_model

DATA = os.path.join(os.path.dirname(__file__), "..", "calibration", "data")
ROWS = os.path.join(DATA, "benchmarks_inferencemax.csv")


def _one_line_error(err: str, *words):
    assert err.count("\n") == 1 and err.startswith("perfmodel: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


def _no_work(monkeypatch):
    """Make the expensive step of `predict` and `pareto` fail loudly if reached."""
    import perfmodel.commands.predict as predict
    import perfmodel.sweep as sweep

    def reached(*args, **kwargs):
        raise AssertionError("the command started its work before checking the output path")

    monkeypatch.setattr(predict, "predict_file", reached)
    monkeypatch.setattr(sweep, "sweep", reached)


@pytest.mark.parametrize("where", ["missing folder", "a folder", "read-only file"])
def test_output_paths_are_checked_before_any_work(monkeypatch, tmp_path, capsys, where):
    if where == "missing folder":
        out = str(tmp_path / "nope" / "out.csv")
    elif where == "a folder":
        out = str(tmp_path)
    else:
        out = str(tmp_path / "locked.csv")
        open(out, "w").close()
        # Root may write read-only files: answer as the file system would for a user.
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False
                            if str(p).endswith(("locked.csv", "locked.png")) else real(p, mode))
    _no_work(monkeypatch)
    assert main(["predict", ROWS, "--out", out]) == 2
    _one_line_error(capsys.readouterr().err, "--out", out)
    plot = out if where != "missing folder" else str(tmp_path / "nope" / "front.png")
    if where == "a folder":
        plot = str(tmp_path / "sub.png")
        os.mkdir(plot)
    if where == "read-only file":
        plot = str(tmp_path / "locked.png")
        open(plot, "w").close()
    assert main(["pareto", "--model", "llama-3.1-8b", "--chip", "h100", "--plot", plot]) == 2
    _one_line_error(capsys.readouterr().err, "--plot", plot)


def test_missing_output_folder_through_the_installed_command(tmp_path):
    code, out, err = run("predict", ROWS, "--out", str(tmp_path / "nope" / "o.csv"))
    assert code == 2 and out == ""
    _one_line_error(err, "does not exist")


@pytest.mark.parametrize("content, words", [
    (b"model,hardware\n\xff\xfe,h100\n", ("not UTF-8", "byte")),
    (b"a,a,b\n1,2,3\n", ("'a'", "more than once")),
])
def test_bad_input_files_name_the_file(tmp_path, capsys, content, words):
    path = tmp_path / "rows.csv"
    path.write_bytes(content)
    assert main(["predict", str(path)]) == 2
    _one_line_error(capsys.readouterr().err, str(path), *words)


def test_a_folder_as_input_is_named_as_such(tmp_path, capsys):
    assert main(["predict", str(tmp_path)]) == 2
    _one_line_error(capsys.readouterr().err, str(tmp_path), "folder")


def test_optimize_offers_only_the_formats_it_writes(capsys):
    with pytest.raises(SystemExit):
        main(["optimize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{table,json}" in text and "csv" not in text
    assert main(["optimize", "--format", "csv"]) == 2   # refused before any work
    _one_line_error(capsys.readouterr().err, "'csv'", "table", "json")


def test_version():
    code, out, err = run("--version")
    assert code == 0 and err == ""
    assert out.startswith("perfmodel ") and out.count("\n") == 1
    assert "fitted_params.json v" in out and "fitted_power.json v" in out


def test_list_models_chips_engines(capsys):
    assert main(["list", "models", "--format", "json"]) == 0
    models = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(pm.model_names()) <= set(models)
    assert models["Qwen/Qwen3-8B"]["kind"] == "hugging face config"
    assert all(r["source"] for r in models.values())
    assert "openai/gpt-oss-120b" in models["gpt-oss-120b"]["aliases"]
    # Every listed name is accepted as it is listed.
    for name in models:
        find_model(name)
    assert main(["list", "chips", "--format", "json"]) == 0
    chips = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(chips) == set(pm.chip_names()) and all(r["source"] for r in chips.values())
    assert main(["list", "engines"]) == 0
    table = capsys.readouterr().out
    for name in ("vllm", "sglang", "trt", "mlenergy-vllm"):
        assert f"\n{name} " in table
    assert main(["list", "gpus"]) == 2
    _one_line_error(capsys.readouterr().err, "'gpus'", "models", "chips", "engines")


def test_model_from_a_config_path_keeps_its_name(tmp_path, capsys):
    from importlib import resources

    shipped = resources.files("perfmodel").joinpath("data", "hf_configs", "Qwen__Qwen3-8B.json")
    config = json.loads(shipped.read_text())
    config.pop("_source", None)
    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for given in (str(folder / "config.json"), str(folder)):
        assert main(["pareto", "--model", given, "--chip", "h100", "--chips", "1",
                     "--format", "json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["inputs"]["model"] == config.get("_name_or_path", "Qwen3-8B")
        assert data["rows"]
    bad = tmp_path / "broken.json"
    bad.write_text("{")
    assert main(["pareto", "--model", str(bad), "--chip", "h100"]) == 2
    _one_line_error(capsys.readouterr().err, str(bad), "config.json")


def test_requests_longer_than_the_model_context_need_a_flag(monkeypatch, capsys):
    assert pm.get_model("llama-3.1-8b").max_context == 131072   # its config.json
    argv = ["pareto", "--model", "llama-3.1-8b", "--chip", "h100", "--chips", "1",
            "--isl", "131072", "--osl", "1024", "--format", "json"]
    _no_work(monkeypatch)   # refused before the sweep
    assert main(argv) == 2
    _one_line_error(capsys.readouterr().err, "132,096", "131,072", "--allow-long-context")
    monkeypatch.undo()
    assert main([*argv, "--allow-long-context"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"]
    for argv in (["optimize", "--isl", "200000"], ["compare", "--isl", "200000"]):
        assert main(argv) == 2
        _one_line_error(capsys.readouterr().err, "maximum context", "--allow-long-context")


def _stderr_on_a_terminal(argv, timeout=600, env=None):
    """Run the installed command with standard error on a pseudo-terminal: (exit status,
    what the terminal received)."""
    import pty
    import threading

    master, slave = pty.openpty()
    received = []

    def drain():
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:   # the child closed its end
                return
            if not chunk:
                return
            received.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    done = subprocess.run([command(), *argv], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=slave, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    return done.returncode, b"".join(received).decode(errors="replace")


@pytest.mark.slow   # three runs of a sweep
def test_progress_bar_on_a_terminal_only():
    # The bar waits progress.DELAY_S before it shows; with a warm compilation cache the
    # sweep can end sooner, so the terminal runs show it from the start.
    argv = ["pareto", "--model", "deepseek-r1", "--chip", "h100", "--chips", "16"]
    now = {"PERFMODEL_PROGRESS_DELAY_S": "0"}
    code, terminal = _stderr_on_a_terminal(argv, env=now)
    assert code == 0
    assert "deepseek-r1 on 16 x h100" in terminal and "layout" in terminal and "%" in terminal
    code, quiet = _stderr_on_a_terminal([*argv, "--quiet"], env=now)
    assert code == 0 and quiet == ""
    code, out, err = run(*argv)   # piped: no bar
    assert code == 0 and err == ""


@pytest.mark.parametrize("wrap", ["jax.jit", "eqx.filter_jit"])
def test_run_time_check_message(monkeypatch, capsys, wrap):
    import equinox as eqx
    import jax

    import perfmodel.commands.catalog as catalog

    jit = jax.jit if wrap == "jax.jit" else eqx.filter_jit
    check = jit(lambda x: eqx.error_if(x, x < 0, "runtime: request_rate must be >= 0"))

    def failing(args):
        return check(jax.numpy.asarray(-1.0))

    monkeypatch.setattr(catalog, "run", failing)
    monkeypatch.setattr(catalog, "register", _register_with(failing, catalog.register))
    assert main(["list", "chips"]) == 2
    err = capsys.readouterr().err
    assert err == "perfmodel: error: runtime: request_rate must be >= 0\n"


def _register_with(run, register):
    def wrapped(subparsers):
        parser = register(subparsers)
        parser.set_defaults(func=run)
        return parser
    return wrapped


@pytest.mark.parametrize("content, words", [
    ("not json", "cannot read it as JSON"),
    ('{"design": {}}', "no 'spec'"),
    ('{"spec": {"model": "llama-3.1-8b", "chip": {"type": "Chip"}, "workload": {}, '
     '"design": {}}}', "--design"),
])
def test_predict_design_errors_are_one_line(tmp_path, capsys, content, words):
    path = tmp_path / "design.json"
    path.write_text(content)
    assert main(["predict", "--design", str(path)]) == 2
    _one_line_error(capsys.readouterr().err, words)


def test_predict_needs_rows_or_a_design(capsys):
    assert main(["predict"]) == 2
    _one_line_error(capsys.readouterr().err, "IN.csv or --design")


def test_progress_delay_from_the_environment(monkeypatch):
    from perfmodel import progress
    monkeypatch.delenv("PERFMODEL_PROGRESS_DELAY_S", raising=False)
    assert progress._delay() == progress.DELAY_S
    monkeypatch.setenv("PERFMODEL_PROGRESS_DELAY_S", "0")
    assert progress._delay() == 0.0
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("PERFMODEL_PROGRESS_DELAY_S", bad)
        with pytest.raises(ValueError, match="PERFMODEL_PROGRESS_DELAY_S must be"):
            progress._delay()
