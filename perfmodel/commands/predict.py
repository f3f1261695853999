"""`perfmodel predict IN.csv --out OUT.csv`: predictions for every row of a benchmark table.

IN has the columns of `benchmarks_inferencemax.csv` (model, hardware, framework, precision,
spec_decoding, disagg, isl, osl, conc, tp, ep, dp_attention and, for disaggregated rows,
the prefill_/decode_ layout columns; measured columns may be missing) or those of
`power_measurements.csv` (handed to `perfmodel.calibration_power.predict_power_rows`) or
those of `benchmarks_mlperf.csv` (MLPerf Inference results, handed to
`perfmodel.mlperf.predict_rows`: each scenario's own metric, `pred_result_per_accelerator`
in tokens/s per accelerator - Offline's best throughput over the run LoadGen times (its
steady rate x `pred_run_efficiency`), Server/Interactive's highest Poisson rate meeting the
row's p99 TTFT/TPOT limits - and the latencies at the row's `target_qps`,
`pred_p50_ttft_ms`, `pred_p99_ttft_ms`, `pred_p50_tpot_ms`, `pred_p99_tpot_ms`, with
`pred_config`, `pred_basis` and `pred_error`).
OUT repeats every input row and adds the `pred_*` columns (`Metrics.to_row("pred_")`
names: `pred_tput_per_chip_total`, `pred_ttft_s`, `pred_power_w_modelled`, ...),
`pred_model` and `pred_chip` (the presets the row's names resolved to), `pred_basis` (which
fitted parameters were used; chips without measurements are predicted from their specs
with their family's fit), `pred_error` (why a row has no prediction, a deployment that
does not fit in HBM among them; the other rows still run) and `pred_fit` (the fitted
parameters' versions). `--interval 0.9` adds a 90 % prediction interval,
`pred_<metric>_lo` and `pred_<metric>_hi`, for every latency and throughput column
(`perfmodel.calibration.intervals`: the fit's parameter covariance propagated to the row plus
the fit rows' model error; off by default, as the Jacobian of every row costs about 5x the
prediction) and for power and J per output token (`perfmodel.calibration_power.intervals`:
the power fit's residuals on models it did not see, scaled per harness and chip family);
on power-measurement rows, for power, J per output token and output tokens/s.
"""

from __future__ import annotations

import argparse
import csv
import functools
import sys

from ..datasets import INFERENCEMAX_INPUTS, DataError, load_benchmarks, read_table
from . import check_output, number, provenance, versions

#: Columns that mark a power_measurements.csv-style file.
POWER_COLUMNS = ("num_gpus", "parallelism")


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "predict", help="predict every row of a benchmark CSV",
        description="Predict throughput, latency and power for every row of an "
                    "InferenceMAX-style (or power-measurement-style) CSV with the shipped fit.")
    parser.add_argument("input", metavar="IN.csv", nargs="?", help="rows to predict")
    parser.add_argument("--design", metavar="DESIGN.json",
                        help="instead of rows: the design of a `perfmodel optimize --format "
                             "json` output (its `spec`), evaluated as the optimizer did; "
                             "writes its metrics as JSON")
    parser.add_argument("--interval", metavar="LEVEL", default=None,
                        type=number(0.0, 1.0, low_open=True, high_open=True,
                                    meaning="a central level, e.g. 0.9"),
                        help="add a central prediction interval of this level (0.9: 90 %%) "
                             "as pred_<metric>_lo / pred_<metric>_hi columns (about 5x "
                             "slower on InferenceMAX-style rows) (default: none)")
    parser.add_argument("--out", metavar="OUT.csv", default="-",
                        help="output CSV (JSON with --design) (default: standard output)")
    parser.set_defaults(func=run)
    return parser


def predict_file(path: str, interval: float | None = None) -> tuple[list[str], list[dict]]:
    """(output columns, output rows) for an input CSV; with `interval` (a level in (0, 1))
    the bounds of that prediction interval (`INTERVAL_KEYS` columns + "_lo", "_hi").

    Raises:
        DataError (a ValueError): a missing column or corrupt value, naming file, line,
            column.
    """
    table = read_table(path)
    columns = list(table.columns)
    from ..mlperf import COLUMNS as MLPERF_COLUMNS
    from ..mlperf import is_mlperf_table
    if is_mlperf_table(columns):
        from ..mlperf import predict_rows as predict_mlperf
        out = [dict(raw, **pred, pred_fit=_fit()) for raw, pred in
               zip(table.rows, predict_mlperf([dict(r) for r in table.rows]), strict=True)]
        extra = [k for k in MLPERF_COLUMNS if k not in columns]
        return columns + extra + ["pred_fit"], out
    if all(c in columns for c in POWER_COLUMNS) and "conc" not in columns:
        from ..calibration_power import predict_power_rows
        out = [dict(row, pred_fit=_fit()) for row in
               predict_power_rows([dict(r) for r in table.rows], interval=interval)]
        extra = [k for k in (out[0] if out else {}) if k not in columns]
        return columns + extra, out
    missing = [c for c in INFERENCEMAX_INPUTS if c not in columns]
    if missing:
        raise DataError(f"{path}, line 1: missing column(s) {', '.join(map(repr, missing))}; "
                        "expected the columns of benchmarks_inferencemax.csv or of "
                        "power_measurements.csv or of benchmarks_mlperf.csv")
    # Imported here: every command registers this module, and the calibration package is
    # a third of a second of imports that only this path uses.
    from ..calibration import PREDICTION_KEYS, predict_rows
    from ..calibration.intervals import INTERVAL_KEYS
    from ..calibration.predict import POWER_INTERVAL_KEYS
    rows = load_benchmarks(path)
    predictions = predict_rows(rows, interval=interval)
    keys = PREDICTION_KEYS + (() if interval is None else tuple(
        f"{k}_{side}" for k in INTERVAL_KEYS + POWER_INTERVAL_KEYS for side in ("lo", "hi")))
    out = []
    for raw, pred in zip(table.rows, predictions, strict=True):
        entry = dict(raw)
        for key in keys:
            value = pred.get(key)
            entry[key] = "" if value is None else f"{value:.6g}"
        for key in DESCRIPTION_KEYS:
            entry[key] = pred.get(key, "")
        entry["pred_fit"] = _fit()
        out.append(entry)
    return columns + list(keys) + list(DESCRIPTION_KEYS) + ["pred_fit"], out


#: What each prediction row says about itself beside the numbers: the presets its names
#: resolved to, the fitted family used, and why it has no numbers.
DESCRIPTION_KEYS = ("pred_model", "pred_chip", "pred_basis", "pred_error")


@functools.cache
def _fit() -> str:
    """The fitted parameters the predictions come from (`pred_fit`; read once a process:
    the same for every row)."""
    v = versions()
    return f"{v['fitted_latency']}; {v['fitted_power']}; perfmodel {v['perfmodel_version']}"


def predict_design(path: str) -> dict:
    """{"inputs", "metrics"} of the design in an optimize JSON output (`spec`): the same
    specs through `predict(..., hard=True)`, so the metrics equal the reported ones.

    Raises:
        DataError (a ValueError): not readable, not JSON, or no `spec` in it.
    """
    import json

    from ..presets import find_model
    from ..serialize import from_json
    from ..serving import predict

    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"--design {path}: cannot read it as JSON ({error})") from None
    spec = data.get("spec") if isinstance(data, dict) else None
    if not isinstance(spec, dict) or not {"model", "chip", "workload", "design"} <= set(spec):
        raise DataError(f"--design {path}: no 'spec' with model, chip, workload and design; "
                        "give the output of `perfmodel optimize --format json` for a "
                        "feasible design")
    try:
        model = find_model(spec["model"])
        chip, workload, design = (from_json(spec[k]) for k in ("chip", "workload", "design"))
    except (TypeError, ValueError) as error:
        raise DataError(f"--design {path}: {error}") from None
    hard = bool(spec.get("evaluation", {}).get("hard", True))
    metrics = predict(model, chip, workload, design, hard=hard, check=True, unfit="value")
    inputs = provenance(command="predict", design_file=path, model=model.name,
                        chip=chip.name, layout=getattr(design.layout, "describe",
                                                       lambda: "layout numbers")())
    return {"inputs": inputs, "metrics": {k: float(v) for k, v in metrics.to_row().items()}}


def run(args) -> int:
    if args.out != "-":
        check_output(args.out, "--out")
    if (args.design is None) == (args.input is None):
        raise ValueError("predict: give either IN.csv or --design DESIGN.json")
    if args.design is not None:
        import json

        text = json.dumps(predict_design(args.design), indent=1) + "\n"
        if args.out == "-":
            sys.stdout.write(text)
        else:
            with open(args.out, "w") as handle:
                handle.write(text)
        return 0
    columns, rows = predict_file(args.input, args.interval)
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
        key = next((k for k in ("pred_tput_per_chip_total", "pred_result_per_accelerator")
                    if k in columns), columns[-1])
        failed = sum(1 for r in rows if r.get(key) in ("", None))
        print(f"predicted {len(rows) - failed} of {len(rows)} rows -> {args.out}",
              file=sys.stderr)
    return 0
