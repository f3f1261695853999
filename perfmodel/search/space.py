"""The search space: targets, the discrete design grid, its numeric option tables, and the
two ways of naming a point of it (a `GridIndex` of option numbers, a `Choice` of
probabilities that a relaxed search can mix).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..architecture import Model
from ..design import PLACEMENTS, STATE_CLASSES, Disaggregated, attention_class
from ..formats import COMPUTE_CLASSES, FORMAT_BYTES, compute_class, resolve_format
from ..hardware import Chip
from ..workload import Workload

#: Objectives: name -> (description, True when larger is better).
OBJECTIVES = {
    "tok_s_per_kw": ("total tokens/s per kW of provisioned chip power (TDP, or the power "
                     "cap when one is set)", True),
    "tok_s_per_kw_modeled": ("total tokens/s per kW of modeled chip power", True),
    "tok_s_per_mw_allin": ("total tokens/s per MW of all-in power", True),
    "tok_s_per_chip": ("total tokens/s per chip", True),
    "usd_per_mtok": ("dollars per million total tokens (chip-hours plus energy)", False),
}

#: Constraints, each a dimensionless ratio g <= 0; `memory` is always on.
CONSTRAINTS = ("tpot", "ttft", "e2e", "power", "memory", "quality")
#: Per constraint: the unit its limit is reported in and the factor from SI to that unit.
UNITS = {"tpot": ("ms", 1e3), "ttft": ("ms", 1e3), "e2e": ("s", 1.0), "power": ("W", 1.0),
         "memory": ("", 1.0), "quality": ("", 1.0)}

#: Tensor classes whose number format is chosen.
TENSOR_CLASSES = ("weights", "experts", "kv")

#: Prior quality cost per format (dimensionless accuracy loss, e.g. 0.01 = one point of a
#: benchmark score), by tensor class. Illustrative priors, not measurements: published FP8
#: and FP4 checkpoints report losses of this order (FP8 well under a point, FP4 about a point
#: on reasoning benchmarks); pass your own with `quality=` when you have evals.
DEFAULT_QUALITY = {
    "weights": {"fp32": 0.0, "bf16": 0.0, "fp16": 0.0, "fp8": 0.002, "int8": 0.002,
                "mxfp4": 0.01, "nvfp4": 0.008, "int4": 0.01},
    "experts": {"fp32": 0.0, "bf16": 0.0, "fp16": 0.0, "fp8": 0.001, "int8": 0.001,
                "mxfp4": 0.006, "nvfp4": 0.005, "int4": 0.006},
    "kv": {"fp32": 0.0, "bf16": 0.0, "fp16": 0.0, "fp8": 0.001, "int8": 0.002,
           "mxfp4": 0.02, "nvfp4": 0.02, "int4": 0.02},
}

#: Chip families whose slice mapping is software's choice; elsewhere the hardware interleaves.
SOFTWARE_MAPPED_FAMILIES = ("jalapeno",)


def _array(x):
    return jnp.asarray(x, dtype=float)


class Targets(eqx.Module):
    """Limits and prices (array leaves: changing them never recompiles); `inf` = no limit.

    Build with `targets(...)` from user units.
    """

    max_tpot: jnp.ndarray = eqx.field(converter=_array, default=jnp.inf)
    """Median time per output token (s)."""
    max_ttft: jnp.ndarray = eqx.field(converter=_array, default=jnp.inf)
    """Median time to first token (s)."""
    max_e2e: jnp.ndarray = eqx.field(converter=_array, default=jnp.inf)
    """Median end-to-end latency (s)."""
    max_power: jnp.ndarray = eqx.field(converter=_array, default=jnp.inf)
    """Modeled average power per chip (W)."""
    max_quality_loss: jnp.ndarray = eqx.field(converter=_array, default=jnp.inf)
    """Sum over tensor classes of the chosen formats' quality costs (dimensionless)."""
    usd_per_chip_hour: jnp.ndarray = eqx.field(converter=_array, default=0.0)
    """Chip rental or amortized cost ($/h), for `usd_per_mtok`."""
    usd_per_kwh: jnp.ndarray = eqx.field(converter=_array, default=0.0)
    """Electricity price applied to modeled chip power ($/kWh), for `usd_per_mtok`."""

    def limits(self):
        """Limits in `CONSTRAINTS` order (memory's is 1: its g is an excess already)."""
        return jnp.stack([jnp.asarray(x, dtype=float) for x in (
            self.max_tpot, self.max_ttft, self.max_e2e, self.max_power, 1.0,
            self.max_quality_loss)])


def targets(*, max_tpot_ms=None, min_interactivity=None, max_ttft_ms=None, max_e2e_s=None,
            max_power_w=None, max_deployment_power_kw=None, chips: int = 1,
            max_quality_loss=None, usd_per_chip_hour=None, usd_per_kwh=None) -> Targets:
    """`Targets` from user units.

    Args:
        max_tpot_ms: median TPOT limit (ms).
        min_interactivity: tokens/s/user floor (= 1000 / max_tpot_ms); the tighter one wins.
        max_ttft_ms: median TTFT limit (ms).
        max_e2e_s: median end-to-end latency limit (s).
        max_power_w: modeled power limit per chip (W).
        max_deployment_power_kw: power limit of the whole deployment (kW), spread over `chips`.
        chips: chips of the deployment.
        max_quality_loss: budget for the summed per-format quality costs (dimensionless, > 0;
            to forbid a format, leave it out of the allowed formats instead).
        usd_per_chip_hour, usd_per_kwh: prices for the `usd_per_mtok` objective.

    Raises:
        ValueError: a non-positive limit, naming it.

    Example:
        >>> t = targets(max_tpot_ms=10, max_power_w=550)
        >>> float(t.max_tpot), float(t.max_power)
        (0.01, 550.0)
    """
    given = dict(max_tpot_ms=max_tpot_ms, min_interactivity=min_interactivity,
                 max_ttft_ms=max_ttft_ms, max_e2e_s=max_e2e_s, max_power_w=max_power_w,
                 max_deployment_power_kw=max_deployment_power_kw,
                 max_quality_loss=max_quality_loss)
    # A limit is a finite number: an infinite one is no limit, and NaN compares false.
    for key, value in given.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"targets: {key} must be a finite number > 0, got {value!r} "
                             "(leave it out for no limit)")
    for key, value in (("usd_per_chip_hour", usd_per_chip_hour), ("usd_per_kwh", usd_per_kwh)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"targets: {key} must be a finite number >= 0, got {value!r}")
    tpot = math.inf if max_tpot_ms is None else max_tpot_ms / 1e3
    if min_interactivity is not None:
        tpot = min(tpot, 1.0 / min_interactivity)
    power = math.inf if max_power_w is None else float(max_power_w)
    if max_deployment_power_kw is not None:
        power = min(power, max_deployment_power_kw * 1e3 / chips)
    return Targets(max_tpot=tpot,
                   max_ttft=math.inf if max_ttft_ms is None else max_ttft_ms / 1e3,
                   max_e2e=math.inf if max_e2e_s is None else float(max_e2e_s),
                   max_power=power,
                   max_quality_loss=math.inf if max_quality_loss is None else max_quality_loss,
                   usd_per_chip_hour=usd_per_chip_hour or 0.0, usd_per_kwh=usd_per_kwh or 0.0)


class GridIndex(eqx.Module):
    """A point of the grid: the option number along each coordinate (integer leaves of any
    common batch shape; `Space.sizes` holds the option counts in the same form).

    Example:
        >>> sizes = GridIndex(3, 2, 1, 2, 1, 1, 1, 1, 2)
        >>> index = GridIndex.unravel(jnp.arange(24), sizes)
        >>> int(index.concurrency[-1]), int(index.weights[5]), int(index.power_cap[5])
        (2, 1, 1)
    """

    concurrency: jnp.ndarray
    weights: jnp.ndarray
    experts: jnp.ndarray
    kv: jnp.ndarray
    attention_placement: jnp.ndarray
    dense_placement: jnp.ndarray
    expert_placement: jnp.ndarray
    kv_placement: jnp.ndarray
    power_cap: jnp.ndarray

    @classmethod
    def unravel(cls, flat, sizes: GridIndex) -> GridIndex:
        """The grid points numbered `flat` in row-major order (concurrency slowest, as
        `numpy.unravel_index` over the sizes in field order)."""
        counts = jax.tree_util.tree_leaves(sizes)
        digits = []
        for n in reversed(counts):
            digits.append(flat % n)
            flat = flat // n
        return cls(*reversed(digits))

    def choice(self, tables: Tables) -> Choice:
        """The one-hot `Choice` of this point (traceable)."""
        def hot(i, table):
            return jax.nn.one_hot(i, table.shape[0], dtype=float)

        return Choice(concurrency=jnp.exp(tables.log_concurrency[self.concurrency]),
                      power_cap=tables.power_caps[self.power_cap],
                      weights=hot(self.weights, tables.weight_bytes),
                      experts=hot(self.experts, tables.expert_bytes),
                      kv=hot(self.kv, tables.kv_bytes),
                      attention_placement=hot(self.attention_placement,
                                              tables.attention_placement),
                      dense_placement=hot(self.dense_placement, tables.dense_placement),
                      expert_placement=hot(self.expert_placement, tables.expert_placement),
                      kv_placement=hot(self.kv_placement, tables.kv_placement))

    def describe(self, space: Space, chip: Chip, layout) -> dict:
        """The point as names and user units (host; one point, no batch axis)."""
        i = {k: int(v) for k, v in zip(_INDEX_FIELDS, jax.tree_util.tree_leaves(self),
                                       strict=True)}
        placements = space.placements
        names = {"attention": "attention_placement", "dense": "dense_placement",
                 "experts": "expert_placement", "kv": "kv_placement"}
        kv = space.kv[i["kv"]]
        attention = space.attention[i["kv"]]   # `design.attention_class`, as `tables`
        return {"layout": layout.describe(), "chips": layout.chips,
                "concurrency": int(space.concurrency[i["concurrency"]]),
                "formats": {"weights": space.weights[i["weights"]],
                            "experts": space.experts[i["experts"]], "kv": kv,
                            "attention": attention},
                "placements": {cls: placements[cls][i[names[cls]]] for cls in STATE_CLASSES},
                "power_cap_w": float(space.power_caps[i["power_cap"]] * chip.tdp)}


_INDEX_FIELDS = ("concurrency", "weights", "experts", "kv", "attention_placement",
                 "dense_placement", "expert_placement", "kv_placement", "power_cap")


class Choice(eqx.Module):
    """One point of the design, relaxed or hard: concurrency, power cap and probability
    vectors over each coordinate's options (one-hot for a point of the grid)."""

    concurrency: jnp.ndarray
    """Requests in flight across the deployment."""
    power_cap: jnp.ndarray
    """Chip power cap as a fraction of its TDP."""
    weights: jnp.ndarray
    experts: jnp.ndarray
    kv: jnp.ndarray
    attention_placement: jnp.ndarray
    dense_placement: jnp.ndarray
    expert_placement: jnp.ndarray
    kv_placement: jnp.ndarray


class Space(eqx.Module):
    """The discrete design grid (static). Build with `design_space`.

    Coordinates (the fields of `GridIndex`): concurrency, weights format, experts format, KV
    format, the slice placements of attention weights, dense weights, expert weights and
    the KV cache, power cap; plus the layout.
    """

    layouts: tuple = eqx.field(static=True)
    concurrency: tuple[float, ...] = eqx.field(static=True)
    """Concurrency grid (requests in flight across the deployment), increasing."""
    weights: tuple[str, ...] = eqx.field(static=True)
    experts: tuple[str, ...] = eqx.field(static=True)
    kv: tuple[str, ...] = eqx.field(static=True)
    attention_placements: tuple[str, ...] = eqx.field(static=True)
    dense_placements: tuple[str, ...] = eqx.field(static=True)
    expert_placements: tuple[str, ...] = eqx.field(static=True)
    kv_placements: tuple[str, ...] = eqx.field(static=True)
    power_caps: tuple[float, ...] = eqx.field(static=True)
    """Power caps as fractions of TDP, increasing; (1.0,) = run at TDP."""
    quality: tuple[tuple[float, ...], ...] = eqx.field(static=True)
    """Quality cost of each option of weights, experts, kv (dimensionless)."""
    attention: tuple[str, ...] = eqx.field(static=True)
    """Compute class of attention math with each KV option (`design.attention_class`, the
    rule `design.precision` applies)."""

    @property
    def sizes(self) -> GridIndex:
        """The number of options along each coordinate (Python ints)."""
        return GridIndex(concurrency=len(self.concurrency), weights=len(self.weights),
                         experts=len(self.experts), kv=len(self.kv),
                         attention_placement=len(self.attention_placements),
                         dense_placement=len(self.dense_placements),
                         expert_placement=len(self.expert_placements),
                         kv_placement=len(self.kv_placements),
                         power_cap=len(self.power_caps))

    @property
    def placements(self) -> dict[str, tuple[str, ...]]:
        """Allowed placements per state class (`design.STATE_CLASSES`)."""
        return {"attention": self.attention_placements, "dense": self.dense_placements,
                "experts": self.expert_placements, "kv": self.kv_placements}

    @property
    def size(self) -> int:
        """Discrete designs in the grid (layouts included)."""
        return len(self.layouts) * math.prod(jax.tree_util.tree_leaves(self.sizes))


def candidate_layouts(model: Model, chip: Chip, chips: int, workload: Workload | None = None,
                      precision: str | None = None, disaggregated: bool = False) -> tuple:
    """Parallel layouts of one deployment of `chips` chips (static): `sweep.candidate_layouts`
    (layouts that hold the weights in `precision` and one sequence) and, with
    `disaggregated`, every prefill/decode split of the chips into two such pools.

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> [x.describe() for x in candidate_layouts(get_model("llama-3.1-8b"), get_chip("h200"),
        ...                                          2)]
        ['2xtp1', 'tp2']
    """
    from ..sweep import candidate_layouts as fitting  # same name here: import locally

    layouts = list(fitting(model, chip, chips, workload, precision))
    if disaggregated:
        for n_pre in range(1, chips):
            for pre in fitting(model, chip, n_pre, workload, precision):
                for dec in fitting(model, chip, chips - n_pre, workload, precision):
                    layouts.append(Disaggregated(prefill=pre, decode=dec))
    return tuple(layouts)


def _default_formats(chip: Chip, cls: str) -> tuple[str, ...]:
    names = ["bf16"]
    if "fp8" in chip.native_classes:
        names.append("fp8")
    if cls != "kv" and "fp4" in chip.native_classes:
        names.append(chip.fp4_flavor)
    return tuple(names)


def design_space(model: Model, chip: Chip, chips: int, *, workload: Workload | None = None,
                 layouts=None, concurrency=None, formats: dict | None = None,
                 placements: dict | None = None,
                 power_caps=(1.0,), quality: dict | None = None,
                 disaggregated: bool = False) -> Space:
    """The grid the optimizer searches (and `exhaustive` enumerates).

    Args:
        model, chip: decide the default formats (the chip's native ones) and placements.
        chips: chips of the deployment (every layout uses all of them).
        workload: sizes the KV cache when choosing the default layouts.
        layouts: explicit layouts; default `candidate_layouts` (those that hold the weights
            in the narrowest allowed format).
        concurrency: concurrency grid; default 1 .. 256 * chips in steps of 2^(1/4).
        formats: allowed formats per tensor class, e.g. ``{"weights": ("fp4", "fp8"),
            "kv": ("fp8",)}``; ``"experts"`` defaults to the ``"weights"`` choice. Defaults:
            the chip's native BF16/FP8/FP4 (KV: BF16/FP8). Dense models have no experts
            class (one placeholder option).
        placements: allowed slice placements per state class (``"attention"``,
            ``"dense"``, ``"experts"``, ``"kv"``; ``"weights"`` sets the three weight
            classes) among `design.PLACEMENTS`. Default: all three on chips of
            `SOFTWARE_MAPPED_FAMILIES` with more than one slice; elsewhere what the hardware
            does ("interleaved"). Dense models have no experts class (one option).
        power_caps: power caps as fractions of TDP in (0, 1].
        quality: per-class quality costs overriding `DEFAULT_QUALITY`, e.g.
            ``{"experts": {"mxfp4": 0.02}}``.
        disaggregated: add prefill/decode splits to the default layouts.

    Raises:
        ValueError: unknown formats or placements, empty option lists, a layout that does
            not use `chips` chips, caps outside (0, 1].

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> s = design_space(get_model("llama-3.1-8b"), get_chip("h200"), 1)
        >>> s.weights, s.placements["attention"]
        (('bf16', 'fp8'), ('interleaved',))
    """
    formats = dict(formats or {})
    unknown = set(formats) - set(TENSOR_CLASSES)
    if unknown:
        raise ValueError(f"design_space: unknown tensor classes {sorted(unknown)}; valid: "
                         f"{TENSOR_CLASSES}")
    if "experts" not in formats and "weights" in formats:
        formats["experts"] = formats["weights"]
    options = {}
    for cls in TENSOR_CLASSES:
        names = formats.get(cls) or _default_formats(chip, cls)
        if isinstance(names, str):
            names = names.split(",")
        options[cls] = tuple(dict.fromkeys(resolve_format(n, chip.fp4_flavor) for n in names))
    if layouts is None:
        narrowest = min(options["experts" if model.is_moe else "weights"],
                        key=lambda f: FORMAT_BYTES[f])
        layouts = candidate_layouts(model, chip, chips, workload, narrowest, disaggregated)
    layouts = tuple(layouts)
    if not layouts:
        raise ValueError(f"design_space: no layout of {chips} chips holds {model.name}")
    for layout in layouts:
        if layout.chips != chips:
            raise ValueError(f"design_space: layout {layout.describe()} uses {layout.chips} "
                             f"chips, the deployment has {chips}")
    if concurrency is None:
        top = 256.0 * chips
        grid = sorted({float(round(2.0 ** (k / 4.0))) for k in range(int(4 * math.log2(top)) + 1)})
    else:
        grid = sorted({float(c) for c in concurrency})
    if not grid or grid[0] < 1.0:
        raise ValueError("design_space: concurrency values must be >= 1")
    if not model.is_moe:
        options["experts"] = options["weights"][:1]
    software = chip.family in SOFTWARE_MAPPED_FAMILIES and float(chip.num_slices) > 1
    default_place = PLACEMENTS if software else ("interleaved",)
    placements = dict(placements or {})
    unknown = set(placements) - {"weights", *STATE_CLASSES}
    if unknown:
        raise ValueError(f"design_space: unknown placement classes {sorted(unknown)}; valid: "
                         f"weights, {', '.join(STATE_CLASSES)}")
    place = {}
    for cls in STATE_CLASSES:
        names = placements.get(cls) or (placements.get("weights") if cls != "kv" else None) \
            or default_place
        if isinstance(names, str):
            names = names.split(",")
        for name in names:
            if name not in PLACEMENTS:
                raise ValueError(f"design_space: placement {name!r} for {cls}; valid: "
                                 f"{PLACEMENTS}")
        place[cls] = tuple(dict.fromkeys(names))
    if not model.is_moe:
        place["experts"] = place["experts"][:1]
    caps = tuple(sorted({float(c) for c in power_caps}))
    if not caps or caps[0] <= 0 or caps[-1] > 1:
        raise ValueError("design_space: power_caps are fractions of TDP in (0, 1]")
    costs = {cls: dict(DEFAULT_QUALITY[cls]) for cls in TENSOR_CLASSES}
    for cls, table in (quality or {}).items():
        if cls not in costs:
            raise ValueError(f"design_space: quality class {cls!r}; valid: {TENSOR_CLASSES}")
        for name, value in table.items():
            costs[cls][resolve_format(name, chip.fp4_flavor)] = float(value)
    quality_table = tuple(tuple(costs[cls][n] for n in options[cls]) for cls in TENSOR_CLASSES)
    if not model.is_moe:
        quality_table = (quality_table[0], (0.0,), quality_table[2])
    return Space(layouts=layouts, concurrency=tuple(grid), weights=options["weights"],
                 experts=options["experts"], kv=options["kv"],
                 attention_placements=place["attention"], dense_placements=place["dense"],
                 expert_placements=place["experts"], kv_placements=place["kv"],
                 power_caps=caps, quality=quality_table,
                 attention=tuple(attention_class(chip, model, f) for f in options["kv"]))


class Tables(eqx.Module):
    """The numbers behind each coordinate's options on one chip (arrays, one row per
    option): what the model reads for a `Choice`. Build with `tables`."""

    log_concurrency: jnp.ndarray
    """log of the concurrency grid (requests)."""
    weight_bytes: jnp.ndarray
    """Bytes per non-expert weight of each weights format."""
    weight_compute: jnp.ndarray
    """Compute class (one-hot over `formats.COMPUTE_CLASSES`) of each weights format."""
    expert_bytes: jnp.ndarray
    expert_compute: jnp.ndarray
    kv_bytes: jnp.ndarray
    attention_compute: jnp.ndarray
    """Compute class of attention math for each KV format (`Space.attention`)."""
    quality_weights: jnp.ndarray
    """Quality cost of each weights format (dimensionless); likewise experts, kv."""
    quality_experts: jnp.ndarray
    quality_kv: jnp.ndarray
    attention_placement: jnp.ndarray
    """One-hot over `design.PLACEMENTS` of each allowed placement; likewise the others."""
    dense_placement: jnp.ndarray
    expert_placement: jnp.ndarray
    kv_placement: jnp.ndarray
    power_caps: jnp.ndarray
    """Power caps as fractions of TDP."""

    @property
    def sizes(self) -> GridIndex:
        """Options per coordinate (Python ints, from the shapes)."""
        return GridIndex(*(x.shape[0] for x in (
            self.log_concurrency, self.weight_bytes, self.expert_bytes, self.kv_bytes,
            self.attention_placement, self.dense_placement, self.expert_placement,
            self.kv_placement, self.power_caps)))


def tables(space: Space, chip: Chip) -> Tables:
    """The numeric `Tables` of `space` on `chip` (host arrays).

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> chip = get_chip("h200")
        >>> t = tables(design_space(get_model("llama-3.1-8b"), chip, 1), chip)
        >>> t.weight_bytes.tolist(), t.sizes.weights
        ([2.0, 1.0], 2)
    """
    native, flavor = chip.native_classes, chip.fp4_flavor

    def hot(index, n):
        return [1.0 if i == index else 0.0 for i in range(n)]

    def compute(name):
        return hot(COMPUTE_CLASSES.index(compute_class(name, native, flavor)),
                   len(COMPUTE_CLASSES))

    def placement(names):
        return [hot(PLACEMENTS.index(p), len(PLACEMENTS)) for p in names]

    def arr(x):
        return np.asarray(x, dtype=float)

    return Tables(
        log_concurrency=np.log(arr(space.concurrency)),
        weight_bytes=arr([FORMAT_BYTES[f] for f in space.weights]),
        weight_compute=arr([compute(f) for f in space.weights]),
        expert_bytes=arr([FORMAT_BYTES[f] for f in space.experts]),
        expert_compute=arr([compute(f) for f in space.experts]),
        kv_bytes=arr([FORMAT_BYTES[f] for f in space.kv]),
        attention_compute=arr([hot(COMPUTE_CLASSES.index(c), len(COMPUTE_CLASSES))
                               for c in space.attention]),
        quality_weights=arr(space.quality[0]), quality_experts=arr(space.quality[1]),
        quality_kv=arr(space.quality[2]),
        attention_placement=arr(placement(space.attention_placements)),
        dense_placement=arr(placement(space.dense_placements)),
        expert_placement=arr(placement(space.expert_placements)),
        kv_placement=arr(placement(space.kv_placements)),
        power_caps=arr(space.power_caps))
