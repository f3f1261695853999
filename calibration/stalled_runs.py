"""InferenceMAX runs with a stall: `python calibration/stalled_runs.py`.

Some runs of the shipped InferenceMAX rows kept requests waiting tens of seconds for their
first token (p99 TTFT above `SECONDS` and above `RATIO` x the run's median TTFT), which
stretches the run and lowers its measured throughput. Per (model, chip, framework) group
that has any, prints how many rows are stalled and the median and 90th-percentile absolute
throughput error of the shipped fit's predictions (`perfmodel.calibration.predict_rows`)
on the stalled rows and on the others. The rows stay in the fit and the validation as
measured; this only names them (`calibration/README.md`, "Groups worse than 25 %").
"""

from __future__ import annotations

import collections
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from perfmodel.calibration import predict_rows  # noqa: E402
from perfmodel.datasets import load_benchmarks  # noqa: E402

#: A stall: p99 TTFT above this many seconds and above `RATIO` x the median TTFT.
SECONDS = 30.0
RATIO = 20.0


def main() -> int:
    rows = load_benchmarks(HERE / "data" / "benchmarks_inferencemax.csv")
    predicted = predict_rows(tuple(rows))
    groups = collections.defaultdict(lambda: ([], []))
    for row, pred in zip(rows, predicted, strict=True):
        tail = row.measured["p99_ttft_s"]
        stalled = tail > SECONDS and tail > RATIO * row.measured["median_ttft_s"]
        error = abs(pred["pred_tput_per_chip_total"] / row.measured["tput_per_gpu"] - 1.0)
        groups[(row.model, row.hardware, row.framework)][0 if stalled else 1].append(error)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
