"""`perfmodel.grid` and `perfmodel sweep`: spec parsing, expansion, feasibility, resumable
output, sharding over fake devices and two local processes."""

import csv
import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import perfmodel as pm
from perfmodel import sweep as pareto_sweep
from perfmodel.cli import main
from perfmodel.grid import all_layouts, expand, from_dict, load, run_sweep, writers
from perfmodel.grid import evaluate as grid_evaluate
from perfmodel.grid.expand import chunks
from perfmodel.sweep import candidate_layouts, default_runtime

ISSUE_SPEC = """
[sweep]
models = ["deepseek-r1", "gpt-oss-120b", "llama-3.1-70b"]
chips = ["gb200", "h200", "mi355x", "jalapeno"]
chip_counts = [4, 8]
isl = [1024, 8192]
osl = [1024]
concurrency = { start = 1, stop = 4096, num = 400, scale = "log" }
layouts = "all"            # or a list such as ["tp8-ep8", "4xtp2-dpa"]
metrics = ["tput_per_chip", "interactivity", "ttft_s", "tpot_s", "power_w"]
"""

#: A small sweep: one model and chip (one compiled kernel), every kind of infeasible point.
SMALL = {"models": ["llama-3.1-8b"], "chips": ["h100"], "chip_counts": [1, 2],
         "isl": [1024, 4096], "osl": [1024],
         "concurrency": {"start": 1, "stop": 4096, "num": 13, "scale": "log"},
         "precision": ["fp8", "fp4"], "metrics": ["tput_per_chip", "interactivity", "ttft_s"]}
SMALL_CHUNK = 16


def small(**changes):
    return from_dict({"sweep": {**SMALL, **changes}})


def read_csv(path):
    with open(path) as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted small sweep (CSV)."""
    path = str(tmp_path_factory.mktemp("ref") / "ref.csv")
    summary = run_sweep(small(), path, size=SMALL_CHUNK, progress=False)
    return path, summary


def test_issue_spec_parses_and_expands(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text(ISSUE_SPEC)
    spec = load(str(path))
    assert spec.metrics == ("tput_per_chip_total", "interactivity", "ttft_s", "tpot_s",
                            "power_w_modelled")
    assert len(spec.concurrency) == 400 and spec.concurrency[0] == pytest.approx(1.0)
    assert spec.concurrency[-1] == pytest.approx(4096.0)
    grid = expand(spec)
    assert len(grid.groups) == 12
    assert grid.size == sum(len(g.cells) for g in grid.groups) * 2 * 1 * 400


def test_example_spec_is_the_issue_form():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = load(os.path.join(root, "examples", "sweep.toml"))
    assert spec.models == ("deepseek-r1", "gpt-oss-120b", "llama-3.1-70b")


@pytest.mark.parametrize("table, match", [
    ({"modles": ["x"]}, "sweep.modles: unknown key"),
    ({"concurrency": {"start": 0, "stop": 10, "num": 3, "scale": "log"}},
     "log range needs positive"),
    ({"concurrency": {"start": 1, "stop": 10}}, "a range is"),
    ({"isl": "long"}, "sweep.isl must be"),
    ({"osl": [1]}, "sweep.osl values must be"),
    ({"metrics": ["speed"]}, "unknown metric 'speed'"),
    ({"layouts": ["tp8-xx4"]}, "cannot read 'xx4'"),
    ({"emulate": "yes"}, "sweep.emulate must be true or false"),
    ({"runtime": {"speed": 2}}, "sweep.runtime.speed: unknown field"),
    ({"runtime": {"max_running": "many"}}, "sweep.runtime.max_running must be a number"),
    ({"output_cv2": -1}, "sweep.output_cv2 must be a finite number >= 0"),
    ({"output_cv2": "wide"}, "sweep.output_cv2 must be"),
    ({"cached_fraction": 1.0}, r"sweep.cached_fraction must be a number in \[0, 1\)"),
    ({"cached_fraction": "half"}, "sweep.cached_fraction must be"),
])
def test_bad_specs_name_the_key(table, match):
    with pytest.raises(ValueError, match=match):
        small(**table)


def test_alias_keys_and_a_repeated_key():
    spec = from_dict({"sweep": {"model": "llama-3.1-8b", "chip": "h100", "num_chips": 1,
                                "input_len": 1024, "output_len": 1024, "concurrencies": 4}})
    assert spec.chip_counts == (1,) and spec.concurrency == (4.0,)
    with pytest.raises(ValueError, match="given twice"):
        from_dict({"sweep": {**SMALL, "model": "x"}})


def test_unknown_names_give_the_preset_errors():
    with pytest.raises(ValueError, match="unknown chip 'nonesuch'; valid chips"):
        expand(small(chips=["nonesuch"]))
    with pytest.raises(ValueError, match="unknown model"):
        expand(small(models=["nonesuch"]))


def test_all_layouts_cover_the_chip_count_and_the_candidates():
    model, chip = pm.get_model("deepseek-r1"), pm.get_chip("gb200")
    layouts = all_layouts(model, chip, 8)
    assert all(layout.chips == 8 for layout in layouts)
    names = {layout.describe() for layout in layouts}
    assert {"tp8-ep8-dpa", "tp8", "2xtp4-ep4"} <= names
    # Every layout the Pareto sweep keeps is among them.
    assert {x.describe() for x in candidate_layouts(model, chip, 8)} <= names


def test_rows_carry_inputs_and_every_infeasible_point_has_a_reason(reference):
    path, summary = reference
    rows = read_csv(path)
    grid = expand(small())
    assert len(rows) == grid.size == summary.rows == summary.points
    assert list(rows[0])[:8] == ["model", "chip", "chips", "layout", "precision", "isl", "osl",
                                 "concurrency"]
    reasons = {r["reason"] for r in rows if r["feasible"] == "false"}
    assert all(r["reason"] == "" for r in rows if r["feasible"] == "true")
    assert any("does not compute fp4 natively" in r for r in reasons)
    assert grid_evaluate.QUEUES in reasons
    # Explicit layouts of another chip count are kept as infeasible rows.
    spec = small(layouts=["tp2", "2xtp1"], chip_counts=[2, 4], precision="default")
    cells = [c for g in expand(spec).groups for c in g.cells]
    assert [bool(c.reason) for c in cells] == [False, False, True, True]
    assert "uses 2 chips; the cell has 4" in cells[2].reason


def test_feasible_rows_match_predict(reference):
    path, _ = reference
    rows = [r for r in read_csv(path) if r["feasible"] == "true"]
    model, chip = pm.get_model("llama-3.1-8b"), pm.get_chip("h100")
    for row in rows[:: max(1, len(rows) // 3)]:
        layout = pm.Layout.parse(row["layout"])
        design = pm.Design(concurrency=float(row["concurrency"]), layout=layout,
                           precision=pm.precision(chip, model, *row["precision"].split("/")),
                           runtime=default_runtime(chip))
        m = pm.predict(model, chip, pm.Workload(float(row["isl"]), float(row["osl"])), design,
                       hard=True)
        assert float(row["interactivity"]) == pytest.approx(float(m.interactivity), rel=1e-12)
        assert float(row["tput_per_chip_total"]) == pytest.approx(
            float(m.throughput_per_chip), rel=1e-12)


def test_sweep_through_the_traced_store_equals_the_reference(reference, tmp_path,
                                                              monkeypatch):
    """On one device the kernel goes through the traced-program store: the run that traces
    and stores it and the run that loads it write the reference's rows."""
    from perfmodel import compiled

    ref_path, _ = reference
    store = tmp_path / "traced"
    monkeypatch.setattr(compiled, "traced_store", lambda: str(store))
    for run in ("stored", "loaded"):
        path = str(tmp_path / f"{run}.csv")
        run_sweep(small(), path, size=SMALL_CHUNK, progress=False)
        assert read_csv(path) == read_csv(ref_path), run
        assert [p.suffix for p in store.iterdir()] == [".pkl"], run


@pytest.mark.parametrize("ext", ["csv", "parquet"])
def test_interrupted_then_resumed_equals_uninterrupted(reference, tmp_path, ext):
    if ext == "parquet":
        pytest.importorskip("pyarrow")
    ref_path, _ = reference
    path = str(tmp_path / f"out.{ext}")
    total = len(chunks(expand(small()), SMALL_CHUNK))

    def stop_after(k):
        def hook(index):
            if index == k:
                raise KeyboardInterrupt("test")
        return hook

    with pytest.raises(KeyboardInterrupt):
        run_sweep(small(), path, size=SMALL_CHUNK, progress=False,
                  after_chunk=stop_after(total // 3))
    first = writers.read_state(path)
    assert first["next_chunk"] == total // 3 + 1 and not first["complete"]
    rows = read_rows(path)
    assert len(rows) == first["rows"] == (total // 3 + 1) * SMALL_CHUNK
    with pytest.raises(ValueError, match="unfinished sweep"):
        run_sweep(small(), path, size=SMALL_CHUNK, progress=False)
    with pytest.raises(ValueError, match="another digest"):
        run_sweep(small(osl=[2048]), path, resume=True, progress=False)
    done = run_sweep(small(), path, resume=True, progress=False)
    assert done.complete and done.computed == done.points - first["rows"]
    assert read_rows(path) == read_rows(ref_path)


def read_rows(path):
    if path.endswith(".csv"):
        return [tuple(r.values()) for r in read_csv(path)]
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    return [tuple("" if v is None or (isinstance(v, float) and np.isnan(v)) else
                  ("true" if v is True else "false" if v is False else str(v))
                  for v in r.values()) for r in table]


def test_a_torn_chunk_is_cut_on_resume(reference, tmp_path):
    ref_path, _ = reference
    path = str(tmp_path / "out.csv")

    def hook(index):
        if index == 2:
            with open(path, "a") as file:   # a chunk written but never committed
                file.write("llama-3.1-8b,h100,1,tp1,partial")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(small(), path, size=SMALL_CHUNK, progress=False, after_chunk=hook)
    run_sweep(small(), path, resume=True, progress=False)
    assert read_rows(path) == read_rows(ref_path)


def test_parquet_without_pyarrow_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ValueError, match=r"pip install 'perfmodel\[parquet\]'"):
        writers.output_format(str(tmp_path / "x.parquet"))


def test_chunk_size_is_bounded():
    from perfmodel.grid import chunk_size

    assert chunk_size(1e12) == 65536 and chunk_size(1e6) == 1024
    assert chunk_size(4e9, devices=8) <= chunk_size(4e9)


def test_cli_sweep_and_its_errors(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text(textwrap.dedent("""
        [sweep]
        models = "llama-3.1-8b"
        chips = "h100"
        chip_counts = 1
        isl = 1024
        osl = 1024
        concurrency = [1, 64]
        metrics = ["tput_per_chip", "power_w"]
    """))
    out = tmp_path / "r.csv"
    assert main(["sweep", str(spec), "--out", str(out), "-q", "--chunk-size", "16"]) == 0
    rows = read_csv(out)
    assert len(rows) == 2 and "power_w_modelled" in rows[0]
    assert "2 rows of 2 points" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text(spec.read_text().replace('"h100"', '"nonesuch"'))
    assert main(["sweep", str(bad), "--out", str(out), "--overwrite"]) == 2
    assert "unknown chip 'nonesuch'" in capsys.readouterr().err
    assert main(["sweep", str(spec), "--out", str(tmp_path / "r.txt")]) == 2
    assert "must end in .csv or .parquet" in capsys.readouterr().err
    broken = tmp_path / "broken.toml"
    broken.write_text("[sweep\n")
    assert main(["sweep", str(broken), "--out", str(out)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


SHARDED = """
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
sys.path.insert(0, {tests!r})
from test_grid import small, SMALL_CHUNK
from perfmodel.grid import run_sweep
assert len(jax.local_devices()) == 8
for devices, path in ((8, {eight!r}), (1, {one!r})):
    run_sweep(small(), path, size=SMALL_CHUNK, devices=devices, progress=False)
"""


def compare_rows(a, b):
    """Inputs, feasibility and reasons equal; metrics equal to the last bits."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x[:8] == y[:8] and x[-2:] == y[-2:]
        for u, v in zip(x[8:-2], y[8:-2], strict=True):
            assert (u == v == "") or float(u) == pytest.approx(float(v), rel=1e-13)


@pytest.mark.slow
def test_sharded_over_eight_devices_equals_one_device(tmp_path, reference):
    eight, one = str(tmp_path / "eight.csv"), str(tmp_path / "one.csv")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PERFMODEL_CACHE_DIR="off")
    subprocess.run([sys.executable, "-c", SHARDED.format(tests=tests, eight=eight, one=one)],
                   check=True, env=env, timeout=300)
    compare_rows(read_rows(eight), read_rows(one))
    assert read_rows(one) == read_rows(reference[0])


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_through_jax_distributed(tmp_path, reference):
    spec = tmp_path / "s.toml"
    lines = ["[sweep]"] + [f"{k} = {json.dumps(v)}" for k, v in SMALL.items()
                           if k != "concurrency"]
    c = SMALL["concurrency"]
    lines.append(f'concurrency = {{ start = {c["start"]}, stop = {c["stop"]}, '
                 f'num = {c["num"]}, scale = "{c["scale"]}" }}')
    spec.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "two.csv")
    port = _free_port()
    env = dict(os.environ, PERFMODEL_CACHE_DIR="off")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "perfmodel.cli", "sweep", str(spec), "--out", out, "-q",
         "--chunk-size", str(SMALL_CHUNK), "--coordinator", f"localhost:{port}",
         "--num-processes", "2", "--process-id", str(p)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert "merged from 2 parts" in results[0][0]
    assert os.path.exists(str(tmp_path / "two.part1-of-2.csv"))
    assert read_rows(out) == read_rows(reference[0])


def test_a_signal_during_a_commit_waits_for_it():
    import signal

    from perfmodel.grid.run import _Signals

    done = []
    with _Signals() as signals:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            with signals.commit():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("committed")   # the handler ran, the commit went on
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):   # outside a commit it interrupts at once
                pass
    assert done == ["committed"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_runtime_settings_reach_the_kernel(tmp_path, reference):
    with pytest.raises(ValueError, match="sweep.runtime: Runtime.memory_fraction"):
        expand(small(runtime={"memory_fraction": 1.5}))
    path = str(tmp_path / "capped.csv")
    run_sweep(small(engine={"max_running": 2}), path, size=SMALL_CHUNK, progress=False)
    base, capped = read_csv(reference[0]), read_csv(path)
    assert [r["concurrency"] for r in base] == [r["concurrency"] for r in capped]
    # Two sequences at a time per replica: less throughput wherever more were running.
    pairs = [(float(a["tput_per_chip_total"]), float(b["tput_per_chip_total"]))
             for a, b in zip(base, capped, strict=True)
             if a["tput_per_chip_total"] and b["tput_per_chip_total"]
             and float(a["concurrency"]) > 8]
    assert pairs and all(b < a for a, b in pairs)
    assert all(r["reason"].startswith("queues") for r in capped
               if float(r["concurrency"]) > 2 * float(r["chips"]) and r["feasible"] == "false"
               and r["tput_per_chip_total"])
    assert not any(r["feasible"] == "true" and float(r["concurrency"]) > 2 * int(r["chips"])
                   for r in capped)


@pytest.mark.parametrize("key, value, field, metric", [
    # `output_cv2` (alias `output_spread`): every point's running batch holds longer
    # contexts, so it is less interactive (queued points run fewer sequences in a smaller
    # batch that fits).
    ("output_spread", 1.5, "output_cv2", "interactivity"),
    # `cached_fraction`: half of every point's prompt is computed, so the first token comes
    # sooner.
    ("cached_fraction", 0.5, "cached_fraction", "ttft_s"),
])
def test_workload_shape_keys_reach_the_kernel(tmp_path, reference, key, value, field, metric):
    """Wherever both sweeps run a point in full (feasible) the metric falls; the spec's
    digest (what `--resume` checks) tells the two apart."""
    spec = small(**{key: value})
    assert getattr(spec, field) == value and spec.digest() != small().digest()
    path = str(tmp_path / "shaped.csv")
    run_sweep(spec, path, size=SMALL_CHUNK, progress=False)
    base, shaped = read_csv(reference[0]), read_csv(path)
    assert [r["concurrency"] for r in base] == [r["concurrency"] for r in shaped]
    pairs = [(float(a[metric]), float(b[metric]))
             for a, b in zip(base, shaped, strict=True)
             if a["feasible"] == b["feasible"] == "true"]
    assert pairs and all(b < a for a, b in pairs)


def test_a_spec_without_a_later_key_keeps_its_digest():
    """A spec without `cached_fraction` (or with 0) hashes as it did before the key existed,
    so sweeps written then still resume."""
    assert small().digest() == small(cached_fraction=0.0).digest()
    fields = dataclasses.asdict(small())
    del fields["cached_fraction"]
    assert small().digest() == hashlib.sha256(
        json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def test_one_trace_per_model_and_chip(tmp_path, monkeypatch):
    calls = []
    real = pareto_sweep.predict

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pareto_sweep, "predict", counted)
    # Without the on-disk store of traced kernels (`compiled.traced_store`): importing
    # calibration/fit.py (tests of the calibration scripts do) or an in-process `cli.main`
    # turns JAX's persistent cache on for the whole worker, and a kernel an earlier run of
    # the suite stored would load without a trace.
    monkeypatch.setenv("PERFMODEL_TRACED_STORE", "off")
    # A chunk size no other test uses: the kernel is traced afresh, once for every chunk,
    # layout, format and length of the group.
    spec = small()
    summary = run_sweep(spec, str(tmp_path / "x.csv"), size=24, progress=False)
    assert summary.chunks > 3 and len({c.layout for c in expand(spec).groups[0].cells}) > 2
    assert len(calls) == 1
