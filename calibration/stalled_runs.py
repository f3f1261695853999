"""InferenceMAX runs with a stall: `python calibration/stalled_runs.py`.

Some runs of the shipped InferenceMAX rows kept requests waiting tens of seconds for their
first token (`BenchRow.stalled`: p99 TTFT above 30 s and above 20 x the run's median
TTFT), which stretches the run and lowers its measured throughput. Per (model, chip,
framework) group that has any, prints how many rows are stalled and the median and
90th-percentile absolute throughput error of the shipped fit's predictions
(`perfmodel.calibration.predict_rows`) on the stalled rows and on the others; then, over all
groups, the median and p90 errors of throughput, median TPOT and median TTFT on the fit's
rows and the held-out ones, stalled or not. The latency fit fits a stalled row's medians,
not its throughput; the validation scores every row as measured (`calibration/README.md`,
"Stalled runs").
"""

from __future__ import annotations

import collections
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import fit as fitting  # noqa: E402

from perfmodel.calibration import predict_rows  # noqa: E402
from perfmodel.datasets import load_benchmarks  # noqa: E402

#: Predicted column -> measured column of the errors in the split table.
METRICS = {"throughput": ("pred_tput_per_chip_total", "tput_per_gpu"),
           "TPOT": ("pred_tpot_s", "median_tpot_s"), "TTFT": ("pred_ttft_s", "median_ttft_s")}


def _stat(errors) -> str:
    return f"{100 * np.median(errors):.1f} ({100 * np.percentile(errors, 90):.0f}) %"


def main() -> int:
    rows = load_benchmarks(HERE / "data" / "benchmarks_inferencemax.csv")
    predicted = predict_rows(tuple(rows))
    held = {row.index for row in fitting.split(rows)[1]}
    groups = collections.defaultdict(lambda: ([], []))
    splits = collections.defaultdict(list)
    for row, pred in zip(rows, predicted, strict=True):
        stalled = row.stalled
        errors = [abs(pred[p] / row.measured[m] - 1.0) for p, m in METRICS.values()]
        groups[(row.model, row.hardware, row.framework)][0 if stalled else 1].append(errors[0])
        splits[("held out" if row.index in held else "fitted", stalled)].append(errors)
    print("| model | chip | framework | rows | stalled | stalled: median / p90 error | "
          "others: median / p90 error |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for (model, chip, framework), (bad, good) in sorted(groups.items()):
        if not bad:
            continue
        stats = [f"{100 * np.median(e):.1f} / {100 * np.percentile(e, 90):.0f} %" if e
                 else "-" for e in (bad, good)]
        print(f"| {model} | {chip} | {framework} | {len(bad) + len(good)} | {len(bad)} | "
              f"{stats[0]} | {stats[1]} |")
    print("\nAbsolute error, median (p90), of the rows of the fit and the held-out rows "
          "(fit.split, as calibration/heldout.json lists them), stalled or not:\n")
    print("| rows | stalled | n | " + " | ".join(METRICS) + " |")
    print("| --- | --- | ---: |" + " ---: |" * len(METRICS))
    for (split, stalled), errors in sorted(splits.items()):
        errors = np.asarray(errors)
        print(f"| {split} | {'yes' if stalled else 'no'} | {len(errors)} | "
              + " | ".join(_stat(errors[:, k]) for k in range(len(METRICS))) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
