"""MLPerf Inference Server/Interactive check: `python calibration/mlperf_check.py`.

Predicts the MLPerf v4.1/v5.1 Server and Interactive rows of `data/benchmarks_mlperf.csv`
whose model and accelerator are presets (variants with other memory or power, NVL/PCIe
cards, mixed systems are skipped) with the shipped fit, and compares output tokens/s per
accelerator and TTFT/TPOT p50 and p99. Nothing here is fitted: MLPerf is a check only.

Assumptions (stated in calibration/README.md):

- Load: open loop, Poisson arrivals at the row's `target_qps` (MLPerf Server/Interactive
  LoadGen), solved as the model's fixed point c = rate x E2E(c) (`serving` open-loop
  definition) on a grid of concurrencies; when no fixed point exists the system is
  predicted saturated and the row is evaluated where its predicted throughput first reaches
  99 % of its peak (the largest batch that fits; queueing beyond it is not counted).
- No synchronized start (LoadGen's Poisson arrivals), so no first-wave burst in p99 TTFT
  (`Workload.first_wave_fraction` ~ 0); the p99 figures still take fixed lengths.
- Output lengths: the data set's mean tokens per sample (`mlperf_dataset_lengths.csv`,
  reference mean) at a fixed length. Input means are NOT published: `ASSUMED_INPUT` below.
- Layout: the smallest power-of-two tensor-parallel group (up to the node) whose weights
  take at most 60 % of the usable HBM, replicated over the system's accelerators; the
  framework is TensorRT-LLM ("trt") for TensorRT software, else vLLM.
- Precision: the row's weight data type as logged (fp16 -> bf16; NVIDIA's v4.1 Llama-2-70B
  rows log fp16 although TensorRT-LLM's MLPerf recipes quantize to FP8: UNVERIFIED), FP8 KV
  where the chip runs FP8.
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


def main(argv=None):
    start = time.time()
    rows, skipped = load_rows()
    by_structure = {}
    for row in rows:
        by_structure.setdefault(_structure(row), []).append(row)
    results = []
    for members in by_structure.values():
        for row, pred in zip(members, predict_rows(members), strict=True):
            results.append({**row, **{f"pred_{k}": v for k, v in pred.items()}})
    groups = {}
    for r in results:
        groups.setdefault((r["model"], r["chip"], r["scenario"]), []).append(r)
    lines = [
        "| model | chip | scenario | n | saturated | tput/acc med | TTFT p50 med | "
        "TTFT p99 med | TPOT p50 med | TPOT p99 med |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    summary = []

    def ape(rs, key):
        return float(np.median([abs(r[f"pred_{key}"] / r[key] - 1) * 100 for r in rs]))

    for key in sorted(groups) + [("all", "", "")]:
        rs = results if key[0] == "all" else groups[key]
        entry = {"model": key[0], "chip": key[1], "scenario": key[2], "n": len(rs),
                 "saturated": sum(r["pred_saturated"] for r in rs),
                 **{k: ape(rs, k) for k in ("tput", "ttft50", "ttft99", "tpot50", "tpot99")}}
        summary.append(entry)
        name = "**all**" if key[0] == "all" else key[0]
        lines.append(f"| {name} | {key[1]} | {key[2]} | {entry['n']} | {entry['saturated']} | "
                     + " | ".join(f"{entry[k]:.1f}%" for k in ("tput", "ttft50", "ttft99",
                                                              "tpot50", "tpot99")) + " |")
    elapsed = time.time() - start
    text = ("Median APE of the shipped fit on MLPerf Server/Interactive rows (a check, never "
            f"fitted; {len(results)} rows, skipped: "
            + ", ".join(f"{v} {k}" for k, v in sorted(skipped.items()))
            + f"; {elapsed:.0f} s). `saturated`: the model finds no steady state at the "
            "target QPS (or the layout does not fit), so its figures are those at "
            "saturation.\n\n" + "\n".join(lines) + "\n")
    (HERE / "mlperf_check.json").write_text(json.dumps(
        {"summary": summary, "rows": results, "skipped": skipped}, indent=1) + "\n")
    sys.path.insert(0, str(HERE))
    from validate import replace_section
    replace_section(HERE / "README.md", text, tag="MLPERF")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
