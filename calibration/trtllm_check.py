"""TensorRT-LLM Offline throughput check: `python calibration/trtllm_check.py` (about
2 minutes on 2 cores). Writes `trtllm_check.json` (every row with its prediction) and the
TRTLLM block of `calibration/README.md`.

NVIDIA's published `trtllm-bench` throughput tables (`data/benchmarks_trtllm.csv`, table
"throughput", the ~v1.0 perf-overview: total output tokens/s of the whole TP group at an
infinite request rate, fixed input and output lengths) are an Offline capacity
measurement on the same software as the MLPerf TensorRT rows, for models and formats the
fit never saw (Llama-3.1-8B, Llama-3.3-70B, Llama-3.1-405B, Llama 4, Qwen3, in FP8 and
FP4). Each row is predicted as MLPerf Offline is (`perfmodel.mlperf`): the table's own
layout (tp, pp, ep; DP attention off), TensorRT-LLM's fitted runtime, the best output
throughput over batches that fit in memory. Nothing here is fitted and no measured column
is read before the comparison.

The v0.17 table is left out: its note says it is UNCERTAIN whether it counts output or
input plus output tokens.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from perfmodel import datasets, fitted, mlperf  # noqa: E402
from perfmodel.design import Design, Layout, SliceMapping, precision  # noqa: E402
from perfmodel.formats import COMPUTE_CLASSES  # noqa: E402
from perfmodel.presets import get_chip, get_model  # noqa: E402
from perfmodel.sweep import batch_that_fits  # noqa: E402
from perfmodel.workload import Workload  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE / "data"
#: The table's model names -> presets.
MODELS = {"Llama 3.1 8B": "llama-3.1-8b", "Llama 3.3 70B": "llama-3.1-70b",
          "Llama 3.1 405B": "llama-3.1-405b", "Llama 4 Scout": "llama-4-scout",
          "Llama 4 Maverick": "llama-4-maverick", "Qwen3-235B-A22B": "qwen3-235b-a22b",
          "Qwen3-30B-A3B": "qwen3-30b-a3b"}
#: The table's systems -> presets (one GPU of each).
CHIPS = {"B200 180GB (DGX B200)": "b200", "GB200 192GB (GB200 NVL72)": "gb200",
         "H100 SXM 80GB (DGX H100)": "h100", "H200 SXM 141GB (DGX H200)": "h200"}


def load_rows(path=DATA / "benchmarks_trtllm.csv") -> list[dict]:
    """The ~v1.0 Offline rows: model, chip, tp, pp, ep, precision, isl, osl and the
    measured output tokens/s per GPU."""
    out = []
    with open(path, newline="") as handle:
        for raw in csv.DictReader(handle):
            if raw["table"] != "throughput" or raw["metric"] != "output_tok_s_total":
                continue
            if raw["model"] not in MODELS or raw["hardware"] not in CHIPS:
                continue
            gpus = int(raw["num_gpus"])
            out.append(dict(model=MODELS[raw["model"]], chip=CHIPS[raw["hardware"]],
                            tp=int(raw["tp"]), pp=int(raw["pp"] or 1),
                            ep=int(raw["ep"] or 1), gpus=gpus,
                            precision=raw["precision"].lower(), isl=float(raw["isl"]),
                            osl=float(raw["osl"]),
                            measured=float(raw["value"]) / gpus))
    return out


def predict_row(row: dict) -> dict:
    """Best output tokens/s per GPU of the row's layout over batches that fit, with the
    batch that reaches it; `error` when it does not fit."""
    model, chip = get_model(row["model"]), get_chip(row["chip"])
    kv = "fp8" if "fp8" in chip.native_classes else None
    prec = precision(chip, model, row["precision"], kv=kv)
    runtime = fitted.runtime_for("trt")
    layout = Layout(tp=row["tp"], pp=row["pp"], ep=row["ep"])
    fit = batch_that_fits(model, chip, prec, runtime, layout, row["isl"] + row["osl"] / 2.0)
    if fit < 1.0:
        return {"predicted": math.nan, "batch": math.nan,
                "error": "weights and one sequence do not fit"}
    grid = np.minimum(np.asarray(mlperf.GRID), math.floor(fit))
    grid[-1] = math.floor(fit)
    # Fixed lengths (the table's synthetic data set has none other), no opening burst.
    workload = Workload(row["isl"], row["osl"], input_range_ratio=1.0,
                        output_range_ratio=1.0, first_wave_fraction=1e-6)
    design = Design(concurrency=1.0, layout=layout, precision=prec, runtime=runtime,
                    mapping=SliceMapping())
    m = mlperf._evaluate(model, chip, workload, design, jnp.asarray(grid))
    out = np.where(np.asarray(m.fits), np.asarray(m.output_throughput_per_chip), np.nan)
    k = int(np.nanargmax(out))
    return {"predicted": float(out[k]), "batch": float(grid[k]), "error": ""}


def summarize(rows: list[dict]) -> dict:
    """Median ratio and median |error| overall and per (model, chip, precision)."""
    ok = [r for r in rows if np.isfinite(r["predicted"])]

    def stats(group):
        ratio = np.array([r["predicted"] / r["measured"] for r in group])
        return {"n": len(group), "median_ratio": float(np.median(ratio)),
                "median_error": float(np.median(np.abs(ratio - 1.0)))}

    groups = {}
    for r in ok:
        groups.setdefault((r["model"], r["chip"], r["precision"]), []).append(r)
    return {"all": stats(ok), "not_predicted": len(rows) - len(ok),
            "groups": [{"model": k[0], "chip": k[1], "precision": k[2], **stats(v)}
                       for k, v in sorted(groups.items())]}


def table(summary: dict) -> str:
    lines = ["| model | chip | format | rows | median ratio | median error |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    for g in summary["groups"]:
        lines.append(f"| {g['model']} | {g['chip']} | {g['precision']} | {g['n']} | "
                     f"{g['median_ratio']:.2f} | {100 * g['median_error']:.1f} % |")
    a = summary["all"]
    lines.append(f"| **all** | | | {a['n']} | {a['median_ratio']:.2f} | "
                 f"{100 * a['median_error']:.1f} % |")
    return "\n".join(lines)


def gemm_fractions(path=DATA / "benchmarks_aic_gemm.csv", chips=("b200", "h200")) -> str:
    """Measured fraction of peak FLOP/s of large GEMMs per format (m >= 2048, n = k in
    {4096, 16384}; aiconfigurator's timings, the op-level data of the latency fit): the
    range per chip and dtype, against the preset's peak of the dtype's compute class."""
    spans = {}
    for g in datasets.load_gemm(path):
        if g["chip"] not in chips or g["m"] < 2048 or g["n"] != g["k"] \
                or g["n"] not in (4096.0, 16384.0):
            continue
        peak = float(get_chip(g["chip"], calibrated=False).peak_flops[
            COMPUTE_CLASSES.index(datasets.GEMM_DTYPES[g["dtype"]][2])])
        frac = 2.0 * g["m"] * g["n"] * g["k"] / g["seconds"] / peak
        lo, hi = spans.get((g["chip"], g["dtype"]), (math.inf, 0.0))
        spans[(g["chip"], g["dtype"])] = (min(lo, frac), max(hi, frac))
    return "; ".join(f"{chip} {dtype} {100 * lo:.0f}-{100 * hi:.0f} %"
                     for (chip, dtype), (lo, hi) in sorted(spans.items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, default=HERE / "trtllm_check.json",
                        help="where to write every row with its prediction")
    parser.add_argument("--no-readme", action="store_true",
                        help="print the table without rewriting calibration/README.md")
    args = parser.parse_args(argv)
    start = time.time()
    rows = [dict(r, **predict_row(r)) for r in load_rows()]
    summary = summarize(rows)
    text = (f"TensorRT-LLM perf-overview (~v1.0) Offline rows, shipped fit, never fitted "
            f"(`python calibration/trtllm_check.py`, {time.time() - start:.0f} s): output "
            f"tokens/s per GPU, predicted over measured, {len(rows)} rows "
            f"({summary['not_predicted']} not predicted).\n\n{table(summary)}\n\n"
            f"Measured fraction of peak of large GEMMs (m >= 2048, n = k = 4096 or 16,384; "
            f"`benchmarks_aic_gemm.csv`, the latency fit's op-level data): "
            f"{gemm_fractions()}.")
    print(text)
    args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    if not args.no_readme:
        sys.path.insert(0, str(HERE))
        from validate import replace_section
        replace_section(HERE / "README.md", text, tag="TRTLLM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
