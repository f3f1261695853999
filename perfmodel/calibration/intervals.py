"""Prediction intervals of the latency fit: parameter covariance from the fit's Jacobian,
propagated to each prediction by forward-mode autodiff, plus a per-metric model-error term.

A prediction's log value y(theta) is uncertain for two reasons:

- the fitted parameters theta: their covariance is the Gauss-Newton (Laplace) one at the
  optimum, C = (sum_r psi_r J_r^T J_r / sigma_r^2 + P^T P)^-1, where J_r is the Jacobian of
  residual r (a log time or throughput) in the unconstrained parameters, sigma_r the residual
  scale of its data set (throughput, TPOT, TTFT, GEMM, NCCL, each its own), psi_r the Huber
  weight the fit gave it (min(1, delta / |weighted residual|)) and P the priors'
  (`latency.Prior`, partial pooling included). The priors keep C finite in the directions
  the data do not identify, where it is the prior width; the variance of the prediction is
  g^T C g with g = dy/dtheta (`jax.jacfwd`, in log space for the log-parametrized fields);
- the model itself, which no parameter value fixes: a scale s_k of the log residuals
  log(measured / predicted) on the fit rows (1.4826 x their median absolute value, a robust
  standard deviation), per metric and per fitted framework (the disaggregated engines miss
  by 2-5x more than vLLM), each framework's shrunk toward the metric's by `SHRINKAGE` rows.

The interval of a row is y + [z_lo, z_hi] x sqrt(s_k^2 + g^T C g), where z_lo, z_hi are
quantiles of the normalized residuals (log(measured / predicted) / sqrt(s_k^2 + g^T C g)) of
the fit rows: a 90 % interval takes their 5th and 95th percentiles. For the fitted metrics
(throughput, TPOT, TTFT) the residuals are leave-one-out ones, e / (1 - h) with the
Gauss-Newton leverage h = psi g^T C g / sigma^2, so rows the fit pulled toward themselves do
not narrow the interval. Nothing is read from held-out rows (`calibration/intervals.py`
reports the share of them inside).

A row predicted with another family's parameters (`params.FAMILY_FALLBACK`) adds the
between-family spread of the partially pooled prior (pooling x prior width) to its family's
variance; a framework without fitted terms adds its prior width (`FRAMEWORK_FIELDS`); a
family at its priors takes the prior widths.

The fit writes the covariance and the quantiles to `perfmodel/data/fitted_intervals.json`
(`estimate`, `to_json`; `calibration/fit.py`); `predict.predict_rows(..., interval=0.9)`
reads them.
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Mapping, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..datasets import BenchRow
from .latency import METRIC_WEIGHTS, OP_WEIGHT, OpTimings, Prior, _chip_times
from .params import (
    FAMILY_FIELDS,
    FRAMEWORK_FIELDS,
    POOLED,
    Params,
    resolve_family,
    resolve_framework,
)
from .solve import DELTA

#: File the fit writes beside `fitted_params.json` (`perfmodel/data/`).
INTERVAL_FILE = "fitted_intervals.json"
VERSION = 1
#: Prediction column -> the InferenceMAX column its model-error term is estimated on.
MEASURED = {"pred_tput_per_chip_total": "tput_per_gpu",
            "pred_output_tput_per_chip": "output_tput_per_gpu",
            "pred_ttft_s": "median_ttft_s", "pred_tpot_s": "median_tpot_s",
            "pred_e2e_s": "median_e2el_s", "pred_interactivity": "median_intvty_tok_s_user",
            "pred_p99_ttft_s": "p99_ttft_s", "pred_p99_tpot_s": "p99_tpot_s"}
#: The prediction columns that have intervals of the latency fit (power and energy have
#: the power fit's, `perfmodel.calibration_power.intervals`).
INTERVAL_KEYS = tuple(MEASURED)
#: Prediction columns whose measured column the latency fit fits (`latency.E2E_KEYS`).
FITTED = {"pred_tput_per_chip_total": "tput_per_gpu", "pred_tpot_s": "median_tpot_s",
          "pred_ttft_s": "median_ttft_s"}
#: Rows' worth of the metric's own scale in each framework's (`estimate`).
SHRINKAGE = 10.0
#: Probabilities at which the normalized residuals' quantiles are stored.
PROBABILITIES = np.round(np.linspace(0.0, 1.0, 201), 6)

_NF, _NW = len(FAMILY_FIELDS), len(FRAMEWORK_FIELDS)
_FAMILY_WIDTH = np.array([f[3] for f in FAMILY_FIELDS])
_FRAMEWORK_WIDTH = np.array([f[3] for f in FRAMEWORK_FIELDS])


def parameter_names(params: Params) -> tuple[str, ...]:
    """"family:field" and "framework:field" names in the order of `params.flat`.

    Example:
        >>> parameter_names(Params.prior(("hopper",), ("vllm",)))[::12]
        ('hopper:compute_max', 'vllm:step_overhead')
    """
    return (tuple(f"{fam}:{f[0]}" for fam in params.families for f in FAMILY_FIELDS)
            + tuple(f"{fw}:{f[0]}" for fw in params.frameworks for f in FRAMEWORK_FIELDS))


def posterior_covariance(jacobian, weights, prior_matrix) -> np.ndarray:
    """Gauss-Newton covariance (J^T diag(weights) J + P^T P)^-1 of fitted parameters.

    Args:
        jacobian: (residuals, parameters) Jacobian of the residuals at the optimum.
        weights: (residuals,) precision of each residual (psi / sigma^2).
        prior_matrix: (priors, parameters) `latency.Prior.matrix` (residuals P (theta - c)).

    Returns:
        (parameters, parameters) covariance; directions neither the data nor the priors
        constrain (eigenvalues of the precision under 1e-12 of its largest) are dropped,
        a pseudo-inverse.

    Example:
        >>> J = np.array([[1.0, 0.0], [1.0, 0.0]])
        >>> np.round(posterior_covariance(J, np.ones(2), np.eye(2)), 3).tolist()
        [[0.333, 0.0], [0.0, 1.0]]
    """
    jacobian = np.asarray(jacobian, dtype=float)
    precision = (jacobian.T * np.asarray(weights, dtype=float)[None, :]) @ jacobian
    precision = precision + np.asarray(prior_matrix).T @ np.asarray(prior_matrix)
    values, vectors = np.linalg.eigh(0.5 * (precision + precision.T))
    keep = values > 1e-12 * max(values.max(), 1e-300)
    inverse = np.where(keep, 1.0 / np.where(keep, values, 1.0), 0.0)
    return (vectors * inverse[None, :]) @ vectors.T


def propagate(f, theta, covariance):
    """(f(theta), the variance of each output under parameter covariance): the first-order
    (delta-method) propagation, the Jacobian by forward mode (`jax.jacfwd`).

    Args:
        f: theta (p,) -> (n,) outputs.
        theta: (p,) parameters.
        covariance: (p, p) their covariance.

    Example:
        >>> value, var = propagate(lambda t: 2.0 * t, jnp.ones(1), jnp.eye(1))
        >>> float(value[0]), float(var[0])
        (2.0, 4.0)
    """
    jac, value = jax.jacfwd(lambda t: (f(t),) * 2, has_aux=True)(theta)
    return value, jnp.einsum("ni,ij,nj->n", jac, covariance, jac)


@eqx.filter_jit
def bounds(log_value, gradient, covariance, scale, z_lo, z_hi):
    """Interval of predictions: exp(y + [z_lo, z_hi] sqrt(scale^2 + g^T C g)), never
    excluding the prediction itself.

    Args:
        log_value: (n,) log predictions y.
        gradient: (n, k) dy/dtheta of each row in its own k parameters.
        covariance: (n, k, k) covariance of each row's parameters.
        scale: model-error standard deviation of log residuals (scalar or (n,)).
        z_lo, z_hi: quantiles of the normalized residuals (z_lo <= 0 <= z_hi after
            clipping).

    Returns:
        (lo, hi, sd): bounds in the prediction's units and the log-space standard deviation.

    Example:
        >>> lo, hi, sd = bounds(jnp.zeros(1), jnp.zeros((1, 1)), jnp.zeros((1, 1, 1)), 0.1,
        ...                     -1.645, 1.645)
        >>> round(float(lo[0]), 4), round(float(hi[0]), 4)
        (0.8483, 1.1788)
    """
    variance = jnp.einsum("ni,nij,nj->n", gradient, covariance, gradient)
    sd = jnp.sqrt(jnp.asarray(scale) ** 2 + jnp.maximum(variance, 0.0))
    lo = jnp.exp(log_value + jnp.minimum(z_lo, 0.0) * sd)
    hi = jnp.exp(log_value + jnp.maximum(z_hi, 0.0) * sd)
    return lo, hi, sd


class Intervals(eqx.Module):
    """The fit's parameter covariance and per-metric model-error terms
    (`perfmodel/data/fitted_intervals.json`). Build with `from_json` or `estimate`.

    Example:
        >>> p = Params.prior(("hopper",), ("vllm",))
        >>> iv = Intervals.at_priors(p)
        >>> cov, extra = iv.row_covariance(p, "hopper", "vllm")
        >>> round(float(cov[0, 0]), 3), float(extra.sum())
        (1.0, 0.0)
    """

    covariance: np.ndarray
    """(parameters, parameters) covariance of the unconstrained parameters (logit or log
    of SI values; dimensionless)."""
    scale: np.ndarray
    """(len(keys),) model-error standard deviation of log residuals per metric."""
    quantiles: np.ndarray
    """(len(keys), len(PROBABILITIES)) quantiles of the normalized residuals."""
    names: tuple[str, ...] = eqx.field(static=True)
    """`parameter_names` of the covariance's rows."""
    keys: tuple[str, ...] = eqx.field(static=True)
    """Prediction columns with a model-error term (`INTERVAL_KEYS`)."""
    pooling: float | None = eqx.field(static=True, default=None)
    """Partial pooling scale of the fit (a fallback family's spread), None without."""
    framework_scale: np.ndarray | None = None
    """(len(keys), len(scale_frameworks)) model-error standard deviation per metric and
    fitted framework (shrunk toward `scale`), None for one scale per metric."""
    scale_frameworks: tuple[str, ...] = eqx.field(static=True, default=())
    """The frameworks of `framework_scale`'s columns."""

    def scale_for(self, key: str, framework: str, params: Params) -> float:
        """Model-error scale of metric `key` for a row of `framework` (along
        `params.FRAMEWORK_FALLBACK`; the metric's own scale for a framework without one)."""
        k = self.keys.index(key)
        name = resolve_framework(framework, params.frameworks)
        if self.framework_scale is not None and name in self.scale_frameworks:
            return float(self.framework_scale[k, self.scale_frameworks.index(name)])
        return float(self.scale[k])

    @staticmethod
    def at_priors(params: Params, scale: float = 0.0) -> Intervals:
        """Prior covariance (diagonal prior widths squared), `scale` for every metric and
        Gaussian quantiles: what an unfitted model knows."""
        widths = np.concatenate([np.tile(_FAMILY_WIDTH, len(params.families)),
                                 np.tile(_FRAMEWORK_WIDTH, len(params.frameworks))])
        z = np.array([_normal_quantile(p) for p in PROBABILITIES])
        return Intervals(covariance=np.diag(widths ** 2),
                         scale=np.full(len(INTERVAL_KEYS), float(scale)),
                         quantiles=np.tile(z, (len(INTERVAL_KEYS), 1)),
                         names=parameter_names(params), keys=INTERVAL_KEYS)

    def z(self, key: str, level: float) -> tuple[float, float]:
        """(z_lo, z_hi) of a central `level` interval of metric `key`."""
        if not 0.0 < level < 1.0:
            raise ValueError(f"interval level {level} must be in (0, 1), e.g. 0.9")
        q = self.quantiles[self.keys.index(key)]
        return (float(np.interp(0.5 - level / 2, PROBABILITIES, q)),
                float(np.interp(0.5 + level / 2, PROBABILITIES, q)))

    def row_covariance(self, params: Params, family: str, framework: str,
                       fallback: Mapping | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(n, n) covariance of the n parameters a row of `family` and `framework` is
        predicted with (`FAMILY_FIELDS` then `FRAMEWORK_FIELDS`; `params`' family fallback
        and framework fallback followed), and the (n,) variance added for what falls back
        (already in the covariance's diagonal)."""
        fam, _ = resolve_family(family, params, fallback)
        fw = resolve_framework(framework, params.frameworks)
        index = [self.names.index(f"{fam}:{f[0]}") if fam and f"{fam}:{f[0]}" in self.names
                 else -1 for f in FAMILY_FIELDS]
        index += [self.names.index(f"{fw}:{f[0]}") if fw and f"{fw}:{f[0]}" in self.names
                  else -1 for f in FRAMEWORK_FIELDS]
        index = np.array(index)
        cov = np.where((index[:, None] >= 0) & (index[None, :] >= 0),
                       self.covariance[np.maximum(index, 0)][:, np.maximum(index, 0)], 0.0)
        prior = np.concatenate([_FAMILY_WIDTH, _FRAMEWORK_WIDTH]) ** 2
        extra = np.zeros(_NF + _NW)
        if fam and fam != family:
            spread = self.pooling if self.pooling is not None else 1.0
            extra[:_NF] = (spread * _FAMILY_WIDTH) ** 2
        if fw and fw != framework:
            extra[_NF:] = prior[_NF:]
        cov = cov + np.diag(np.where(index < 0, prior, extra))
        return cov, np.where(index < 0, prior, extra)

    def to_json(self, meta: Mapping | None = None) -> dict:
        """The `fitted_intervals.json` layout."""
        return {"version": VERSION, **(meta or {}), "pooling": self.pooling,
                "parameters": list(self.names),
                "covariance": np.asarray(self.covariance).tolist(),
                "probabilities": PROBABILITIES.tolist(),
                "metrics": {k: {"measured": MEASURED[k], "fitted": k in FITTED,
                                "scale": float(self.scale[i]),
                                "scale_by_framework": (
                                    {} if self.framework_scale is None else
                                    {f: float(self.framework_scale[i, j]) for j, f in
                                     enumerate(self.scale_frameworks)}),
                                "z_quantiles": np.asarray(self.quantiles[i]).tolist()}
                            for i, k in enumerate(self.keys)}}

    @staticmethod
    def from_json(data: Mapping) -> Intervals:
        """Inverse of `to_json`.

        Raises:
            ValueError: not a version-`VERSION` file, or its arrays disagree in shape.
        """
        if data.get("version") != VERSION:
            raise ValueError(f"{INTERVAL_FILE} has version {data.get('version')!r}; this "
                             f"perfmodel reads version {VERSION} (refit: calibration/fit.py)")
        names = tuple(data["parameters"])
        cov = np.asarray(data["covariance"], dtype=float)
        if cov.shape != (len(names), len(names)):
            raise ValueError(f"{INTERVAL_FILE}: covariance has shape {cov.shape} for "
                             f"{len(names)} parameters")
        grid = np.asarray(data["probabilities"], dtype=float)
        keys = tuple(data["metrics"])
        quantiles = np.array([np.interp(PROBABILITIES, grid, data["metrics"][k]["z_quantiles"])
                              for k in keys])
        by_framework = [data["metrics"][k].get("scale_by_framework") or {} for k in keys]
        frameworks = tuple(sorted(set().union(*by_framework)))
        framework_scale = None
        if frameworks:
            framework_scale = np.array([[b.get(f, data["metrics"][k]["scale"])
                                         for f in frameworks]
                                        for k, b in zip(keys, by_framework, strict=True)])
        return Intervals(covariance=cov, scale=np.array([data["metrics"][k]["scale"]
                                                          for k in keys]),
                         quantiles=quantiles, names=names, keys=keys,
                         pooling=data.get("pooling"), framework_scale=framework_scale,
                         scale_frameworks=frameworks)


def _normal_quantile(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return math.copysign(8.0, p - 0.5)
    return statistics.NormalDist().inv_cdf(p)


def _robust_scale(e: np.ndarray) -> float:
    """1.4826 x the median absolute value: a standard deviation robust to the odd run."""
    return float(1.4826 * np.median(np.abs(e))) if e.size else float("nan")


# ---------------------------------------------------------------------------------------
# Estimation on the fit rows.


def _op_linearized(block: OpTimings, params: Params):
    """(log times, (samples, 9) Jacobians, family of each sample) of an op-level block."""
    values, jacs, families = [], [], []
    for c in block.chips:
        x = params.family_raw[params.families.index(c.family)]
        jac, value = jax.jacfwd(lambda z, c=c: (_chip_times(z, None, c),) * 2,
                                has_aux=True)(x)
        values.append(np.asarray(value))
        jacs.append(np.asarray(jac))
        families += [c.family] * value.shape[0]
    return np.concatenate(values), np.concatenate(jacs), families


def estimate(rows: Sequence[BenchRow], params: Params, gemm: Sequence[dict] = (),
             nccl: Sequence[dict] = (), pooling: float | None = None,
             linearized: Sequence[dict] | None = None, by_framework: bool = True
             ) -> tuple[Intervals, dict]:
    """The intervals of a fit, from its fit rows only.

    Args:
        rows: the InferenceMAX rows the fit fitted (never held-out rows).
        params: the fitted parameters (`from_json` of the shipped file, or a fit's).
        gemm, nccl: the op-level samples the fit used.
        pooling: the fit's partial pooling (`latency.Prior`).
        linearized: `predict.linearize(rows, params)` when already computed.
        by_framework: a model-error scale per metric and framework (shrunk toward the
            metric's), else one per metric.

    Returns:
        (intervals, a summary: residual scales and rows per data set).
    """
    from .predict import linearize

    lin = list(linearize(rows, params)) if linearized is None else list(linearized)
    names = parameter_names(params)
    position = {n: i for i, n in enumerate(names)}
    blocks_j, blocks_w, summary = [], [], {"sigma": {}, "rows": {}}
    fitted_rows = [(r, e) for r, e in zip(rows, lin, strict=True) if e["pred_error"] == ""]
    index_of = {}
    for r, e in fitted_rows:
        fam, _ = resolve_family(e["family"], params)
        fw = resolve_framework(r.framework, params.frameworks)
        index_of[r.index] = [position[f"{fam}:{f[0]}"] for f in FAMILY_FIELDS] + [
            position[f"{fw}:{f[0]}"] for f in FRAMEWORK_FIELDS]
    residual, leverage_inputs = {}, {}
    for key, column in FITTED.items():
        members = _members(fitted_rows, key)
        e_log = np.array([e["log"][key] - math.log(r.measured[column]) for r, e in members])
        sigma = _robust_scale(e_log)
        weight = math.sqrt(METRIC_WEIGHTS[column])
        psi = np.minimum(1.0, DELTA / np.maximum(np.abs(weight * e_log), 1e-300))
        jac = np.zeros((len(members), len(names)))
        for i, (r, e) in enumerate(members):
            np.add.at(jac[i], index_of[r.index], e["jacobian"][key])
        blocks_j.append(jac)
        blocks_w.append(psi / sigma ** 2)
        residual[key] = (members, e_log)
        leverage_inputs[key] = (jac, psi / sigma ** 2)
        summary["sigma"][column] = sigma
        summary["rows"][column] = len(members)
    for kind, samples in (("gemm", gemm), ("nccl", nccl)):
        if not samples:
            continue
        block = OpTimings.gemm(samples) if kind == "gemm" else OpTimings.nccl(samples)
        value, jac9, families = _op_linearized(block, params)
        e_log = value - np.asarray(block.targets)
        sigma = _robust_scale(e_log)
        psi = np.minimum(1.0, DELTA / np.maximum(np.abs(math.sqrt(OP_WEIGHT) * e_log), 1e-300))
        jac = np.zeros((len(value), len(names)))
        for i, fam in enumerate(families):
            jac[i, [position[f"{fam}:{f[0]}"] for f in FAMILY_FIELDS]] = jac9[i]
        blocks_j.append(jac)
        blocks_w.append(psi / sigma ** 2)
        summary["sigma"][kind] = sigma
        summary["rows"][kind] = len(value)
    prior = Prior.build(params, pooling if POOLED in params.families else None)
    cov = posterior_covariance(np.concatenate(blocks_j), np.concatenate(blocks_w),
                               np.asarray(prior.matrix))
    base = Intervals(covariance=cov, scale=np.zeros(len(INTERVAL_KEYS)),
                     quantiles=np.zeros((len(INTERVAL_KEYS), len(PROBABILITIES))),
                     names=names, keys=INTERVAL_KEYS, pooling=pooling)
    scales, quantiles, framework_scales = [], [], []
    for key in INTERVAL_KEYS:
        column = MEASURED[key]
        members = _members(fitted_rows, key)
        e_log = np.array([e["log"][key] - math.log(r.measured[column]) for r, e in members])
        variance = np.array([_variance(base, params, r, e, key) for r, e in members])
        if key in FITTED:
            jac, w = leverage_inputs[key]
            h = w * np.einsum("ni,ij,nj->n", jac, cov, jac)
            e_log = e_log / np.maximum(1.0 - h, 1e-3)
            summary.setdefault("leverage_max", {})[column] = float(h.max())
        scale = _robust_scale(e_log)
        row_scale = np.full(len(members), scale)
        if by_framework:
            names_fw = np.array([resolve_framework(r.framework, params.frameworks)
                                 for r, _ in members])
            column_scales = []
            for f in params.frameworks:
                e_f = e_log[names_fw == f]
                # Shrunk toward the metric's scale, SHRINKAGE rows' worth of it.
                s_f = math.sqrt((e_f.size * _robust_scale(e_f) ** 2 if e_f.size else 0.0)
                                + SHRINKAGE * scale ** 2) / math.sqrt(e_f.size + SHRINKAGE)
                row_scale[names_fw == f] = s_f
                column_scales.append(s_f)
            framework_scales.append(column_scales)
        z = -e_log / np.sqrt(row_scale ** 2 + variance)
        scales.append(scale)
        quantiles.append(np.quantile(z, PROBABILITIES))
        summary.setdefault("scale", {})[column] = scale
        summary.setdefault("parameter_sd_median", {})[column] = float(
            np.median(np.sqrt(variance)))
    intervals = eqx.tree_at(lambda iv: (iv.scale, iv.quantiles), base,
                            (np.array(scales), np.array(quantiles)))
    if by_framework:
        intervals = Intervals(covariance=cov, scale=np.array(scales),
                              quantiles=np.array(quantiles), names=names, keys=INTERVAL_KEYS,
                              pooling=pooling, framework_scale=np.array(framework_scales),
                              scale_frameworks=params.frameworks)
    summary["date"] = datetime.date.today().isoformat()
    return intervals, summary


def _members(entries, key):
    column = MEASURED[key]
    return [(r, e) for r, e in entries if column in r.measured and np.isfinite(e["log"][key])
            and np.all(np.isfinite(e["jacobian"][key]))]


def _variance(intervals: Intervals, params: Params, row: BenchRow, entry: Mapping,
              key: str) -> float:
    cov, _ = intervals.row_covariance(params, entry["family"], row.framework)
    g = np.asarray(entry["jacobian"][key])
    return float(g @ cov @ g)
