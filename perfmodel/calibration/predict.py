"""Predictions of benchmark rows with given (by default the shipped) fitted parameters.

Power comes from the power fit (`perfmodel.fitted.apply`, as every command builds a chip), so
`pred_power_w_modelled` is the package's power model. The latency fit itself runs on the
prior energies (the power fit is fitted after it, on its parameters); the power cap makes
latency depend slightly on the energies: on the InferenceMAX table the fitted power moves
throughput by a median 2e-7 and at most 4 % (rows near TDP), median APE by under 0.1 point.

Eager evaluation, one batch of rows at a time (`data.batches(..., disaggregated_numbers=True)`:
the rows of one model, chip and precision, their layouts, disaggregated pools too, as
per-row numbers), padded to `BATCH` rows. Eagerly the time is the number of operations and
of distinct ones (each compiles once a process, about 35 ms on 2 cores), not their size: so
few, wide evaluations on one shape, conditions on the layouts decided in Python where every
row agrees (`static.add_if`), and row inputs sliced in NumPy (a device-side slice compiles
per shape). The shipped InferenceMAX table is 14 evaluations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import fitted
from ..datasets import BenchRow
from . import data
from .intervals import INTERVAL_FILE, INTERVAL_KEYS, Intervals, bounds
from .latency import row_metrics
from .params import FAMILY_FIELDS, Params, from_json, prior_row, resolve_family

#: The prediction columns: `Metrics.to_row("pred_")` keys (SI units in the suffixes).
PREDICTION_KEYS = tuple("pred_" + key for key in (
    "tput_per_chip_total", "output_tput_per_chip", "ttft_s", "tpot_s", "e2e_s",
    "interactivity", "p99_ttft_s", "p99_tpot_s", "power_w_modelled", "j_per_output_token"))
#: The prediction columns whose intervals come from the power fit (`add_power_bounds`).
POWER_INTERVAL_KEYS = ("pred_power_w_modelled", "pred_j_per_output_token")
#: Rows every eager evaluation is padded to (one shape: each eager operation compiles once;
#: the largest batch of the shipped table, 340 rows, is one evaluation).
BATCH = 512


def predict_rows(rows: Sequence[BenchRow], params: Params | None = None,
                 fallback: dict | None = None,
                 measured: Sequence[str] | None = None,
                 power: Mapping | None = None, interval: float | None = None,
                 intervals: Intervals | None = None) -> list[dict]:
    """Predictions for benchmark rows, in row order.

    Args:
        rows: interpreted rows (`datasets.load_benchmarks`).
        params: fitted parameters; None loads the shipped `fitted_params.json`.
        fallback: family -> family map for families absent from `params`
            (default `params.FAMILY_FALLBACK`).
        measured: chips with end-to-end measurements in the fit (for `pred_basis`); the
            shipped file's list when `params` is None.
        power: a power-fit dict giving the chips' energy and idle terms (default: the
            shipped `fitted_power.json`; {} keeps the priors, which the latency fit uses).
        interval: a central prediction-interval level (0.9: 90 %) to add
            `pred_<metric>_lo` and `pred_<metric>_hi` for every `intervals.INTERVAL_KEYS`
            column (`intervals`; about 5x the evaluation time: a Jacobian per row); None
            for none.
        intervals: the fit's covariance and model-error terms; None loads the shipped
            `fitted_intervals.json` (with `params` None) or, for given `params`, takes the
            prior widths and no model error (`Intervals.at_priors`).

    Raises:
        ValueError: `interval` outside (0, 1), or no shipped intervals file for it, or one
            of another fit.

    Returns:
        One dict per row: the `PREDICTION_KEYS` (SI units: tokens/s, s, W, J; floats, or
        None with `pred_error` set), `pred_basis` (which family's fitted parameters were
        used, and whether the chip itself was measured), `pred_error` (why a row has no
        prediction, or a warning when the layout does not fit in HBM) and with `interval`
        the bounds (same units; None where the prediction is).

    Example:
        >>> import perfmodel.datasets as ds
        >>> row = ds.BenchRow(0, 2, "gpt-oss-120b", "b200", "vllm", "fp4", 1024., 1024.,
        ...                   8., False, ds.PoolLayout(1, 1, False), None, None, {})
        >>> out = predict_rows([row], Params.prior(("blackwell",), ("vllm",)))[0]
        >>> out["pred_basis"], out["pred_tput_per_chip_total"] > 0
        ('fitted:blackwell', True)
    """
    if interval is not None and not 0.0 < interval < 1.0:
        raise ValueError(f"interval {interval} must be a level in (0, 1), e.g. 0.9")
    shipped_params = params is None
    if params is None:
        shipped = fitted.read(fitted.LATENCY_FILE)
        params = from_json(shipped)
        measured = shipped.get("measured_chips", measured)
    if interval is not None and intervals is None and shipped_params:
        stored = fitted.read(INTERVAL_FILE)
        if not stored:
            raise ValueError(f"predict_rows(interval=...): perfmodel/data/{INTERVAL_FILE} is "
                             "not shipped; write it with `python calibration/fit.py` (or "
                             "calibration/intervals.py for the shipped fit)")
        if stored.get("fit_loss") != shipped.get("loss"):
            raise ValueError(f"perfmodel/data/{INTERVAL_FILE} belongs to another fit (loss "
                             f"{stored.get('fit_loss')} against fitted_params.json's "
                             f"{shipped.get('loss')}); rewrite it with "
                             "`python calibration/intervals.py`")
        intervals = Intervals.from_json(stored)
    elif interval is not None and intervals is None:
        intervals = Intervals.at_priors(params)
    entries = _evaluate(rows, params, fallback, measured, power, interval is not None)
    if interval is None:
        return entries
    power_fit = fitted.read(fitted.POWER_FILE) if power is None else power
    return [add_power_bounds(add_bounds(e, params, fallback, intervals, interval), e,
                             power_fit, interval) for e in entries]


def add_power_bounds(out: dict, entry: dict, power: Mapping, level: float) -> dict:
    """`out` with the bounds of a central `level` interval of power and J per output token
    (`POWER_INTERVAL_KEYS` + "_lo" / "_hi", from the power fit's out-of-model residuals,
    `perfmodel.calibration_power.intervals`: an engine other than the measured harnesses
    takes the pooled scale, a family the power fit did not measure the leave-one-chip-out
    one); None where there is no prediction or the power fit has no intervals."""
    from ..calibration_power import intervals as power_intervals

    out = dict(out, **{f"{k}_{side}": None for k in POWER_INTERVAL_KEYS
                       for side in ("lo", "hi")})
    table = power.get("intervals")
    if table is not None:
        group = power_intervals.group_key("other", entry.get("family", ""),
                                          tuple(power.get("families", {})))
        # A chip's average power stays under its TDP.
        out.update(power_intervals.row_bounds(
            table, {k: entry.get(k) for k in POWER_INTERVAL_KEYS}, group, level,
            entry.get("tdp", math.inf)))
    return out


def linearize(rows: Sequence[BenchRow], params: Params, fallback: dict | None = None,
              power: Mapping | None = None) -> list[dict]:
    """`predict_rows` entries with, per row, "log" (log of each `intervals.INTERVAL_KEYS`
    prediction), "jacobian" (derivative of each in the row's family and framework
    parameters, unconstrained space), "family" (the chip family of the row), "framework"
    ("" both when the row has no prediction) and "tdp" (the chip's, W)."""
    return _evaluate(rows, params, fallback, None, power, True)


def add_bounds(entry: dict, params: Params, fallback, intervals: Intervals,
               level: float) -> dict:
    """A `linearize` entry as a `predict_rows` one with the bounds of a central `level`
    interval (`pred_<metric>_lo`, `pred_<metric>_hi`; None where there is no prediction or
    no model-error term)."""
    out = dict(entry)
    lin = {k: out.pop(k) for k in ("log", "jacobian", "family", "framework", "tdp")}
    for key in INTERVAL_KEYS:
        out[key + "_lo"] = out[key + "_hi"] = None
    if entry["pred_tput_per_chip_total"] is None:
        return out
    cov, _ = intervals.row_covariance(params, lin["family"], lin["framework"], fallback)
    for key in INTERVAL_KEYS:
        if key not in intervals.keys:
            continue
        z_lo, z_hi = intervals.z(key, level)
        scale = intervals.scale_for(key, lin["framework"], params)
        lo, hi, _ = bounds(jnp.asarray([lin["log"][key]]),
                           jnp.asarray(lin["jacobian"][key])[None], jnp.asarray(cov)[None],
                           jnp.asarray(scale), jnp.asarray(z_lo), jnp.asarray(z_hi))
        lo, hi = float(lo[0]), float(hi[0])
        if math.isfinite(lo) and math.isfinite(hi):
            out[key + "_lo"], out[key + "_hi"] = lo, hi
    return out


def _evaluate(rows, params, fallback, measured, power, jacobian: bool) -> list[dict]:
    groups, errors = data.build_groups(rows)
    out: list[dict | None] = [None] * len(rows)
    position = {row.index: k for k, row in enumerate(rows)}
    empty = {"log": {}, "jacobian": {}, "family": "", "framework": "",
             "tdp": math.inf} if jacobian else {}
    for index, message in errors.items():
        out[position[index]] = {key: None for key in PREDICTION_KEYS} | {
            "pred_basis": "", "pred_error": message} | empty
    # One batch per model, chip and precision (layouts as per-row numbers, disaggregated
    # ones too): eager time is the number of operations, so fewer, larger evaluations.
    for b in data.batches(groups, disaggregated_numbers=True):
        family, basis = resolve_family(b.family, params, fallback)
        if family == b.family and measured is not None and b.chip.name not in measured:
            basis = f"specs+fitted:{family} ({b.chip.name} not measured)"
        raw = np.asarray(params.family_raw[params.families.index(family)] if family else
                         prior_row(FAMILY_FIELDS))
        # Latency terms come from `raw`; only the power fit's terms are applied here.
        chip = fitted.apply(b.chip, latency={}, power=power)
        members = [rows[position[i]] for i in b.indices]
        for start in range(0, b.size, BATCH):
            for row, entry in _chunk(b, basis, raw, chip, members, start, params, jacobian):
                out[position[row.index]] = entry
    return out


def _chunk(b: data.Batch, basis: str, raw: np.ndarray, chip, members: list, start: int,
           params: Params, jacobian: bool) -> list[tuple]:
    """(row, entry) of the rows `start:start + BATCH` of batch `b` (padded to `BATCH`)."""
    # Padded with copies of the last row; sliced in NumPy and placed with `device_put`: a
    # slice on the device, or `jnp.asarray` of a NumPy array, compiles once per shape.
    take = np.minimum(np.arange(start, start + BATCH), b.size - 1)
    chunk = [members[i] for i in take]
    x = jax.device_put(data.row_inputs(chunk))
    layouts = jax.tree_util.tree_map(lambda a: np.asarray(a)[take], b.layouts)
    fw = jax.device_put(data.framework_rows(chunk, params))
    design = eqx.tree_at(lambda d: d.layout, b.design, layouts)
    nf = len(FAMILY_FIELDS)

    def metrics(delta):
        # delta: one tangent for the family row and one for every row's framework row;
        # each row depends on its own framework row only, so the Jacobian in delta is
        # every row's Jacobian in its own family and framework parameters. The per-row
        # layouts broadcast with the per-row inputs (no vmap: eagerly, a batched operation
        # costs several plain ones).
        m = row_metrics(b.model, chip, design, raw + delta[:nf], fw + delta[None, nf:], **x)
        row_values = m.to_row("pred_")
        logs = {k: jnp.log(jnp.broadcast_to(row_values[k], (BATCH,))) for k in INTERVAL_KEYS}
        return logs, (row_values, m.memory_excess)

    if jacobian:
        delta = jax.device_put(np.zeros(nf + fw.shape[1]))
        jac, (row_values, excess) = jax.jacfwd(metrics, has_aux=True)(delta)
        logs = {k: np.log(np.broadcast_to(np.asarray(row_values[k]), (BATCH,)))
                for k in INTERVAL_KEYS}
    else:
        _, (row_values, excess) = metrics(np.zeros(nf + fw.shape[1]))
    values = {k: np.broadcast_to(np.asarray(row_values[k]), (BATCH,)) for k in PREDICTION_KEYS}
    excess = np.broadcast_to(np.asarray(excess), (BATCH,))
    out = []
    for j, row in enumerate(members[start:start + BATCH]):
        entry = {k: float(v[j]) for k, v in values.items()}
        bad = [k for k, v in entry.items() if not math.isfinite(v)]
        entry["pred_basis"] = basis
        entry["pred_error"] = ""
        if bad:
            entry = {k: None for k in PREDICTION_KEYS} | {
                "pred_basis": basis, "pred_error": f"non-finite prediction ({', '.join(bad)})"}
        elif excess[j] > 0:
            # Metrics of a deployment that cannot hold one request are no prediction.
            entry = {k: None for k in PREDICTION_KEYS} | {
                "pred_basis": basis,
                "pred_error": f"does not fit: weights + reserve + one sequence need "
                              f"{1.0 + excess[j]:.2f}x the usable HBM per chip "
                              "(memory_fraction x capacity)"}
        entry.update(pred_model=b.model.name, pred_chip=b.chip.name)
        if jacobian:
            entry.update(log={k: float(v[j]) for k, v in logs.items()},
                         jacobian={k: np.asarray(v[j]) for k, v in jac.items()},
                         family=b.family, framework=row.framework, tdp=float(chip.tdp))
        out.append((row, entry))
    return out
