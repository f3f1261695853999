"""MLPerf Inference check: `python calibration/mlperf_check.py` (about 10 minutes on 2 cores;
`--maxq` prints only the power-cap check, `maxq_pairs`).

Predicts the MLPerf v4.1/v5.1 rows of `data/benchmarks_mlperf.csv` with `perfmodel.mlperf`
(the same code as `perfmodel predict` on an MLPerf CSV) and compares each scenario's own
metric, output tokens/s per accelerator:

- **Offline** (capacity): the best sustainable throughput over every serving
  configuration the model's own search finds (layouts with expert parallelism, DP
  attention and pipelines; speculative decoding where the round's rules allow it; batches
  up to what fits in memory), at the data sets' published or derived mean lengths
  (`perfmodel/data/mlperf_lengths.csv`, each with its source).
- **Server / Interactive capacity**: the highest Poisson rate whose p99 TTFT and TPOT
  meet the row's limits (steady-state approximation, `perfmodel.mlperf`), against the
  submitted result (the rate the submitter's system sustained within the same limits).
- **At the target QPS** (echo rows): the previous check's prediction of the throughput at
  the row's `target_qps`, which is the offered load whenever the model keeps up, so it
  tests nothing about capacity; kept for comparison, with its TTFT/TPOT at the target.

"Before" is the previous check's rules, kept below (`load_rows`, `layout_for`,
`ASSUMED_INPUT`; `mlperf_serving.py` takes its layout rule and, with `--assumed-inputs`,
these inputs): the smallest plain-TP
group whose weights take <= 60 % of HBM, ASSUMED input means, and for Offline the
throughput where it reaches 99 % of its peak over a concurrency grid. Nothing here is
fitted and no measured column is read before the comparison.
"""

from __future__ import annotations

import csv
import json
import pathlib
import re
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from perfmodel import fitted as shipped  # noqa: E402
from perfmodel import mlperf  # noqa: E402
from perfmodel.design import Design, Layout, precision  # noqa: E402
from perfmodel.kvcache import weight_bytes_per_chip  # noqa: E402
from perfmodel.presets import chip_key, get_chip, get_model, model_key  # noqa: E402
from perfmodel.serving import predict  # noqa: E402
from perfmodel.workload import Workload  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE / "data"
#: Mean output tokens per sample: reference means of `mlperf_dataset_lengths.csv`
#: (llama3.1-8b: the derived ~128 tokens/sample, the reference counts characters).
OUTPUT_MEAN = {"llama-2-70b": 294.45, "llama-3.1-405b": 684.68, "llama-3.1-8b": 128.0,
               "mixtral-8x7b": 144.84, "deepseek-r1": 3886.2, "gpt-oss-120b": 1278.2}
#: ASSUMED mean input tokens (not published; see mlperf_dataset_lengths.csv notes): half the
#: OpenOrca cap of 1024 for Llama-2-70B; ~1,000 tokens for a CNN/DailyMail article plus
#: prompt; short OpenOrca/GSM8K/MBXP prompts for Mixtral; long-context LongBench/RULER
#: documents for Llama-3.1-405B; short reasoning prompts under the 3,136 cap for DeepSeek-R1.
ASSUMED_INPUT = {"llama-2-70b": 512.0, "llama-3.1-405b": 8000.0, "llama-3.1-8b": 1000.0,
                 "mixtral-8x7b": 500.0, "deepseek-r1": 800.0, "gpt-oss-120b": 1500.0}
WEIGHTS = {"fp16": "bf16", "bf16": "bf16", "fp8": "fp8", "fp4": "fp4"}
SKIP = re.compile(r"NVL-|PCIe|\(x|Virtualized|GH200", re.I)
GRID = np.geomspace(0.05, 8192.0, 96)


def load_rows(path=DATA / "benchmarks_mlperf.csv"):
    """Server/Interactive rows with preset model and chip, and why others were skipped."""
    out, skipped = [], {}
    with open(path, newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            if row["scenario"] not in ("Server", "Interactive"):
                continue
            reason = ""
            try:
                model = model_key(row["model"], label=True)
                chip = chip_key(row["accelerator"], label=True)
            except ValueError:
                reason = "model or accelerator not a preset"
            if not reason and SKIP.search(row["accelerator"]):
                reason = "accelerator variant (NVL/PCIe/mixed) not the preset"
            if not reason and row["weight_data_types"].lower() not in WEIGHTS:
                reason = f"weight type {row['weight_data_types']!r}"
            if not reason and not row["target_qps"]:
                reason = "no target QPS"
            if not reason and not (row["p50_tpot_ms"] and row["p50_ttft_ms"]
                                   and row["p99_tpot_ms"] and row["p99_ttft_ms"]):
                reason = "no TTFT/TPOT statistics"
            if not reason and not row["result_per_accelerator"]:
                reason = "no per-accelerator result"
            if reason:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            out.append(dict(line=line, model=model, chip=chip, scenario=row["scenario"],
                            weights=WEIGHTS[row["weight_data_types"].lower()],
                            accelerators=int(float(row["total_accelerators"])),
                            per_node=max(int(float(row["accel_per_node"])), 1),
                            qps=float(row["target_qps"]),
                            software=row["software"], submitter=row["submitter"],
                            version=row["mlperf_version"],
                            tput=float(row["result_per_accelerator"]),
                            ttft50=float(row["p50_ttft_ms"]) / 1e3,
                            ttft99=float(row["p99_ttft_ms"]) / 1e3,
                            tpot50=float(row["p50_tpot_ms"]) / 1e3,
                            tpot99=float(row["p99_tpot_ms"]) / 1e3))
    return out, skipped


def layout_for(model, chip, prec, per_node, accelerators):
    tp = 1
    while tp < per_node:
        weights = float(weight_bytes_per_chip(model, Layout(tp=tp), prec))
        if weights <= 0.6 * 0.9 * float(chip.hbm_capacity):
            break
        tp *= 2
    tp = min(tp, per_node, accelerators)
    return Layout(tp=tp, replicas=max(accelerators // tp, 1))


def _structure(row):
    model, chip = get_model(row["model"]), get_chip(row["chip"])
    prec = precision(chip, model, row["weights"])
    layout = layout_for(model, chip, prec, row["per_node"], row["accelerators"])
    framework = "trt" if "tensorrt" in row["software"].lower() else "vllm"
    return (row["model"], row["chip"], row["weights"], layout, framework)


def predict_rows(rows):
    """Predictions for rows sharing one `_structure` (one batched evaluation)."""
    name, chip_name, weights, layout, framework = _structure(rows[0])
    model, chip = get_model(name), get_chip(chip_name)
    prec = precision(chip, model, weights)
    runtime = shipped.runtime_for(framework)
    scale = np.array([layout.replicas * r["accelerators"] / layout.chips for r in rows])
    conc = jnp.asarray((GRID[None, :] * scale[:, None]).ravel())
    design = Design(concurrency=conc, layout=layout, precision=prec, runtime=runtime)
    shape = conc.shape
    workload = Workload(jnp.full(shape, ASSUMED_INPUT[name]), jnp.full(shape, OUTPUT_MEAN[name]),
                        input_range_ratio=1.0, output_range_ratio=1.0,
                        first_wave_fraction=1e-6)
    m = predict(model, chip, workload, design, check=False)
    grid = (len(rows), len(GRID))
    fields = {k: np.broadcast_to(np.asarray(v), shape).reshape(grid) for k, v in (
        ("tput", m.output_throughput_per_chip), ("ttft50", m.ttft), ("ttft99", m.p99_ttft),
        ("tpot50", m.tpot), ("tpot99", m.p99_tpot), ("e2e", m.e2e))}
    fits = bool(np.asarray(m.fits).all())
    conc = np.asarray(conc).reshape(grid)
    out = []
    for i, row in enumerate(rows):
        # Open loop: in-flight requests c with c = rate x E2E(c) (Little's law).
        gap = conc[i] - row["qps"] * fields["e2e"][i]
        crossing = np.nonzero(gap > 0)[0]
        if len(crossing):
            k = int(crossing[0])
            a = gap[k - 1] / (gap[k - 1] - gap[k]) if k > 0 else 1.0
        else:
            # Saturated: the figures where throughput first reaches 99 % of its peak (the
            # memory-bound batch), before the queue the open loop would build.
            tput = fields["tput"][i]
            k, a = int(np.argmax(tput >= 0.99 * tput.max())), 1.0
        entry = {"tp": layout.tp, "replicas": layout.replicas, "framework": framework,
                 "saturated": (not len(crossing)) or not fits}
        for key in ("tput", "ttft50", "ttft99", "tpot50", "tpot99"):
            x = fields[key][i]
            entry[key] = float(x[k - 1] + a * (x[k] - x[k - 1])) if k > 0 else float(x[k])
        out.append(entry)
    return out


def legacy_offline(rows: list[dict]) -> list[float]:
    """Offline output tokens/s per accelerator by the previous rules (the "before")."""
    out = []
    for row in rows:
        name, chip_name, weights = row["model"], row["chip"], row["weights"]
        model, chip = get_model(name), get_chip(chip_name)
        prec = precision(chip, model, weights)
        layout = layout_for(model, chip, prec, row["per_node"], row["accelerators"])
        framework = "trt" if "tensorrt" in row["software"].lower() else "vllm"
        design = Design(concurrency=jnp.asarray(GRID), layout=Layout(tp=layout.tp),
                        precision=prec, runtime=shipped.runtime_for(framework))
        workload = Workload(ASSUMED_INPUT[name], OUTPUT_MEAN[name], input_range_ratio=1.0,
                            output_range_ratio=1.0, first_wave_fraction=1e-6)
        m = predict(model, chip, workload, design, check=False)
        tput = np.where(np.asarray(m.fits), np.asarray(m.output_throughput_per_chip), np.nan)
        out.append(float(tput[int(np.nanargmax(tput >= 0.99 * np.nanmax(tput)))])
                   if np.isfinite(tput).any() else float("nan"))
    return out


def offline_rows(path=DATA / "benchmarks_mlperf.csv"):
    """Offline rows the previous rules could also run (preset model and chip, no variant,
    a known weight type), as `load_rows` builds them, with the raw row."""
    out = []
    with open(path, newline="") as handle:
        for line, raw in enumerate(csv.DictReader(handle), start=2):
            if raw["scenario"] != "Offline" or not raw["result_per_accelerator"]:
                continue
            try:
                model = model_key(raw["model"], label=True)
                chip = chip_key(raw["accelerator"], label=True)
            except ValueError:
                continue
            if SKIP.search(raw["accelerator"]) or raw["weight_data_types"].lower() not in WEIGHTS:
                continue
            out.append(dict(line=line, model=model, chip=chip, scenario="Offline",
                            weights=WEIGHTS[raw["weight_data_types"].lower()],
                            accelerators=int(float(raw["total_accelerators"])),
                            per_node=max(int(float(raw["accel_per_node"])), 1),
                            software=raw["software"], submitter=raw["submitter"],
                            version=raw["mlperf_version"],
                            tput=float(raw["result_per_accelerator"]), raw=raw))
    return out


def _median(x):
    x = [v for v in x if np.isfinite(v)]
    return float(np.median(x)) if x else float("nan")


def _summary(rows, key):
    """Median |error| and median ratio of `key` against the measured result, overall and
    per model."""
    def one(rs):
        ratio = [r[key] / r["tput"] for r in rs]
        return {"n": len(rs), "median_abs_error": _median([abs(x - 1) for x in ratio]),
                "median_ratio": _median(ratio)}
    models = sorted({r["model"] for r in rows})
    groups = sorted({(r["model"], r["chip"], r["weights"]) for r in rows})
    return {"all": one(rows), "by_model": {m: one([r for r in rows if r["model"] == m])
                                           for m in models},
            "by_group": {" ".join(g): one([r for r in rows if (r["model"], r["chip"],
                                                                 r["weights"]) == g])
                         for g in groups}}


#: NVIDIA's MLPerf v4.1 closed H200 systems at two GPU power limits: the MaxQ one at 500 W
#: per GPU (`power_limit` of its configs, closed/NVIDIA/configs, as
#: calibration/power/mlperf_power.csv records), the other at the 700 W TDP.
MAXQ = (("H200-SXM-141GBx8_TRT", 700.0), ("H200-SXM-141GBx8_TRT_MaxQ", 500.0))


def maxq_pairs(path=DATA / "benchmarks_mlperf.csv") -> list[dict]:
    """The power cap against the one system measured at two power limits: each MAXQ
    platform's Offline row predicted at its power limit (`RowSpec.power_limit`), the ratio
    of the two predictions against the ratio of the two results (`perfmodel/power.py`
    takes its DVFS exponent from these pairs)."""
    import dataclasses

    with open(path, newline="") as handle:
        raw = [r for r in csv.DictReader(handle) if r["scenario"] == "Offline"
               and r["submitter"] == "NVIDIA" and r["mlperf_version"] == "v4.1"]
    out = []
    for model in ("llama2-70b-99", "mixtral-8x7b"):
        entry = {"model": model}
        for platform, limit in MAXQ:
            (row,) = [r for r in raw if r["platform"] == platform and r["model"] == model]
            spec = dataclasses.replace(mlperf.interpret(row), power_limit=limit)
            entry[f"predicted_{limit:.0f}w"] = mlperf.capacity(spec)["result"]
            entry[f"measured_{limit:.0f}w"] = float(row["result_per_accelerator"])
        entry["predicted_ratio"] = entry["predicted_500w"] / entry["predicted_700w"]
        entry["measured_ratio"] = entry["measured_500w"] / entry["measured_700w"]
        out.append(entry)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--maxq" in argv:
        # The power-cap check alone (about 20 s; writes nothing).
        for e in maxq_pairs():
            print(f"{e['model']}: H200 at 500 W against 700 W, Offline tokens/s per GPU: "
                  f"predicted {e['predicted_500w']:.0f} / {e['predicted_700w']:.0f} = "
                  f"{e['predicted_ratio']:.3f}, measured {e['measured_500w']:.0f} / "
                  f"{e['measured_700w']:.0f} = {e['measured_ratio']:.3f}")
        return 0
    start = time.time()
    # Offline: before (previous rules) and after (perfmodel.mlperf), same rows.
    offline = offline_rows()
    for row, before in zip(offline, legacy_offline(offline), strict=True):
        row["before"] = before
    raw_all = []
    with open(DATA / "benchmarks_mlperf.csv", newline="") as handle:
        raw_all = list(csv.DictReader(handle))
    predicted = mlperf.predict_rows(raw_all, progress=lambda i, n: i % 50 or print(
        f"[{i}/{n} {time.time() - start:.0f} s]", flush=True))
    by_line = {i + 2: p for i, p in enumerate(predicted)}
    for row in offline:
        p = by_line[row["line"]]
        row["after"] = float(p["pred_result_per_accelerator"] or "nan")
        row["config"], row["error"] = p["pred_config"], p["pred_error"]
        row["run_efficiency"] = float(p["pred_run_efficiency"] or "nan")
    # Server/Interactive: capacity (after) and the previous at-target prediction (echo).
    rows, skipped = load_rows()
    by_structure = {}
    for row in rows:
        by_structure.setdefault(_structure(row), []).append(row)
    for members in by_structure.values():
        for row, pred in zip(members, predict_rows(members), strict=True):
            row.update({f"echo_{k}": v for k, v in pred.items()})
            p = by_line[row["line"]]
            row["after"] = float(p["pred_result_per_accelerator"] or "nan")
            row["config"], row["error"] = p["pred_config"], p["pred_error"]
            row["saturated_at_target"] = p["pred_target_saturated"] == "yes"
            for key, col in (("ttft50", "pred_p50_ttft_ms"), ("ttft99", "pred_p99_ttft_ms"),
                             ("tpot50", "pred_p50_tpot_ms"), ("tpot99", "pred_p99_tpot_ms")):
                row[f"pred_{key}"] = float(p[col]) / 1e3 if p[col] else float("nan")
    scored = [r for r in offline if np.isfinite(r["after"])]
    serving = [r for r in rows if np.isfinite(r["after"])]
    summary = {
        "offline_before": _summary(offline, "before"),
        "offline_after": _summary(scored, "after"),
        "offline_unpredicted": {r["error"]: sum(1 for x in offline if x["error"] == r["error"])
                                for r in offline if not np.isfinite(r["after"])},
        "server_capacity": {s: _summary([r for r in serving if r["scenario"] == s], "after")
                            for s in ("Server", "Interactive")},
        "server_capacity_target_saturated": _summary(
            [r for r in serving if r["saturated_at_target"]], "after"),
        "server_echo_before": _summary(rows, "echo_tput"),
        "latency_at_target": {k: _median([abs(r[f"pred_{k}"] / r[k] - 1) for r in serving])
                              for k in ("ttft50", "ttft99", "tpot50", "tpot99")},
        "latency_at_target_before": {k: _median([abs(r[f"echo_{k}"] / r[k] - 1)
                                                 for r in rows])
                                     for k in ("ttft50", "ttft99", "tpot50", "tpot99")},
    }
    elapsed = time.time() - start
    text = report(summary, offline, serving, skipped, elapsed)
    for r in offline:
        r.pop("raw", None)
    (HERE / "mlperf_check.json").write_text(json.dumps(
        {"summary": summary, "offline": offline, "server": rows, "skipped": skipped,
         "lengths": mlperf.dataset_lengths(), "wall_s": elapsed}, indent=1,
        default=float) + "\n")
    sys.path.insert(0, str(HERE))
    from validate import replace_section
    replace_section(HERE / "README.md", text, tag="MLPERF")
    plot_offline(offline, HERE.parent / "docs" / "mlperf_offline.png")
    print(text)
    return 0


def plot_offline(offline: list[dict], path: pathlib.Path) -> None:
    """Parity plot of Offline output tokens/s per accelerator, before and after."""
    from matplotlib.figure import Figure

    from perfmodel.plots import save

    figure = Figure(figsize=(6.5, 6), layout="constrained")
    ax = figure.subplots()
    models = sorted({r["model"] for r in offline})
    for i, model in enumerate(models):
        rs = [r for r in offline if r["model"] == model]
        measured = np.array([r["tput"] for r in rs])
        ax.scatter(measured, [r["before"] for r in rs], s=12, marker="x", color=f"C{i}",
                   alpha=0.35)
        ax.scatter(measured, [r["after"] for r in rs], s=16, color=f"C{i}", label=model)
    low, high = 20.0, 6e4
    ax.plot([low, high], [low, high], "k-", lw=0.8)
    for k in (0.8, 1.25):
        ax.plot([low, high], [k * low, k * high], "k:", lw=0.6)
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high),
           xlabel="measured Offline output tokens/s per accelerator",
           ylabel="predicted (dots: searched configuration; x: previous rules)",
           title="MLPerf v4.1/v5.1 Offline (never fitted)")
    ax.legend(fontsize=7, loc="upper left")
    save(figure, str(path))


def _pct(x):
    return f"{100 * x:.1f} %" if np.isfinite(x) else "-"


def report(summary, offline, serving, skipped, elapsed) -> str:
    before, after = summary["offline_before"], summary["offline_after"]
    lines = [
        f"MLPerf v4.1/v5.1, shipped fit, never fitted on these rows ({elapsed:.0f} s). "
        "**Offline** (capacity): output tokens/s per accelerator, the model's best "
        "configuration (`perfmodel.mlperf`) against the previous rules (plain TP, assumed "
        f"input lengths). Rows: {before['all']['n']} ({after['all']['n']} predicted"
        + (", not predicted: " + ", ".join(f"{v} {k}" for k, v in
                                           summary["offline_unpredicted"].items())
           if summary["offline_unpredicted"] else "") + ").",
        "",
        "| model | rows | median ratio before | median ratio after | median error before "
        "| median error after | run efficiency after (median) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m, b in before["by_model"].items():
        a = after["by_model"].get(m, {"n": 0, "median_ratio": float("nan"),
                                      "median_abs_error": float("nan")})
        eff = _median([r["run_efficiency"] for r in offline
                       if r["model"] == m and np.isfinite(r["run_efficiency"])])
        lines.append(f"| {m} | {b['n']} | {b['median_ratio']:.2f} | {a['median_ratio']:.2f} | "
                     f"{_pct(b['median_abs_error'])} | {_pct(a['median_abs_error'])} | "
                     f"{eff:.3f} |")
    lines.append(f"| **all** | {before['all']['n']} | {before['all']['median_ratio']:.2f} | "
                 f"{after['all']['median_ratio']:.2f} | "
                 f"{_pct(before['all']['median_abs_error'])} | "
                 f"{_pct(after['all']['median_abs_error'])} | "
                 f"{_median([r['run_efficiency'] for r in offline]):.3f} |")
    expected = {}
    for r in offline:
        try:
            ratio = float(r["raw"]["target_qps"]) / float(r["raw"]["samples_per_s"])
        except (KeyError, ValueError, ZeroDivisionError):
            continue
        expected.setdefault(r["model"], []).append(ratio)
    lines += ["", "Offline rows' `target_qps` (read as the submitter's requested "
              "`offline_expected_qps`, which sets LoadGen's sample count; UNVERIFIED reading "
              "of the column) over the rate they scored (`samples_per_s`), median (range) per "
              "model: " + "; ".join(
                  f"{m} {_median(v):.2f} ({min(v):.2f}-{max(v):.2f}, {len(v)} rows)"
                  for m, v in sorted(expected.items())) + "."]
    lines += ["", "Offline per model, accelerator and weight type (after):", "",
              "| model | accelerator | weights | rows | median ratio | median error |",
              "| --- | --- | --- | ---: | ---: | ---: |"]
    for g, v in after["by_group"].items():
        lines.append("| " + " | ".join(g.split(" ")) + f" | {v['n']} | "
                     f"{v['median_ratio']:.2f} | {_pct(v['median_abs_error'])} |")
    lines += ["", "**Server / Interactive capacity** (the highest Poisson rate meeting the "
              "row's p99 TTFT/TPOT limits, steady-state approximation, against the submitted "
              "result; a capacity test, unlike the at-target throughput below):", "",
              "| scenario | model | rows | median ratio | median error |",
              "| --- | --- | ---: | ---: | ---: |"]
    for s, summ in summary["server_capacity"].items():
        for m, v in summ["by_model"].items():
            lines.append(f"| {s} | {m} | {v['n']} | {v['median_ratio']:.2f} | "
                         f"{_pct(v['median_abs_error'])} |")
        lines.append(f"| **{s}** | | {summ['all']['n']} | {summ['all']['median_ratio']:.2f} | "
                     f"{_pct(summ['all']['median_abs_error'])} |")
    sat = summary["server_capacity_target_saturated"]["all"]
    lines += ["", f"Of these, {sat['n']} rows have a `target_qps` above the predicted capacity "
              f"(`pred_target_saturated`): median ratio {sat['median_ratio']:.2f}, median "
              f"error {_pct(sat['median_abs_error'])}."]
    echo = summary["server_echo_before"]["all"]
    lat, lat0 = summary["latency_at_target"], summary["latency_at_target_before"]
    lines += ["", f"**Echo rows** (throughput at the row's own `target_qps`, the previous "
              f"check): median error {_pct(echo['median_abs_error'])} over {echo['n']} rows; it "
              "is the offered load wherever the model keeps up, so it is not a capacity test "
              "and is not mixed into the figures above. Latencies at the target QPS, median "
              "|error| before -> after (searched configuration, data-set lengths): "
              + ", ".join(f"{k} {_pct(lat0[k])} -> {_pct(lat[k])}" for k in lat) + ".",
              "", "Skipped Server/Interactive rows: "
              + ", ".join(f"{v} {k}" for k, v in sorted(skipped.items())) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
