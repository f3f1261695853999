"""Prediction intervals of the power fit: out-of-model residuals, scaled per measured group.

The latency fit's intervals (`perfmodel.calibration.intervals`) add a parameter covariance
to a model-error term and find the first a median 0.009 in log throughput against 0.10 for
the second. The power fit's error on a model it never saw is larger still (12.7 % power,
17 % J per token, whole models held out), so its intervals are the model-error term
alone, sized where that error is measured: on residuals of rows whose model the fit did not
see.

- **Residuals**: e = log(measured / predicted) of every usable measurement row, predicted by
  the fit of `calibration/power/fit.py`'s whole-model fold that held its model out (each row
  once). A refit's parameters move with its data, so e carries both the parameters' spread
  and what no parameter value fixes, for a model the fit has not seen.
- **Group scale**: the rows fall into groups that miss by different amounts: harness x chip
  family (`group_key`: ML.ENERGY v3 "vllm", v2 "vllm-2024" or any other harness, on a
  family the power fit measured). s_g is the robust standard deviation (1.4826 x median
  |e|) of a group's residuals, shrunk toward the metric's pooled scale by `SHRINKAGE`
  rows' worth. A chip of a family the power fit never measured ("unmeasured": it takes the
  generic set) takes the scale of the leave-one-chip-out residuals (A100, H100 and B200
  each predicted by a fit without them, through the generic set), its nearest measured
  analogue.
- **Quantiles**: z = e / s_g, pooled over groups; a central interval at level L is
  prediction x exp([q_z((1 - L) / 2), q_z((1 + L) / 2)] x s_g), with q_z the empirical
  quantiles of z (stored at `PROBABILITIES`). z is skewed (the large misses of power
  are over-predictions), which a Gaussian would hide.

`coverage` measures the rule the way it would be used, by nested cross-validation: for each
whole-model fold, the scales and quantiles are estimated from the other folds' residuals
only, and the fold's rows are counted inside or outside; for each left-out chip, the
"unmeasured" scale from the other chips' leave-one-out residuals. Nothing else is tuned
to the counted rows.

Example:
    >>> table = estimate({"power": [0.1, -0.2, 0.05, 0.3, -0.1, 0.0]},
    ...                  ["vllm/hopper"] * 6, {"power": [0.2, -0.3]})
    >>> lo, hi = bounds(table, "power", 100.0, "vllm/hopper", 0.9)
    >>> lo < 100.0 < hi
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

#: Rows' worth of the metric's pooled scale in each group's scale.
SHRINKAGE = 10.0
#: Probabilities at which the normalized residuals' quantiles are stored.
PROBABILITIES = np.round(np.linspace(0.0, 1.0, 201), 6)
#: The group of a chip whose family the power fit did not measure.
UNMEASURED = "unmeasured"
#: Interval metric -> the `predict_power_rows` / `predict_rows` column it bounds.
COLUMNS = {"power": "pred_power_w_modelled", "j_per_token": "pred_j_per_output_token",
           "output_tok_s": "pred_output_tput_per_chip"}
VERSION = 1


def group_key(harness: str, family: str, measured_families) -> str:
    """The residual group of a row: "harness/family" on a family the power fit measured,
    else `UNMEASURED`.

    Args:
        harness: the serving harness ("vllm": ML.ENERGY v3, "vllm-2024": v2; any other
            name, an InferenceX or a user's engine, is "other").
        family: the chip family (`Chip.family`).
        measured_families: the families of the power fit (`fitted_power.json` "families").

    Example:
        >>> group_key("vllm", "hopper", ["hopper"]), group_key("trt", "cdna3", ["hopper"])
        ('vllm/hopper', 'unmeasured')
    """
    if family not in measured_families:
        return UNMEASURED
    harness = harness if harness in ("vllm", "vllm-2024") else "other"
    return f"{harness}/{family}"


def robust_scale(e) -> float:
    """1.4826 x the median absolute value: a standard deviation that outliers do not
    inflate (NaN for no values)."""
    e = np.asarray(e, dtype=float)
    e = e[np.isfinite(e)]
    return float(1.4826 * np.median(np.abs(e))) if e.size else math.nan


def estimate(residuals: Mapping[str, Sequence[float]], groups: Sequence[str],
             unmeasured: Mapping[str, Sequence[float]]) -> dict:
    """The interval table of out-of-model residuals.

    Args:
        residuals: per metric ("power", "j_per_token", "output_tok_s"), the log residuals
            log(measured / predicted) of the rows, each predicted by a fit without its
            model (NaN where not measured).
        groups: each row's `group_key`.
        unmeasured: per metric, log residuals of rows predicted through the generic set by
            a fit without their chip (leave-one-chip-out).

    Returns:
        {"version", "shrinkage", "probabilities", "metrics": {metric: {"pooled_scale",
        "scales": {group: s, including `UNMEASURED`}, "z_quantiles", "rows"}}}.
    """
    groups = np.asarray(groups)
    out = {"version": VERSION, "shrinkage": SHRINKAGE,
           "probabilities": PROBABILITIES.tolist(), "metrics": {}}
    for metric, values in residuals.items():
        e = np.asarray(values, dtype=float)
        ok = np.isfinite(e)
        pooled = robust_scale(e[ok])
        loco = robust_scale(unmeasured.get(metric, ()))
        scales = {UNMEASURED: loco if math.isfinite(loco) else pooled}
        for g in sorted(set(groups[ok].tolist()) - {UNMEASURED}):
            x = e[ok & (groups == g)]
            scales[g] = float(math.sqrt((x.size * robust_scale(x) ** 2
                                         + SHRINKAGE * pooled ** 2) / (x.size + SHRINKAGE)))
        z = e[ok] / np.asarray([scales[g] for g in groups[ok]])
        out["metrics"][metric] = {
            "pooled_scale": pooled, "scales": scales,
            "z_quantiles": np.quantile(z, PROBABILITIES).tolist(), "rows": int(ok.sum())}
    return out


def scale(table: Mapping, metric: str, group: str) -> float:
    """A group's scale of `metric` (the pooled scale for a measured group the table has no
    rows of, the leave-one-chip-out scale for `UNMEASURED`)."""
    entry = table["metrics"][metric]
    return float(entry["scales"].get(group, entry["pooled_scale"]))


def z_bounds(table: Mapping, metric: str, level: float) -> tuple[float, float]:
    """(z_lo, z_hi): the normalized residuals' quantiles of a central interval at `level`.

    Raises:
        ValueError: `level` outside (0, 1).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"interval {level} must be a level in (0, 1), e.g. 0.9")
    probabilities = np.asarray(table["probabilities"], dtype=float)
    q = np.asarray(table["metrics"][metric]["z_quantiles"], dtype=float)
    return (float(np.interp((1.0 - level) / 2.0, probabilities, q)),
            float(np.interp((1.0 + level) / 2.0, probabilities, q)))


def bounds(table: Mapping, metric: str, value: float, group: str, level: float,
           ceiling: float = math.inf) -> tuple[float, float]:
    """(lo, hi) of a prediction `value` of `metric` for a row of `group` at `level`
    (value x exp(z x s)), both at most `ceiling` (a chip's power limit bounds its average
    power, in W); (NaN, NaN) for a value that is not a positive number."""
    if value is None or not math.isfinite(value) or value <= 0.0:
        return math.nan, math.nan
    z_lo, z_hi = z_bounds(table, metric, level)
    s = scale(table, metric, group)
    return (min(value * math.exp(z_lo * s), ceiling),
            min(value * math.exp(z_hi * s), ceiling))


def row_bounds(table: Mapping, values: Mapping, group: str, level: float,
               tdp: float = math.inf) -> dict:
    """`<column>_lo` and `<column>_hi` of every `COLUMNS` column in `values` (a prediction
    row) at `level` for a row of `group`, power's upper bound at most `tdp` (W); None where a
    bound is not a finite number (no prediction)."""
    out = {}
    for metric, column in COLUMNS.items():
        if column not in values:
            continue
        lo, hi = bounds(table, metric, values[column], group, level,
                        tdp if metric == "power" else math.inf)
        out[f"{column}_lo"] = lo if math.isfinite(lo) else None
        out[f"{column}_hi"] = hi if math.isfinite(hi) else None
    return out


def coverage(residuals: Mapping[str, Sequence[float]], groups: Sequence[str],
             folds: Sequence[int], unmeasured: Mapping[str, Sequence[float]],
             unmeasured_chips: Sequence[str], level: float = 0.9) -> dict:
    """Share of rows inside their interval at `level`, by nested cross-validation.

    Whole-model folds: each fold's rows against the table `estimate` makes from the other
    folds' residuals (and all leave-one-chip-out residuals). Left-out chips: each chip's
    leave-one-chip-out residuals against the "unmeasured" scale of the other chips' and the
    quantiles of all whole-model residuals.

    Args:
        residuals, groups: as `estimate`.
        folds: each row's whole-model fold.
        unmeasured: as `estimate`.
        unmeasured_chips: the left-out chip of each of `unmeasured`'s residuals.

    Returns:
        {metric: {"inside", "n", "median_width" (hi / lo), "groups": {group: {"inside",
        "n"}}, "folds": [inside per fold], "unmeasured": {chip: {"inside", "n"}}}}.
    """
    groups, folds = np.asarray(groups), np.asarray(folds)
    chips = np.asarray(unmeasured_chips)
    out = {}
    for metric, values in residuals.items():
        e = np.asarray(values, dtype=float)
        inside = np.full(e.shape, np.nan)
        width = np.full(e.shape, np.nan)
        for k in sorted(set(folds.tolist())):
            rest = folds != k
            table = estimate({metric: np.where(rest, e, np.nan)}, groups, unmeasured)
            z_lo, z_hi = z_bounds(table, metric, level)
            for i in np.flatnonzero((folds == k) & np.isfinite(e)):
                s = scale(table, metric, str(groups[i]))
                inside[i] = z_lo * s <= e[i] <= z_hi * s
                width[i] = math.exp((z_hi - z_lo) * s)
        ok = np.isfinite(inside)
        entry = {"inside": float(np.mean(inside[ok])), "n": int(ok.sum()),
                 "median_width": float(np.median(width[ok])), "groups": {}, "folds": [],
                 "unmeasured": {}}
        for g in sorted(set(groups[ok].tolist())):
            sel = ok & (groups == g)
            entry["groups"][g] = {"inside": float(np.mean(inside[sel])), "n": int(sel.sum())}
        entry["folds"] = [float(np.mean(inside[ok & (folds == k)]))
                          for k in sorted(set(folds.tolist()))]
        u = np.asarray(unmeasured.get(metric, ()), dtype=float)
        for chip in sorted(set(chips.tolist())):
            others = {metric: u[chips != chip]}
            table = estimate({metric: e}, groups, others)
            z_lo, z_hi = z_bounds(table, metric, level)
            s = scale(table, metric, UNMEASURED)
            x = u[(chips == chip) & np.isfinite(u)]
            entry["unmeasured"][chip] = {
                "inside": float(np.mean((z_lo * s <= x) & (x <= z_hi * s))) if x.size
                else math.nan, "n": int(x.size)}
        out[metric] = entry
    return out
