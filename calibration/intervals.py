"""Prediction intervals of the shipped fit and their calibration:
`python calibration/intervals.py [--level 0.9]`.

From the shipped `perfmodel/data/fitted_params.json` (no refit) and its fit rows (the
InferenceMAX rows not in `calibration/heldout.json`, plus GEMM/NCCL), writes the parameter
covariance and model-error terms to `perfmodel/data/fitted_intervals.json`
(`fit.fit_intervals`, what `fit.py` writes after a fit), then predicts the held-out rows with
their intervals and reports, per metric, the share of held-out rows whose measurement lies
inside: `calibration/intervals.json` and the INTERVALS section of `calibration/README.md`.
The held-out rows are only counted, never used to size the intervals.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import equinox as eqx
import fit as fitting
import numpy as np
import validate

from perfmodel import calibration as cal
from perfmodel import fitted as shipped
from perfmodel.calibration import intervals as iv
from perfmodel.calibration.params import resolve_framework
from perfmodel.calibration.predict import add_bounds, linearize

HERE = pathlib.Path(__file__).resolve().parent
LEVELS = (0.5, 0.8, 0.9, 0.95)
SHORT = {"pred_tput_per_chip_total": "throughput/GPU", "pred_output_tput_per_chip":
         "output throughput/GPU", "pred_ttft_s": "median TTFT", "pred_tpot_s": "median TPOT",
         "pred_e2e_s": "median E2E", "pred_interactivity": "median interactivity",
         "pred_p99_ttft_s": "p99 TTFT", "pred_p99_tpot_s": "p99 TPOT"}


def coverage(rows, entries, params, intervals, level, gaussian=False) -> dict:
    """{metric: {"inside", "n", "share", "below", "above", "width_median"}} of rows with a
    prediction and a measurement of the metric."""
    if gaussian:
        # The same covariance and scales with normal quantiles (+-1.645 at 90 %).
        intervals = eqx.tree_at(lambda i: i.quantiles, intervals,
                                iv.Intervals.at_priors(params).quantiles)
    out = {}
    bounded = [add_bounds(dict(e), params, None, intervals, level) for e in entries]
    for key in iv.INTERVAL_KEYS:
        column = iv.MEASURED[key]
        inside = below = above = 0
        widths = []
        for row, b in zip(rows, bounded, strict=True):
            if column not in row.measured or b.get(key + "_lo") is None:
                continue
            y = row.measured[column]
            below += y < b[key + "_lo"]
            above += y > b[key + "_hi"]
            inside += b[key + "_lo"] <= y <= b[key + "_hi"]
            widths.append(b[key + "_hi"] / b[key + "_lo"])
        n = inside + below + above
        out[key] = {"measured": column, "n": n, "inside": inside, "below": below,
                    "above": above, "share": inside / n if n else float("nan"),
                    "width_median": float(np.median(widths)) if widths else float("nan")}
    return out


def markdown(report: dict, level: float) -> str:
    held, fit_rows, gauss = (report["heldout"][str(level)], report["fitted"][str(level)],
                             report["heldout_gaussian"][str(level)])
    lines = [f"Share of rows inside the {level:.0%} prediction interval, per metric "
             f"(target for held-out rows: {level - 0.05:.0%}-{level + 0.05:.0%}). Generated "
             f"by `python calibration/intervals.py` ({report['seconds']} s).", "",
             "| metric | held-out n | held-out inside | below / above | median hi/lo | "
             "fit rows inside | held-out, Gaussian z |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in iv.INTERVAL_KEYS:
        h, f, g = held[key], fit_rows[key], gauss[key]
        fitted_mark = " (fitted)" if key in iv.FITTED else ""
        lines.append(f"| {SHORT[key]}{fitted_mark} | {h['n']} | {h['share']:.1%} | "
                     f"{h['below']} / {h['above']} | {h['width_median']:.2f}x | "
                     f"{f['share']:.1%} | {g['share']:.1%} |")
    lines += ["", f"Held-out share inside the {level:.0%} interval and median hi/lo per "
              "framework (the model-error scale is per framework):", "",
              "| framework | n | " + " | ".join(SHORT[k] for k in iv.FITTED) + " |",
              "| --- | ---: | " + " | ".join("---:" for _ in iv.FITTED) + " |"]
    for name, cov in report["heldout_by_framework"].items():
        n = cov[next(iter(iv.FITTED))]["n"]
        lines.append(f"| {name} | {n} | " + " | ".join(
            f"{cov[k]['share']:.0%} ({cov[k]['width_median']:.2f}x)" for k in iv.FITTED)
            + " |")
    lines += ["", "Held-out share at other levels: " + "; ".join(
        f"{lv:.0%}: " + ", ".join(f"{SHORT[k]} {report['heldout'][str(lv)][k]['share']:.1%}"
                                  for k in iv.FITTED) for lv in LEVELS if lv != level),
              "", "Model-error scale (robust sd of log residuals on the fit rows): " + ", ".join(
                  f"{c} {s:.3f}" for c, s in report["summary"]["scale"].items()) + "; median "
              "parameter sd of a fit row's log prediction: " + ", ".join(
                  f"{c} {s:.4f}" for c, s in report["summary"]["parameter_sd_median"].items())
              + "."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--level", type=float, default=0.9)
    args = parser.parse_args(argv)
    start = time.time()
    rows, gemm, nccl = fitting.load_all()
    fitted_rows, held = fitting.split(rows)
    data = shipped.read(shipped.LATENCY_FILE)
    params = cal.from_json(data)
    lin = linearize(rows, params)
    print(f"linearized {len(rows)} rows ({time.time() - start:.0f} s)", flush=True)
    by_index = {r.index: e for r, e in zip(rows, lin, strict=True)}
    intervals, summary = fitting.fit_intervals(
        fitted_rows, data, gemm, nccl, linearized=[by_index[r.index] for r in fitted_rows])
    report = {"fit": {k: data.get(k) for k in ("date", "result", "steps", "pooling")},
              "summary": summary, "heldout": {}, "fitted": {}, "heldout_gaussian": {}}
    for level in sorted(set(LEVELS) | {args.level}):
        for name, subset in (("heldout", held), ("fitted", fitted_rows)):
            report[name][str(level)] = coverage(subset, [by_index[r.index] for r in subset],
                                                params, intervals, level)
        report["heldout_gaussian"][str(level)] = coverage(
            held, [by_index[r.index] for r in held], params, intervals, level, gaussian=True)
    report["heldout_by_framework"] = {}
    for name in sorted({resolve_framework(r.framework, params.frameworks) for r in held}):
        subset = [r for r in held if resolve_framework(r.framework, params.frameworks) == name]
        report["heldout_by_framework"][name or "priors"] = coverage(
            subset, [by_index[r.index] for r in subset], params, intervals, args.level)
    report["seconds"] = round(time.time() - start, 1)
    (HERE / "intervals.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report, args.level)
    validate.replace_section(HERE / "README.md", text, tag="INTERVALS")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
