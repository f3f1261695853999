"""Latency calibration: per-chip-family efficiencies and per-framework runtime terms fitted
to published measurements (GEMM and NCCL timings, InferenceMAX end-to-end rows).

- `params`: what is fitted (`Params`, in unconstrained space) and its JSON file format;
- `data`: benchmark rows to groups and batches of one static structure;
- `latency`: the model functions and the residual blocks (`EndToEnd`, `OpTimings`, `Prior`);
- `solve`: the `optimistix` Levenberg-Marquardt fit (`fit`, `Calibration`, `LatencyFit`);
- `predict`: predictions of benchmark rows (`predict_rows`, with prediction intervals);
- `intervals`: the fit's parameter covariance and model-error terms (`Intervals`,
  `estimate`) and their propagation to predictions (`bounds`).
"""

from .data import Batch, Group, batches, build_groups, framework_rows, model_of, row_inputs
from .intervals import INTERVAL_KEYS, Intervals
from .latency import (
    E2E_KEYS,
    METRIC_WEIGHTS,
    OP_WEIGHT,
    OUTPUTS,
    AbstractBlock,
    EndToEnd,
    OpTimings,
    Prior,
    format_ratio,
    gemm_time,
    huber_loss,
    huber_residuals,
    outputs,
    row_metrics,
    rowwise_jacobian,
)
from .params import (
    FAMILY_FALLBACK,
    FAMILY_FIELDS,
    FAMILY_NAMES,
    FRAMEWORK_FALLBACK,
    FRAMEWORK_FIELDS,
    FRAMEWORK_NAMES,
    FRAMEWORK_SETTINGS,
    POOLED,
    Params,
    family_values,
    framework_values,
    from_json,
    prior_row,
    prior_widths,
    resolve_family,
    resolve_framework,
    runtime_values,
    to_json,
    with_family,
)
from .predict import BATCH, PREDICTION_KEYS, linearize, predict_rows
from .solve import DELTA, Calibration, LatencyFit, calibrate, devices_placement, fit, hop

__all__ = [
    "BATCH", "DELTA", "E2E_KEYS", "INTERVAL_KEYS", "Intervals", "FAMILY_FALLBACK",
    "FAMILY_FIELDS", "FAMILY_NAMES", "FRAMEWORK_FALLBACK", "FRAMEWORK_FIELDS",
    "FRAMEWORK_NAMES", "FRAMEWORK_SETTINGS", "METRIC_WEIGHTS", "OP_WEIGHT", "OUTPUTS",
    "POOLED", "PREDICTION_KEYS", "AbstractBlock", "Batch", "Calibration", "EndToEnd", "Group",
    "LatencyFit", "OpTimings", "Params", "Prior", "batches", "build_groups", "calibrate",
    "devices_placement", "family_values", "fit", "framework_rows", "framework_values",
    "format_ratio", "from_json", "gemm_time", "hop", "huber_loss", "huber_residuals", "linearize",
    "model_of",
    "outputs", "predict_rows", "prior_row", "prior_widths", "resolve_family", "resolve_framework",
    "row_inputs", "row_metrics", "rowwise_jacobian", "runtime_values", "to_json",
    "with_family",
]
