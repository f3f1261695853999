"""`perfmodel predict IN.csv --out OUT.csv`: predictions for every row of a benchmark table.

IN has the columns of `benchmarks_inferencemax.csv` (model, hardware, framework, precision,
spec_decoding, disagg, isl, osl, conc, tp, ep, dp_attention and, for disaggregated rows,
the prefill_/decode_ layout columns; measured columns may be missing) or those of
`power_measurements.csv` (handed to `perfmodel.calibration_power.predict_power_rows`).
OUT repeats every input row and adds the `pred_*` columns (`Metrics.to_row("pred_")`
names: `pred_tput_per_chip_total`, `pred_ttft_s`, `pred_power_w_modelled`, ...),
`pred_model` and `pred_chip` (the presets the row's names resolved to), `pred_basis` (which
fitted parameters were used; chips without measurements are predicted from their specs
with their family's fit), `pred_error` (why a row has no prediction, a deployment that
does not fit in HBM among them; the other rows still run) and `pred_fit` (the fitted
parameters' versions).
"""

from __future__ import annotations

import argparse
import csv
import sys

from ..calibration import PREDICTION_KEYS, predict_rows
from ..datasets import INFERENCEMAX_INPUTS, DataError, load_benchmarks, read_table
from . import check_output, versions

#: Columns that mark a power_measurements.csv-style file.
POWER_COLUMNS = ("num_gpus", "parallelism")


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "predict", help="predict every row of a benchmark CSV",
        description="Predict throughput, latency and power for every row of an "
                    "InferenceMAX-style (or power-measurement-style) CSV with the shipped fit.")
    parser.add_argument("input", metavar="IN.csv", help="rows to predict")
    parser.add_argument("--out", metavar="OUT.csv", default="-",
                        help="output CSV (default: standard output)")
    parser.set_defaults(func=run)
    return parser


def predict_file(path: str) -> tuple[list[str], list[dict]]:
    """(output columns, output rows) for an input CSV.

    Raises:
        DataError (a ValueError): a missing column or corrupt value, naming file, line,
            column.
    """
    table = read_table(path)
    columns = list(table.columns)
    if all(c in columns for c in POWER_COLUMNS) and "conc" not in columns:
        from ..calibration_power import predict_power_rows
        out = [dict(row, pred_fit=_fit()) for row in
               predict_power_rows([dict(r) for r in table.rows])]
        extra = [k for k in (out[0] if out else {}) if k not in columns]
        return columns + extra, out
    missing = [c for c in INFERENCEMAX_INPUTS if c not in columns]
    if missing:
        raise DataError(f"{path}, line 1: missing column(s) {', '.join(map(repr, missing))}; "
                        "expected the columns of benchmarks_inferencemax.csv or of "
                        "power_measurements.csv")
    rows = load_benchmarks(path)
    predictions = predict_rows(rows)
    out = []
    for raw, pred in zip(table.rows, predictions, strict=True):
        entry = dict(raw)
        for key in PREDICTION_KEYS:
            value = pred.get(key)
            entry[key] = "" if value is None else f"{value:.6g}"
        for key in DESCRIPTION_KEYS:
            entry[key] = pred.get(key, "")
        entry["pred_fit"] = _fit()
        out.append(entry)
    return columns + list(PREDICTION_KEYS) + list(DESCRIPTION_KEYS) + ["pred_fit"], out


#: What each prediction row says about itself beside the numbers: the presets its names
#: resolved to, the fitted family used, and why it has no numbers.
DESCRIPTION_KEYS = ("pred_model", "pred_chip", "pred_basis", "pred_error")


def _fit() -> str:
    """The fitted parameters the predictions come from (`pred_fit`)."""
    v = versions()
    return f"{v['fitted_latency']}; {v['fitted_power']}; perfmodel {v['perfmodel_version']}"


def run(args) -> int:
    if args.out != "-":
        check_output(args.out, "--out")
    columns, rows = predict_file(args.input)
    handle = sys.stdout if args.out == "-" else open(args.out, "w", newline="")
    try:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    finally:
        if handle is not sys.stdout:
            handle.close()
    if args.out != "-":
        key = "pred_tput_per_chip_total" if "pred_tput_per_chip_total" in columns else columns[-1]
        failed = sum(1 for r in rows if r.get(key) in ("", None))
        print(f"predicted {len(rows) - failed} of {len(rows)} rows -> {args.out}",
              file=sys.stderr)
    return 0
