"""A `SweepSpec` expanded into a grid: cells (model, chip, chip count, layout, precision),
each crossed with the workload axes (ISL x OSL x concurrency), and the chunks that cover it.

The grid is never materialised: a point is a flat index, and a chunk of indices is turned
into the cell and axis values it names by integer arithmetic (`Grid.points`), so a sweep of
10 million points holds one chunk at a time. Cells that cannot be evaluated (a format the
chip lacks, a layout of another chip count or one the model cannot split) keep their points,
marked infeasible with the reason.

Points are ordered model, chip, chip count, layout, precision, ISL, OSL, concurrency (the
last fastest). The cells of one (model, chip) pair form a *group*, which shares one
compiled kernel (`evaluate`): the layout, precision and workload are numbers in it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..architecture import Model
from ..design import Layout, Precision, Runtime, precision
from ..hardware import Chip
from ..presets import find_model, get_chip
from ..serving import check_layout
from ..sweep import default_precision, default_runtime, layout_shapes
from .spec import SweepSpec


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (model, chip, chip count, layout, precision) of the grid.

    Attributes:
        chips: chips of the deployment.
        layout: the layout's name (`Layout.describe`).
        degrees: (tp, ep, pp, replicas, dp_attention) of the layout; (1, 1, 1, 1, False)
            when it cannot be read.
        precision: the (weights, experts, kv) format names joined by "/", or the format
            the spec asked for when the chip cannot use it.
        precision_index: index into its group's `Group.precisions`.
        reason: why every point of the cell is infeasible ("" when it is not).
    """

    chips: int
    layout: str
    degrees: tuple
    precision: str
    precision_index: int
    reason: str = ""


@dataclasses.dataclass(frozen=True, eq=False)
class Group:
    """The cells of one model on one chip, and the precisions they index.

    Attributes:
        model, chip: resolved specs.
        runtime: the chip's serving runtime (`sweep.default_runtime` with the spec's
            `runtime` settings).
        precisions: the `Precision`s of the group's cells (at least one: a group whose
            formats all fail keeps the chip's default, so its kernel has one to run).
        cells: in grid order.
        start: flat index of the group's first point.
    """

    model: Model
    chip: Chip
    runtime: Runtime
    precisions: tuple[Precision, ...]
    cells: tuple[Cell, ...]
    start: int


def all_layouts(model: Model, chip: Chip, chips: int) -> tuple[Layout, ...]:
    """Every layout of exactly `chips` chips the model can split, fitting in memory or not:
    `tp` in powers of two up to the chip's scale-up domain (`sweep.candidate_layouts`'
    shapes: `ep` in {1, tp} where it divides the experts, DP attention on and off for MoE
    models), each `pp` in powers of two up to the layer count with `tp pp` dividing `chips`,
    and the rest of the chips replicas.

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> [l.describe() for l in all_layouts(get_model("llama-3.1-70b"), get_chip("h100"), 4)]
        ['4xtp1', '2xtp1-pp2', 'tp1-pp4', '2xtp2', 'tp2-pp2', 'tp4']
    """
    out = []
    for tp, ep, dpa in layout_shapes(model, chip):
        pp = 1
        while tp * pp <= chips and pp <= model.num_layers:
            if chips % (tp * pp) == 0:
                out.append(Layout(tp=tp, ep=ep, pp=pp, dp_attention=dpa,
                                  replicas=chips // (tp * pp)))
            pp *= 2
    return tuple(out)


def _layout_reason(model: Model, layout: Layout, chips: int) -> str:
    if layout.chips != chips:
        return f"layout {layout.describe()} uses {layout.chips} chips; the cell has {chips}"
    try:
        check_layout(model, layout)
    except ValueError as error:
        return str(error).removeprefix(f"design.layout {layout.describe()}: ")
    return ""


def _precision(chip: Chip, model: Model, fmt: str, emulate: bool):
    """(Precision or None, name, reason)."""
    fmt = default_precision(chip, model) if fmt == "default" else fmt
    try:
        prec = precision(chip, model, fmt, emulate=emulate)
    except ValueError as error:
        text = str(error).removeprefix("precision: ")
        if "natively" in text:
            text = (f"{chip.name} does not compute {fmt} natively (set emulate = true for "
                    "weight-only quantization)")
        return None, fmt, text
    return prec, "/".join(prec.names), ""


def _group(model: Model, chip: Chip, spec: SweepSpec, start: int) -> Group:
    formats = ("default",) if spec.precision == "default" else spec.precision
    found = [_precision(chip, model, f, spec.emulate) for f in formats]
    precisions, index = [], []
    for prec, _, _ in found:
        if prec is not None:
            index.append(len(precisions))
            precisions.append(dataclasses.replace(prec, names=()))
        else:
            index.append(0)
    if not precisions:
        default = _precision(chip, model, "default", spec.emulate)[0]
        precisions.append(dataclasses.replace(default, names=()))
    cells = []
    for chips in spec.chip_counts:
        layouts = (all_layouts(model, chip, chips) if spec.layouts == "all"
                   else tuple(Layout.parse(name) for name in spec.layouts))
        for layout in layouts:
            layout_reason = _layout_reason(model, layout, chips)
            degrees = ((1, 1, 1, 1, False) if layout_reason else
                       (layout.tp, layout.ep, layout.pp, layout.replicas, layout.dp_attention))
            for (_, name, prec_reason), i in zip(found, index, strict=True):
                cells.append(Cell(chips=chips, layout=layout.describe(), degrees=degrees,
                                  precision=name, precision_index=i,
                                  reason=prec_reason or layout_reason))
    try:
        runtime = dataclasses.replace(default_runtime(chip), **dict(spec.runtime))
    except ValueError as error:
        raise ValueError(f"sweep.runtime: {error}") from None
    return Group(model=model, chip=chip, runtime=runtime, precisions=tuple(precisions),
                 cells=tuple(cells), start=start)


@dataclasses.dataclass(frozen=True, eq=False)
class Grid:
    """A spec's groups and workload axes.

    Attributes:
        spec: what was expanded.
        groups: (model, chip) groups in grid order.
        isl, osl, concurrency: the workload axes (float arrays).
    """

    spec: SweepSpec
    groups: tuple[Group, ...]
    isl: np.ndarray
    osl: np.ndarray
    concurrency: np.ndarray

    @property
    def per_cell(self) -> int:
        """Points of one cell: ISL x OSL x concurrency values."""
        return self.isl.size * self.osl.size * self.concurrency.size

    @property
    def size(self) -> int:
        """Points of the grid."""
        return sum(len(g.cells) for g in self.groups) * self.per_cell

    def group_size(self, group: Group) -> int:
        return len(group.cells) * self.per_cell

    def points(self, group: Group, start: int, stop: int) -> dict:
        """The points with flat indices [start, stop) of `group` (group-relative) as arrays:
        `cell` (index into `group.cells`), `isl`, `osl`, `concurrency`."""
        flat = np.arange(start, stop, dtype=np.int64)
        cell, rest = np.divmod(flat, self.per_cell)
        i_isl, rest = np.divmod(rest, self.osl.size * self.concurrency.size)
        i_osl, i_conc = np.divmod(rest, self.concurrency.size)
        return {"cell": cell, "isl": self.isl[i_isl], "osl": self.osl[i_osl],
                "concurrency": self.concurrency[i_conc]}


def expand(spec: SweepSpec) -> Grid:
    """The `Grid` of a spec, every model and chip name resolved.

    Raises:
        ValueError: an unknown model or chip (the message of `presets.find_model` /
            `presets.get_chip`, listing the valid names); a spec whose grid is empty.

    Example:
        >>> from perfmodel.grid.spec import from_dict
        >>> spec = from_dict({"sweep": {"models": "llama-3.1-8b", "chips": "h100",
        ...     "chip_counts": [1, 2], "isl": 1024, "osl": 1024, "concurrency": [1, 8]}})
        >>> grid = expand(spec)
        >>> len(grid.groups), grid.size
        (1, 8)
    """
    models = [find_model(name) for name in spec.models]
    chips = [get_chip(name) for name in spec.chips]
    groups, start = [], 0
    for model in models:
        for chip in chips:
            group = _group(model, chip, spec, start)
            groups.append(group)
            start += len(group.cells) * len(spec.isl) * len(spec.osl) * len(spec.concurrency)
    grid = Grid(spec=spec, groups=tuple(groups), isl=np.asarray(spec.isl, dtype=float),
                osl=np.asarray(spec.osl, dtype=float),
                concurrency=np.asarray(spec.concurrency, dtype=float))
    if grid.size == 0:
        raise ValueError("the sweep spec's grid is empty: no layout of the chip counts "
                         f"{list(spec.chip_counts)} for any model and chip")
    return grid


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Points [start, stop) of group `group` (indices relative to the group)."""

    index: int
    group: int
    start: int
    stop: int


def chunks(grid: Grid, size: int) -> tuple[Chunk, ...]:
    """Chunks of at most `size` points, never across groups, numbered in grid order."""
    out = []
    for g, group in enumerate(grid.groups):
        total = grid.group_size(group)
        for start in range(0, total, size):
            out.append(Chunk(len(out), g, start, min(start + size, total)))
    return tuple(out)
