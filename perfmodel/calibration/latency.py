"""The model functions the latency calibration fits, and its residual blocks.

Every residual is a weighted log of predicted over measured, so one scale serves seconds,
tokens per second and every chip:

- `EndToEnd`: throughput per GPU, median TPOT and median TTFT of InferenceMAX rows
  (`serving.predict` on each row's model, chip, layout, precision and workload);
- `OpTimings`: GEMM latencies (`roofline.operator_time` on one GEMM) and NCCL collective
  times (`interconnect.collective_time` over the chip's scale-up tier), which pin the kernel
  physics;
- `Prior`: Gaussian priors in the unconstrained space, optionally partially pooled across
  families (a hierarchical prior).

Jacobians: the fit has about 70 parameters but each row depends on 12 of them (its family's
9 and its framework's 3) and each op-level sample on 9. `rowwise_jacobian` gives the model
functions a JVP that takes each row's Jacobian in its own parameters by forward mode and
contracts it with the tangent, so materialising the Jacobian of the whole residual (what
`optimistix.LevenbergMarquardt` does every step) pushes 12 tangents through the model per
row instead of 70.

Sharding (`EndToEnd.sharded`): each batch's rows padded to a multiple of the device count
and split over a 1-D mesh of local devices (`grid.shard.Placement`, `jax.shard_map`), so
every device evaluates, and takes the Jacobians of, its share of the rows; the parameters,
the gathered residuals and everything the solver does with them stay replicated.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.sharding import NamedSharding, PartitionSpec

from ..architecture import Model
from ..datasets import GEMM_DTYPES, BenchRow
from ..design import Design, Layout, Precision, Runtime, SpecDecode
from ..formats import COMPUTE_CLASSES
from ..grid.shard import Placement
from ..hardware import Chip
from ..interconnect import collective_time
from ..presets import get_chip
from ..roofline import Operator, operator_time
from ..serving import Metrics, predict
from ..workload import Workload
from . import data
from .params import (
    FAMILY_FIELDS,
    FRAMEWORK_FIELDS,
    POOLED,
    Params,
    framework_lookup,
    framework_values,
    prior_row,
    prior_widths,
    resolve_family,
    runtime_values,
    with_family,
)

#: Residual weights of the three end-to-end metrics (TTFT is the noisiest).
METRIC_WEIGHTS = {"tput_per_gpu": 1.0, "median_tpot_s": 1.0, "median_ttft_s": 0.5}
E2E_KEYS = ("tput_per_gpu", "median_tpot_s", "median_ttft_s")
#: Weight of one op-level timing relative to one end-to-end metric.
OP_WEIGHT = 0.3
#: Outputs of the end-to-end model function, per row (logs of tokens/s and seconds; the
#: memory excess is a fraction of the usable HBM, > 0 when a row does not fit).
OUTPUTS = ("log_tput_per_gpu", "log_tpot", "log_ttft", "log_e2e", "memory_excess")

_NF, _NW = len(FAMILY_FIELDS), len(FRAMEWORK_FIELDS)


def huber_residuals(r, delta):
    """sign(r) sqrt(2 huber(r)), elementwise: residuals whose half sum of squares is the
    Huber loss of `r` (quadratic inside `delta`, linear outside; Huber 1964), so a
    least-squares solver minimises the Huber loss. Inside `delta` a residual is unchanged;
    the transform and its derivative are continuous at `delta`.

    Example:
        >>> r = jnp.asarray([0.1, -1.0])
        >>> bool(jnp.allclose(0.5 * jnp.sum(huber_residuals(r, 0.2) ** 2),
        ...                   huber_loss(r, 0.2)))
        True
    """
    a = jnp.abs(r)
    outside = a > delta
    # Double where: the inner branch's sqrt argument is negative inside delta.
    safe = jnp.where(outside, 2.0 * delta * a - delta ** 2, 1.0)
    return jnp.where(outside, jnp.sign(r) * jnp.sqrt(safe), r)


def huber_loss(r, delta):
    """Sum of Huber penalties of residuals `r`: 0.5 r^2 inside `delta`, delta (|r| - delta/2)
    outside."""
    a = jnp.abs(r)
    return jnp.sum(jnp.where(a <= delta, 0.5 * a ** 2, delta * (a - 0.5 * delta)))


def _instantiate(t):
    if not isinstance(t, SymbolicZero):
        return t
    if t.dtype == jax.dtypes.float0:
        return np.zeros(t.shape, jax.dtypes.float0)
    return jnp.zeros(t.shape, t.dtype)


def rowwise_jacobian(f: Callable) -> Callable:
    """`jax.vmap(f)` over rows, with a JVP that computes each row's Jacobian in its own
    parameters by forward mode (`jax.jacfwd`: k tangents per row) and contracts it with the
    tangent of the parameters.

    Args:
        f: f(x, row, shared) -> (m,): x of shape (k,) the row's parameters, `row` a pytree
            of its data, `shared` data common to all rows.

    Returns:
        F(x, rows, shared) -> (n, m) for x of shape (n, k) and `rows` with leading axis n.
        Its JVP in `x` costs one forward pass and k tangents per row, whatever the number of
        tangents pushed through F (a Jacobian of a residual in many parameters); tangents of
        the data fall back to the plain JVP of `jax.vmap(f)`.

    Example:
        >>> F = rowwise_jacobian(lambda x, row, shared: jnp.sin(x) * row + shared)
        >>> x, rows = jnp.ones((3, 2)), jnp.arange(3.0)[:, None]
        >>> J = jax.jacfwd(F)(x, rows, 1.0)
        >>> bool(jnp.allclose(J[1, :, 1, :], jnp.diag(jnp.cos(x[1]))))
        True
    """
    def batched(x, rows, shared):
        return jax.vmap(f, in_axes=(0, 0, None))(x, rows, shared)

    def values_and_jacobians(x, rows, shared):
        def one(xr, row):
            jac, value = jax.jacfwd(lambda z: (f(z, row, shared),) * 2, has_aux=True)(xr)
            return value, jac

        return jax.vmap(one)(x, rows)

    F = jax.custom_jvp(batched)

    def jvp(primals, tangents):
        x, rows, shared = primals
        tx = tangents[0]
        if not all(isinstance(t, SymbolicZero) for t in jax.tree_util.tree_leaves(
                tangents[1:])):
            return jax.jvp(batched, primals, jax.tree_util.tree_map(_instantiate, tangents))
        value, jac = values_and_jacobians(x, rows, shared)
        if isinstance(tx, SymbolicZero):
            return value, jnp.zeros_like(value)
        return value, jnp.einsum("nmk,nk->nm", jac, tx)

    F.defjvp(jvp, symbolic_zeros=True)
    return F


# ---------------------------------------------------------------------------------------
# The model functions.


def row_metrics(model: Model, chip: Chip, design: Design, family_raw, framework_raw, isl,
                osl, conc, draft, reserve, range_ratio=0.8, first_wave=0.1, budget=8192.0,
                poll=1.0, of_free=0.0, reserve_output=0.0, dispatch=0.0,
                vectorize: bool = False) -> Metrics:
    """Metrics of benchmark rows (arrays broadcast together) under given parameters.

    Args:
        model, chip, design: the rows' shared specs (`data.Group`; chip uncalibrated).
        family_raw: (len(FAMILY_FIELDS),) unconstrained family values.
        framework_raw: (..., len(FRAMEWORK_FIELDS)) unconstrained framework values per row.
        isl, osl, conc, draft, reserve: per-row input and output tokens, concurrency
            (requests), MTP draft tokens and activation reserve (bytes).
        range_ratio, first_wave: per-row `Workload.input_range_ratio` (and output) and
            `Workload.first_wave_fraction` (InferenceMAX's 0.8 and 0.1 by default).
        budget: per-row token budget per step (`Runtime.max_batched_tokens`; tokens).
        poll: per-row decode steps between the scheduler's looks for new requests
            (`Runtime.poll_steps`; steps).
        of_free, reserve_output: per-row `Runtime.fraction_of_free` and
            `Runtime.reserve_output` (the engine's memory rules).
        dispatch: per-row `Runtime.dispatch_per_rank` (the engine's MoE dispatch).
        vectorize: as `serving.predict` (same numbers; a smaller program).
    """
    chip = with_family(chip, family_raw)
    values = framework_values(framework_raw)
    runtime = Runtime(**runtime_values(values), activation_reserve=reserve,
                      max_batched_tokens=budget, poll_steps=poll, fraction_of_free=of_free,
                      reserve_output=reserve_output, dispatch_per_rank=dispatch)
    # The framework's MTP acceptance (fitted where it has MTP rows, else its prior).
    spec = SpecDecode(draft_tokens=draft, acceptance=values["mtp_acceptance"])
    design = eqx.tree_at(lambda d: (d.concurrency, d.speculative, d.runtime), design,
                         (conc, spec, runtime))
    workload = Workload(isl, osl, input_range_ratio=range_ratio,
                        output_range_ratio=range_ratio, first_wave_fraction=first_wave)
    return predict(model, chip, workload, design, check=False, vectorize=vectorize,
                   unfit="value")


def outputs(m: Metrics) -> jnp.ndarray:
    """The `OUTPUTS` of metrics, stacked on a last axis."""
    return jnp.stack([jnp.log(m.throughput_per_chip), jnp.log(m.tpot), jnp.log(m.ttft),
                      jnp.log(m.e2e), m.memory_excess], axis=-1)


def _batch_row(x, row, batch: data.Batch):
    inputs, layout = row
    design = batch.design if layout is None else eqx.tree_at(
        lambda d: d.layout, batch.design, layout)
    # vectorize: the compiled program of a row (and its forward-mode Jacobian) is about a
    # third the size, which the fit's compile time follows; the numbers are the same.
    return outputs(row_metrics(batch.model, batch.chip, design, x[:_NF], x[_NF:],
                               vectorize=True, **inputs))


_batch_outputs = rowwise_jacobian(_batch_row)


def gemm_time(chip: Chip, m, n, k, dtype: str | Sequence[str]):
    """Seconds of one (m x k) @ (k x n) GEMM kernel on `chip` (`roofline.operator_time`).

    Args:
        chip: the chip.
        m, n, k: matrix dimensions (arrays broadcast together).
        dtype: a `datasets.GEMM_DTYPES` name, or one per element of the broadcast shape
            (one compiled formula for samples of several dtypes).

    Example:
        >>> chip = get_chip("h100", calibrated=False)
        >>> t = gemm_time(chip, jnp.asarray([1.0, 8192.0]), 8192.0, 8192.0, "fp8")
        >>> bool(t[1] > 10 * t[0])
        True
        >>> mixed = gemm_time(chip, jnp.asarray([8192.0, 8192.0]), 8192.0, 8192.0,
        ...                   ["fp8", "bfloat16"])
        >>> bool(jnp.allclose(mixed[0], t[1])), bool(mixed[1] > mixed[0])
        (True, True)
    """
    m, n, k = jnp.broadcast_arrays(*(jnp.asarray(v, dtype=float) for v in (m, n, k)))
    if isinstance(dtype, str):
        return _gemm_time(chip, m, n, k, *_dtype_numbers(dtype))
    if len(dtype) != m.size:
        raise ValueError(f"gemm_time got {len(dtype)} dtypes for {m.size} GEMMs; give one "
                         "dtype, or one per GEMM")
    wb, ab, mix = (jnp.asarray(v) for v in zip(*(_dtype_numbers(d) for d in dtype),
                                               strict=True))
    t = jax.vmap(_gemm_time, in_axes=(None, 0, 0, 0, 0, 0, 0))(
        chip, m.ravel(), n.ravel(), k.ravel(), wb, ab, mix)
    return t.reshape(m.shape)


def format_ratio(chip: Chip, samples: Sequence[dict], dtype: str) -> tuple[float, float]:
    """A narrow format's GEMM time over BF16's at the same large shapes (m >= 4096, n, k >=
    8192) of `samples` on `chip` (`datasets.load_gemm` dicts; median over the shapes):
    (measured, predicted by `gemm_time`), or (nan, nan) where no shape has both.

    Example:
        >>> chip = get_chip("b200", calibrated=False)
        >>> rows = [dict(chip="b200", dtype=d, m=8192.0, n=8192.0, k=8192.0, seconds=s)
        ...         for d, s in (("bfloat16", 1.0), ("nvfp4", 0.4))]
        >>> measured, predicted = format_ratio(chip, rows, "nvfp4")
        >>> measured, bool(0.25 < predicted < 1.0)
        (0.4, True)
    """
    seconds = {(x["chip"], x["dtype"], x["m"], x["n"], x["k"]): x["seconds"] for x in samples}
    shapes = [key[2:] for key in seconds if key[:2] == (chip.name, dtype) and key[2] >= 4096
              and min(key[3:]) >= 8192 and (chip.name, "bfloat16", *key[2:]) in seconds]
    if not shapes:
        return math.nan, math.nan
    measured = [seconds[(chip.name, dtype, *x)] / seconds[(chip.name, "bfloat16", *x)]
                for x in shapes]
    m, n, k = (np.array([x[i] for x in shapes]) for i in range(3))
    predicted = np.asarray(gemm_time(chip, m, n, k, dtype)) / np.asarray(
        gemm_time(chip, m, n, k, "bfloat16"))
    return float(np.median(measured)), float(np.median(predicted))


def _dtype_numbers(dtype: str):
    wb, ab, cls = GEMM_DTYPES[dtype]
    return wb, ab, np.array([1.0 if c == cls else 0.0 for c in COMPUTE_CLASSES])


def _gemm_time(chip, m, n, k, wb, ab, mix):
    op = Operator(name="gemm", flops=2.0 * m * n * k, weight_bytes=n * k * wb,
                  kv_bytes=jnp.zeros_like(m), activation_bytes=(m * k + m * n) * ab,
                  rows=m, compute_mix=mix, kernels=jnp.ones_like(m),
                  fabric_rows=jnp.zeros_like(m))
    prec = Precision(weight_bytes=wb, expert_bytes=wb, kv_bytes=ab, activation_bytes=ab,
                     weight_compute=mix, expert_compute=mix, attention_compute=mix)
    design = Design(concurrency=1.0, layout=Layout(), precision=prec)
    t, _ = operator_time(op, chip, design, jnp.ones_like(m))
    return t


# ---------------------------------------------------------------------------------------
# Residual blocks.


class AbstractBlock(eqx.Module):
    """A set of weighted log residuals of the fitted parameters. Weights are array leaves:
    a refit on another subset (`with_weights`) reuses the compiled solve."""

    @abc.abstractmethod
    def __call__(self, params: Params) -> tuple[jnp.ndarray, jnp.ndarray | None]:
        """(residuals of shape (size,), auxiliary outputs or None)."""


class EndToEnd(AbstractBlock):
    """End-to-end residuals of InferenceMAX rows: log predicted over measured throughput per
    GPU (not of a stalled run, `BenchRow.stalled`), median TPOT and median TTFT, weighted by
    `METRIC_WEIGHTS`. Rows whose weights and one sequence do not fit in HBM (memory excess
    > 0, which the fitted parameters do not change) are not fitted: their predictions
    collapse.

    Build with `EndToEnd.build(rows)`; the auxiliary output is the `OUTPUTS` of every row,
    shape (rows, len(OUTPUTS)).
    """

    batches: tuple[data.Batch, ...]
    targets: jnp.ndarray
    """(rows, len(E2E_KEYS)) log measured values (0 where not measured)."""
    measured: jnp.ndarray
    """(rows, len(E2E_KEYS)) 1 where measured, else 0."""
    weights: jnp.ndarray
    """(rows, len(E2E_KEYS)) residual weights (0: not fitted or not measured)."""
    order: jnp.ndarray
    """(rows,) position of each row among the batches' rows."""
    indices: tuple[int, ...] = eqx.field(static=True)
    """`BenchRow.index` of each row, in row order."""
    placement: Placement | None = eqx.field(static=True, default=None)
    """The devices the batches' rows are split over (`sharded`); None: one device."""

    @staticmethod
    def build(rows: Sequence[BenchRow]) -> tuple[EndToEnd, dict[int, str]]:
        """The block of every modellable row (all fitted), and why the others are not
        (`data.build_groups`)."""
        groups, errors = data.build_groups(rows)
        batches = tuple(data.batches(groups))
        by_index = {r.index: r for r in rows}
        indices = tuple(r.index for r in rows if r.index not in errors)
        stacked = [i for b in batches for i in b.indices]
        where = {i: k for k, i in enumerate(stacked)}
        targets = np.full((len(indices), len(E2E_KEYS)), np.nan)
        for k, i in enumerate(indices):
            for m, key in enumerate(E2E_KEYS):
                # A stalled run's throughput is stretched by its stall: its medians only.
                if key in by_index[i].measured and not (key == "tput_per_gpu"
                                                        and by_index[i].stalled):
                    targets[k, m] = math.log(by_index[i].measured[key])
        measured = np.isfinite(targets).astype(float)
        block = EndToEnd(batches=batches, targets=jnp.asarray(np.nan_to_num(targets)),
                         measured=jnp.asarray(measured), weights=jnp.asarray(measured),
                         order=jnp.asarray([where[i] for i in indices], dtype=int),
                         indices=indices)
        return block.with_weights(np.ones(len(indices))), errors

    def with_weights(self, row_weights) -> EndToEnd:
        """The block fitting rows with `row_weights[row] > 0` (row order of `indices`), each
        metric weighted by `row_weights[row] * sqrt(METRIC_WEIGHTS[metric])`."""
        row_weights = np.asarray(row_weights, dtype=float)
        if row_weights.shape != (len(self.indices),):
            raise ValueError(f"row_weights has shape {row_weights.shape}; expected "
                             f"({len(self.indices)},), one per row of the block")
        metric = np.sqrt([METRIC_WEIGHTS[m] for m in E2E_KEYS])
        w = row_weights[:, None] * metric[None, :] * np.asarray(self.measured)
        return eqx.tree_at(lambda b: b.weights, self, jnp.asarray(w))

    def sharded(self, placement: Placement) -> EndToEnd:
        """The block with each batch's rows split over `placement`'s devices (on one
        device, the block itself).

        Each batch is padded to a multiple of the device count with copies of its last row
        (`data.Batch.padded`), which `order` skips: they enter no residual, and the
        residuals, their Jacobian and the auxiliary outputs have the shapes and the rows of
        the one-device block.

        Raises:
            ValueError: the block is already sharded.
        """
        if self.placement is not None:
            raise ValueError("EndToEnd.sharded: the block is already sharded over "
                             f"{self.placement.count} devices")
        if placement.count == 1:
            return self
        batches = tuple(b.padded(placement.count, placement.sharding) for b in self.batches)
        # Stacked position of each batch row, before -> after padding.
        where = np.concatenate([start + np.arange(b.size) for start, b in zip(
            np.cumsum([0] + [b.length for b in batches[:-1]]), batches, strict=True)])
        order = jnp.asarray(where[np.asarray(self.order)], dtype=int)
        return EndToEnd(batches=batches, targets=self.targets, measured=self.measured,
                        weights=self.weights, order=order, indices=self.indices,
                        placement=placement)

    def parameter_rows(self, params: Params, fallback: dict | None = None,
                       strict: bool = True) -> tuple[jnp.ndarray, ...]:
        """Per batch, (rows, 12) unconstrained family and framework values of its rows.

        Args:
            params: the parameters.
            fallback: family map for families absent from `params` (default
                `params.FAMILY_FALLBACK`); used unless `strict`.
            strict: every family must be in `params` (a fit), else `ValueError`.
        """
        prior = jnp.asarray(prior_row(FRAMEWORK_FIELDS))
        table = jnp.concatenate([params.framework_raw, prior[None]])
        out = []
        for b in self.batches:
            if strict and b.family not in params.families:
                raise ValueError(f"params has no family {b.family!r} (has "
                                 f"{params.families}); fit every family of the rows")
            family, _ = resolve_family(b.family, params, fallback)
            fam = (params.family_raw[params.families.index(family)] if family
                   else jnp.asarray(prior_row(FAMILY_FIELDS)))
            fw, keep_prior = framework_lookup(b.frameworks, params)
            values = table[fw] if not keep_prior.any() \
                else jnp.where(keep_prior, prior[None], table[fw])
            out.append(jnp.concatenate([jnp.broadcast_to(fam, (b.length, _NF)), values],
                                       axis=1))
        return tuple(out)

    def evaluate(self, parameter_rows: Sequence[jnp.ndarray],
                 differentiable: bool = True) -> jnp.ndarray:
        """(rows, len(OUTPUTS)) model outputs, row order, from `parameter_rows`.

        `differentiable`: through `rowwise_jacobian` (what a fit differentiates), else the
        plain vmapped model (values only: a third of the program)."""
        batch = _batch_outputs if differentiable else jax.vmap(_batch_row,
                                                                in_axes=(0, 0, None))
        if self.placement is None:
            values = [batch(x, (b.inputs, b.layouts), b)
                      for b, x in zip(self.batches, parameter_rows, strict=True)]
            return jnp.concatenate(values)[self.order]

        def kernel(points, b):
            return batch(points[0], points[1:], b)

        # The per-row arrays go in as the split points; the batch's specs (model, chip,
        # design) are replicated without them.
        values = [self.placement.map(kernel, (x, b.inputs, b.layouts),
                                     dataclasses.replace(b, inputs={}, layouts=None))
                  for b, x in zip(self.batches, parameter_rows, strict=True)]
        # Replicated from here: the solver's linear algebra is the one-device program's.
        return jax.lax.with_sharding_constraint(
            jnp.concatenate(values)[self.order],
            NamedSharding(self.placement.mesh, PartitionSpec()))

    def __call__(self, params: Params):
        out = self.evaluate(self.parameter_rows(params))
        weights = jnp.where(out[:, 4:5] <= 0.0, self.weights, 0.0)
        r = jnp.where(weights > 0.0, (out[:, :3] - self.targets) * weights, 0.0)
        return r.ravel(), out


class _ChipSamples(eqx.Module):
    chip: Chip
    arrays: tuple
    kind: str = eqx.field(static=True)
    keys: tuple = eqx.field(static=True)
    family: str = eqx.field(static=True)


def _chip_times(x, row, samples: _ChipSamples):
    del row
    c = with_family(samples.chip, x)
    if samples.kind == "gemm":
        # keys: the dtype of each sample (one formula for all of a chip's GEMMs).
        t = [gemm_time(c, *samples.arrays, samples.keys)]
    else:
        # keys: the collectives; arrays: (bytes, group size) per collective, the group size
        # as data, so that one formula serves every size.
        t = [collective_time(op, size, n, c.scale_up, c.scale_out, c.domain_size)
             for op, (size, n) in zip(samples.keys, samples.arrays, strict=True)]
    return jnp.log(jnp.concatenate(t))


_chip_log_times = rowwise_jacobian(_chip_times)


class OpTimings(AbstractBlock):
    """Op-level residuals: log predicted over measured seconds of GEMM kernels
    (`gemm_time`) or NCCL collectives (`interconnect.collective_time` over the chip's
    scale-up tier), weighted by sqrt(`OP_WEIGHT`). Build with `OpTimings.gemm(samples)` or
    `OpTimings.nccl(samples)` (`datasets.load_gemm`, `datasets.load_nccl`)."""

    chips: tuple[_ChipSamples, ...]
    targets: jnp.ndarray
    """(samples,) log measured seconds."""
    weights: jnp.ndarray
    """(samples,) residual weights."""
    sample_chips: tuple[str, ...] = eqx.field(static=True)
    """Chip preset of each sample, in residual order."""
    sample_families: tuple[str, ...] = eqx.field(static=True)
    """Chip family of each sample, in residual order."""

    @staticmethod
    def gemm(samples: Sequence[dict]) -> OpTimings:
        """GEMM timings (dicts with chip, dtype, m, n, k in elements, seconds)."""
        def arrays(members):
            dims = tuple(jnp.asarray([s[f] for s in members], dtype=float)
                         for f in ("m", "n", "k"))
            return dims, tuple(s["dtype"] for s in members)

        return OpTimings._build("gemm", samples, lambda s: s["dtype"], arrays)

    @staticmethod
    def nccl(samples: Sequence[dict]) -> OpTimings:
        """Collective timings (dicts with chip, op, n chips, bytes, seconds)."""
        def arrays(members):
            ops = sorted({s["op"] for s in members})
            return tuple((jnp.asarray([s["bytes"] for s in members if s["op"] == op],
                                      dtype=float),
                          jnp.asarray([s["n"] for s in members if s["op"] == op],
                                      dtype=float)) for op in ops), tuple(ops)

        return OpTimings._build("nccl", samples, lambda s: (s["op"], s["n"]), arrays)

    @staticmethod
    def _build(kind, samples, key_of, arrays_of) -> OpTimings:
        by_chip: dict[str, list] = {}
        for s in samples:
            by_chip.setdefault(s["chip"], []).append(s)
        chips, targets, names, families = [], [], [], []
        for name, members in by_chip.items():
            chip = get_chip(name, calibrated=False)
            # Residual order: sorted by key (dtype; collective then group size), stable.
            members = sorted(members, key=key_of)
            arrays, keys = arrays_of(members)
            targets += [math.log(s["seconds"]) for s in members]
            names += [name] * len(members)
            families += [chip.family] * len(members)
            chips.append(_ChipSamples(chip=chip, arrays=arrays, kind=kind, keys=keys,
                                      family=chip.family))
        block = OpTimings(chips=tuple(chips), targets=jnp.asarray(targets, dtype=float),
                          weights=jnp.zeros(len(targets)), sample_chips=tuple(names),
                          sample_families=tuple(families))
        return block.with_weights(np.ones(len(targets)))

    def with_weights(self, sample_weights) -> OpTimings:
        """The block with each sample weighted by `sample_weights[sample] * sqrt(OP_WEIGHT)`
        (0: not fitted), in the order of `sample_chips`."""
        w = np.asarray(sample_weights, dtype=float)
        if w.shape != (len(self.sample_chips),):
            raise ValueError(f"sample_weights has shape {w.shape}; expected "
                             f"({len(self.sample_chips)},), one per sample")
        return eqx.tree_at(lambda b: b.weights, self, jnp.asarray(w * math.sqrt(OP_WEIGHT)))

    @property
    def families(self) -> tuple[str, ...]:
        """Chip families of the samples' chips."""
        return tuple(sorted(set(self.sample_families)))

    def __call__(self, params: Params):
        t = []
        for c in self.chips:
            if c.family not in params.families:
                raise ValueError(f"params has no family {c.family!r} (has "
                                 f"{params.families}); fit every family of the samples")
            x = params.family_raw[params.families.index(c.family)][None]
            t.append(_chip_log_times(x, None, c)[0])
        return (jnp.concatenate(t) - self.targets) * self.weights, None


class Prior(AbstractBlock):
    """Gaussian priors in the unconstrained space: (theta - prior) / width.

    With `pooling` and a `POOLED` row in `params.families` (partial pooling, a hierarchical
    prior): the pooled row has the priors, every other family a Gaussian around the pooled
    row of width `pooling` x the prior width. A family with no data then sits on the pooled
    row, which every family's data inform (what leave-one-chip-out predicts a new family
    with).

    Example:
        >>> p = Params.prior(("hopper", POOLED), ())
        >>> r, _ = Prior.build(p, pooling=0.5)(p.with_flat(p.flat + 0.1))
        >>> bool(abs(r[0]) < 1e-12), round(float(r[-1]), 3)
        (True, 0.1)
    """

    center: jnp.ndarray
    """(parameters,) prior values (unconstrained)."""
    matrix: jnp.ndarray
    """(parameters, parameters): residuals are matrix @ (theta - center)."""

    @staticmethod
    def build(params: Params, pooling: float | None = None) -> Prior:
        """Priors of every parameter of `params` (partially pooled with `pooling`)."""
        center = np.asarray(Params.prior(params.families, params.frameworks).flat)
        family_widths = np.array([f[3] for f in FAMILY_FIELDS])
        matrix = np.diag(1.0 / prior_widths(params.families, params.frameworks))
        if pooling is not None and POOLED in params.families:
            pooled = np.arange(_NF) + _NF * params.families.index(POOLED)
            for i, fam in enumerate(params.families):
                if fam != POOLED:
                    rows = np.arange(_NF) + _NF * i
                    matrix[rows, rows] = 1.0 / (pooling * family_widths)
                    matrix[rows, pooled] = -1.0 / (pooling * family_widths)
        return Prior(center=jnp.asarray(center), matrix=jnp.asarray(matrix))

    def __call__(self, params: Params):
        return self.matrix @ (params.flat - self.center), None
