"""The figures the inferred mode fits (`perfmodel.studies.inferred`), as model outputs:
`Target` (a reported pair at a chip's peak point: tokens/s per kW and E2E ratios against
the baseline's peak), `PointTarget` (a reported figure at a fixed point of the sweep: a
per-user speed, or a tokens/s per kW ratio at high interactivity), the points themselves
(`replica_metrics`, `point_value`: one replica of the point's layout, the concurrency capped
by the batch that fits, differentiable in the chip and runtime) and `band_miss`, the
one-sided residual of a figure reported as a band.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax.numpy as jnp

from ..design import Design, Layout, LayoutNumbers, Runtime, precision
from ..hardware import Chip
from ..kvcache import max_batch
from ..presets import get_model
from ..serving import predict
from ..smooth import smooth_min
from ..workload import Workload


def _one_replica(layout: Layout | LayoutNumbers) -> LayoutNumbers:
    # As numbers: a refit after the re-sweep moves the peak to another layout, and static
    # layouts would make it another program to trace and compile (16 s and 45 s each on 2
    # cores for the three reported pairs); as numbers the refit reuses the first's.
    if isinstance(layout, Layout):
        return dataclasses.replace(layout, replicas=1).numbers()
    return eqx.tree_at(lambda n: n.replicas, layout, jnp.ones_like(layout.replicas))


def _number(x):
    # Explicit dtype: a Python float would give a weakly typed array, whose compiled solve
    # a strongly typed one (a ratio computed by the model) would not reuse.
    return jnp.asarray(x, dtype=float)


class Target(eqx.Module):
    """One reported pair to fit: a model at its predicted peak point, against the baseline's
    peak (fixed) and the reported ratios.

    Example:
        >>> t = Target("gpt-oss-120b", Layout.parse("tp2-dpa"), concurrency=128.0,
        ...            baseline_kw=86_000.0, baseline_e2e=70.0, reported_kw=1.9,
        ...            reported_e2e=1.7)
        >>> int(t.layout.tp), float(t.reported_kw)
        (2, 1.9)
    """

    model: str = eqx.field(static=True)
    """Model preset name."""
    layout: LayoutNumbers = eqx.field(converter=_one_replica)
    """The peak point's layout, as numbers of one replica (a `Layout` is converted; one
    replica is evaluated)."""
    concurrency: jnp.ndarray = eqx.field(converter=_number)
    """Requests in flight per replica at the peak (requests; capped by the batch that fits
    as the parameters move)."""
    baseline_kw: jnp.ndarray = eqx.field(converter=_number)
    """The baseline's tokens/s per kW of TDP at its peak (tokens/s/kW)."""
    baseline_e2e: jnp.ndarray = eqx.field(converter=_number)
    """The baseline's end-to-end latency at its peak (s)."""
    reported_kw: jnp.ndarray = eqx.field(converter=_number)
    """Reported tokens/s per kW ratio, chip over baseline (dimensionless)."""
    reported_e2e: jnp.ndarray = eqx.field(converter=_number)
    """Reported E2E latency ratio, baseline over chip (dimensionless)."""
    top: jnp.ndarray = eqx.field(converter=_number, default=float("nan"))
    """The chip's top concurrency in the predicted mode (requests per chip): the prior
    centre of the fitted top (`InferredParams.top_requests`); NaN: the top is not fitted."""
    claims: tuple[str, str] = eqx.field(static=True, default=("", ""))
    """Claim ids of the reported (tokens/s per kW, E2E) ratios, for reports."""


class PointTarget(eqx.Module):
    """One reported figure at a fixed point of the chip's sweep: a per-user speed at the
    low-concurrency point (J08, J09: `metric` "interactivity", `baseline` 1) or a tokens/s
    per kW ratio at the high-interactivity point (J07: "tok_s_per_kw", the baseline's
    value there), with the band [`low`, `high`] the reports put it in.

    Example:
        >>> t = PointTarget("J08", "deepseek-r1", Layout.parse("tp16-ep16"), 1.0,
        ...                 "interactivity", 1.0, 700.0, float("inf"))
        >>> float(t.low), bool(jnp.isinf(t.high))
        (700.0, True)
    """

    claim: str = eqx.field(static=True)
    """Claim id (jalapeno_claims.csv)."""
    model: str = eqx.field(static=True)
    """Model preset name."""
    layout: LayoutNumbers = eqx.field(converter=_one_replica)
    """The point's layout, as numbers of one replica (a `Layout` is converted)."""
    concurrency: jnp.ndarray = eqx.field(converter=_number)
    """Requests in flight per replica (requests; capped by the batch that fits)."""
    metric: str = eqx.field(static=True)
    """"interactivity" (tokens/s/user) or "tok_s_per_kw" (tokens/s per kW of TDP)."""
    baseline: jnp.ndarray = eqx.field(converter=_number)
    """Divides the metric: 1 for a speed, the baseline's tokens/s per kW for a ratio."""
    low: jnp.ndarray = eqx.field(converter=_number)
    """Lower end of the reported band (the metric's unit over the baseline's)."""
    high: jnp.ndarray = eqx.field(converter=_number)
    """Upper end (inf: one-sided, "> low"; equal to `low`: a value, "~ low")."""

    def __check_init__(self):
        if self.metric not in ("interactivity", "tok_s_per_kw"):
            raise ValueError(f"PointTarget.metric {self.metric!r}: give 'interactivity' or "
                             "'tok_s_per_kw'")


def band_miss(value, low, high) -> jnp.ndarray:
    """Log miss of `value` against the band [`low`, `high`]: log(value / low) below it
    (negative), log(value / high) above it (positive), 0 inside: a one-sided residual,
    zero when the figure is met (traceable; `high` may be inf).

    Example:
        >>> [round(float(band_miss(v, 700.0, jnp.inf)), 4) for v in (350.0, 700.0, 1400.0)]
        [-0.6931, 0.0, 0.0]
    """
    log_value = jnp.log(value)
    below = log_value - jnp.log(low)
    above = log_value - jnp.log(high)
    return jnp.where(below < 0, below, jnp.where(above > 0, above, 0.0))


def replica_metrics(model_name: str, single: LayoutNumbers, concurrency, chip: Chip,
                    runtime: Runtime, workload: Workload):
    """`Metrics` of one replica (`single`, layout numbers) at `concurrency` requests,
    capped by the batch that fits with `chip` and `runtime` (traceable, vmappable over the
    layout and the concurrency)."""
    model = get_model(model_name)
    prec = precision(chip, model, "fp4")
    context = runtime.kv_context(workload)
    fit = max_batch(model, single, prec, chip.hbm_capacity, context, runtime.memory_fraction,
                    runtime.activation_reserve, None, chip.num_slices, runtime.fraction_of_free)
    conc = smooth_min(jnp.maximum(fit, 1.0), concurrency)
    design = Design(concurrency=conc, layout=single, precision=prec, runtime=runtime)
    return predict(model, chip, workload, design, check=False, unfit="value", vectorize=True)


def point_value(target: PointTarget, chip: Chip, runtime: Runtime, workload: Workload):
    """The metric of a `PointTarget` over its baseline (traceable): tokens/s/user, or a
    tokens/s per kW ratio."""
    m = replica_metrics(target.model, target.layout, target.concurrency, chip, runtime, workload)
    value = m.interactivity if target.metric == "interactivity" else m.tok_s_per_kw_tdp
    return value / target.baseline
