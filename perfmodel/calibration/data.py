"""Benchmark rows to what the model evaluates: groups of one static structure, and batches
of groups that one vmapped function can evaluate together.

Parallel layouts are static in the model (`design.Layout`: one compiled program per
layout), but a layout can also be given as numbers (`design.LayoutNumbers`, and
`Disaggregated` of two of them), which the model evaluates with the same results. So the
aggregated rows of one model, chip and precision form one `Batch` with a layout per row; for
the fit a disaggregated layout stays static and its rows form a batch of their own (on the
shipped InferenceMAX table 46 batches for 59 static structures), while an eager evaluation
(`predict_rows`) merges the disaggregated rows of one model, chip and precision too
(`batches(..., disaggregated_numbers=True)`: 14 batches).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..architecture import Model
from ..datasets import BenchRow
from ..design import Design, Disaggregated, Layout, LayoutNumbers, Runtime, precision
from ..hardware import Chip
from ..presets import find_model, get_chip
from .params import (
    FRAMEWORK_FIELDS,
    FRAMEWORK_SETTINGS,
    Params,
    framework_lookup,
    prior_row,
)

#: The per-row numbers the model reads (`row_inputs`): input and output tokens (tokens),
#: concurrency (requests), MTP draft tokens (tokens), activation reserve (bytes), the
#: lengths' range ratio and the first-wave fraction (dimensionless), the token budget
#: per step (tokens), the decode steps between the scheduler's looks for new requests
#: (`Runtime.poll_steps`; steps), the engine's memory rules (`Runtime.fraction_of_free` and
#: `Runtime.reserve_output`, 0 or 1) and its MoE dispatch (`Runtime.dispatch_per_rank`, 0 or 1).
INPUTS = ("isl", "osl", "conc", "draft", "reserve", "range_ratio", "first_wave", "budget",
          "poll", "of_free", "reserve_output", "dispatch")


@dataclasses.dataclass
class Group:
    """Rows sharing one static structure (model, chip, precision, layout)."""

    model: Model
    chip: Chip
    family: str
    design: Design
    rows: list


def _layout(pool) -> Layout:
    return Layout(tp=pool.tp, ep=pool.ep, dp_attention=pool.dp_attention,
                  replicas=pool.replicas)


def model_of(name: str) -> Model:
    """A model preset by name, else a shipped Hugging Face config (`presets.find_model`).

    Raises:
        ValueError: neither exists ("unknown model ...").

    Example:
        >>> model_of("gpt-oss-120b").is_moe
        True
    """
    return find_model(name)


def build_groups(rows: Sequence[BenchRow]) -> tuple[list[Group], dict[int, str]]:
    """Group rows by static structure and build their specs (uncalibrated chip).

    Returns:
        (groups, errors): rows that cannot be modelled are left out, with a message by row
        index (unknown model or chip, a layout the model rejects).

    Example:
        >>> import perfmodel.datasets as ds
        >>> row = ds.BenchRow(0, 2, "gpt-oss-120b", "b200", "vllm", "fp4", 1024., 1024.,
        ...                   8., False, ds.PoolLayout(1, 1, False), None, None, {})
        >>> groups, errors = build_groups([row])
        >>> groups[0].family, groups[0].design.layout.describe(), errors
        ('blackwell', 'tp1', {})
    """
    structures: dict[tuple, list[BenchRow]] = {}
    for row in rows:
        structures.setdefault(row.structure, []).append(row)
    groups, errors = [], {}
    for members in structures.values():
        row = members[0]
        try:
            model = model_of(row.model)
            chip = get_chip(row.hardware, calibrated=False)
            prec = precision(chip, model, row.precision, kv=row.kv, emulate=True)  # what ran
            if row.disaggregated:
                layout = Disaggregated(prefill=_layout(row.prefill), decode=_layout(row.decode))
                pools = (layout.prefill, layout.decode)
            else:
                layout = _layout(row.layout)
                pools = (layout,)
            if model.is_moe:
                # Wide EP over a group that does not divide the experts (SGLang's 48-GPU
                # decode with EPLB's redundant experts): experts spread over the largest
                # divisor, tensor-parallel over the rest of the group.
                fixed = [Layout(tp=pool.tp, ep=math.gcd(pool.ep, model.num_experts),
                                pp=pool.pp, dp_attention=pool.dp_attention,
                                replicas=pool.replicas) for pool in pools]
                if isinstance(layout, Disaggregated):
                    layout = Disaggregated(prefill=fixed[0], decode=fixed[1])
                else:
                    layout = fixed[0]
            for pool in pools:
                problem = model.split_problem(pool.tp, pool.dp_attention)
                if problem:
                    raise ValueError(f"layout {pool.describe()}: {problem}")
            design = Design(concurrency=1.0, layout=layout, precision=prec)
        except ValueError as error:
            for member in members:
                errors[member.index] = str(error)
            continue
        groups.append(Group(model=model, chip=chip, family=chip.family, design=design,
                            rows=members))
    return groups, errors


def row_inputs(rows: Sequence[BenchRow]) -> dict[str, np.ndarray]:
    """The `INPUTS` of each row, float64 arrays of shape (rows,).

    Example:
        >>> import perfmodel.datasets as ds
        >>> row = ds.BenchRow(0, 2, "gpt-oss-120b", "b200", "sglang", "fp4", 1024., 512.,
        ...                   8., True, ds.PoolLayout(1, 1, False), None, None, {})
        >>> {k: float(v[0]) for k, v in row_inputs([row]).items()}  # doctest: +NORMALIZE_WHITESPACE
        {'isl': 1024.0, 'osl': 512.0, 'conc': 8.0, 'draft': 2.0, 'reserve': 0.0,
         'range_ratio': 0.8, 'first_wave': 0.1, 'budget': 8192.0, 'poll': 1.0,
         'of_free': 0.0, 'reserve_output': 0.0, 'dispatch': 0.0}
    """
    reserve = float(Runtime().activation_reserve)
    return dict(
        isl=np.array([r.isl for r in rows], dtype=float),
        osl=np.array([r.osl for r in rows], dtype=float),
        conc=np.array([r.conc for r in rows], dtype=float),
        draft=np.array([r.draft_tokens for r in rows]),
        reserve=np.array([FRAMEWORK_SETTINGS.get(r.framework, {}).get(
            "activation_reserve", reserve) for r in rows]),
        range_ratio=np.array([r.range_ratio for r in rows], dtype=float),
        first_wave=np.array([r.first_wave for r in rows], dtype=float),
        budget=np.array([r.max_batched_tokens for r in rows], dtype=float),
        poll=np.array([r.poll_steps for r in rows], dtype=float),
        **{name: np.array([FRAMEWORK_SETTINGS.get(r.framework, {}).get(field, 0.0)
                           for r in rows])
           for name, field in (("of_free", "fraction_of_free"),
                               ("reserve_output", "reserve_output"),
                               ("dispatch", "dispatch_per_rank"))})


def framework_rows(rows: Sequence[BenchRow], params: Params) -> np.ndarray:
    """(rows, len(FRAMEWORK_FIELDS)) unconstrained framework values of each row: its own,
    its fallback's (`params.FRAMEWORK_FALLBACK`; from another serving mode without
    `fitted.MODE_TERMS`, which keep their priors), else the priors
    (`params.framework_lookup`)."""
    prior = prior_row(FRAMEWORK_FIELDS)
    table = np.concatenate([np.asarray(params.framework_raw).reshape(-1, prior.size),
                            prior[None]])
    index, keep_prior = framework_lookup([r.framework for r in rows], params)
    return np.where(keep_prior, prior[None], table[index])


class Batch(eqx.Module):
    """Rows that one vmapped model function evaluates: one model, chip and precision, and
    either a static disaggregated layout or a per-row aggregated layout (`layouts`).

    Example:
        >>> import perfmodel.datasets as ds
        >>> rows = [ds.BenchRow(i, i + 2, "gpt-oss-120b", "b200", "vllm", "fp4", 1024.,
        ...                     1024., 8., False, ds.PoolLayout(tp, 1, False), None, None,
        ...                     {}) for i, tp in enumerate((1, 2))]
        >>> [b.size for b in batches(build_groups(rows)[0])]
        [2]
    """

    model: Model
    chip: Chip
    """The uncalibrated chip (the family's fitted values replace its efficiencies)."""
    design: Design
    """Precision and, when disaggregated, the static layout; the per-row numbers replace
    its concurrency, speculative decoding and runtime."""
    layouts: LayoutNumbers | None
    """(rows,) aggregated layouts as numbers, or None when `design.layout` is static."""
    inputs: dict[str, jnp.ndarray]
    """`INPUTS` of each row, (rows,) each."""
    family: str = eqx.field(static=True)
    indices: tuple[int, ...] = eqx.field(static=True)
    """`BenchRow.index` of each row."""
    frameworks: tuple[str, ...] = eqx.field(static=True)
    """Serving framework of each row."""

    @property
    def size(self) -> int:
        """Rows of the batch (its `indices`)."""
        return len(self.indices)

    @property
    def length(self) -> int:
        """Rows its arrays hold: `size`, plus the padding of a sharded batch (`padded`)."""
        return len(self.frameworks)

    def padded(self, multiple: int, sharding=None) -> Batch:
        """The batch with its rows padded to a multiple of `multiple` by copies of its last
        row, so that the row axis splits evenly over `multiple` devices; its per-row arrays
        placed with `sharding` (a `jax.sharding.NamedSharding` over the row axis) when given.

        The copies are evaluated (finite, like the row they copy) but never fitted:
        `latency.EndToEnd.order` does not select them, so they contribute no residual.
        `indices` keeps the real rows; `frameworks` gains the copies' (`length`).
        """
        extra = -self.length % multiple

        def pad(a):
            return jnp.concatenate([a, jnp.repeat(a[-1:], extra, axis=0)]) if extra else a

        inputs = {k: pad(v) for k, v in self.inputs.items()}
        layouts = None if self.layouts is None else jax.tree_util.tree_map(pad, self.layouts)
        if sharding is not None:
            inputs, layouts = jax.device_put((inputs, layouts), sharding)
        return Batch(model=self.model, chip=self.chip, design=self.design, layouts=layouts,
                     inputs=inputs, family=self.family, indices=self.indices,
                     frameworks=self.frameworks + self.frameworks[-1:] * extra)


def _stack(layouts: Sequence, counts: Sequence[int]):
    """Each layout (as numbers) repeated for its `counts` rows, stacked on a leading axis
    (in NumPy, then `device_put`: a device array per row costs seconds on a large table,
    and `jnp.asarray` of a NumPy array compiles a copy per shape)."""
    return jax.tree_util.tree_map(
        lambda *leaves: jax.device_put(np.repeat(np.stack([np.asarray(v) for v in leaves]),
                                                 counts, axis=0)), *layouts)


def batches(groups: Sequence[Group], disaggregated_numbers: bool = False) -> list[Batch]:
    """The groups as batches: aggregated groups of one model, chip and precision merged
    (their layouts as per-row numbers), each disaggregated group alone, or with
    `disaggregated_numbers` the disaggregated groups of one model, chip and precision
    merged too (per-row `Disaggregated` of `LayoutNumbers` pools: fewer, larger batches,
    each a larger program; what an eager evaluation wants, where the time is the number of
    operations, not their size)."""
    keyed: dict[tuple, list[Group]] = {}
    for g in groups:
        row = g.rows[0]
        disaggregated = g.design.disaggregated
        key = (row.model, row.hardware, row.precision, row.kv, disaggregated,
               g.design.layout if disaggregated and not disaggregated_numbers else None)
        keyed.setdefault(key, []).append(g)
    out = []
    for members in keyed.values():
        first = members[0]
        rows = tuple(r for g in members for r in g.rows)
        layouts = None
        if not first.design.disaggregated or disaggregated_numbers:
            layouts = _stack([g.design.layout.numbers() for g in members],
                             [len(g.rows) for g in members])
        inputs = {k: jax.device_put(v) for k, v in row_inputs(rows).items()}
        out.append(Batch(model=first.model, chip=first.chip, design=first.design,
                         layouts=layouts, inputs=inputs, family=first.family,
                         indices=tuple(r.index for r in rows),
                         frameworks=tuple(r.framework for r in rows)))
    return out
