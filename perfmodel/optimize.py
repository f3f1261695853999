"""Design optimization by gradient descent: the most tokens per watt (or per chip, or per
dollar) under latency, power, memory and accuracy constraints.

The discrete design (concurrency, number format per tensor class, slice placement per state
class, power cap, parallel layout) is relaxed for gradients:

- concurrency and the power cap are continuous, in log space / through a sigmoid, and are
  rounded to the grid at the end;
- number formats and slice placements are softmaxes over the allowed options with a traced
  temperature; the model consumes them directly (`Precision` bytes and compute-class
  vectors, `SliceMapping` probabilities are numbers, so a mixture is a valid input);
- parallel layouts are not relaxed: each layout is a *branch* with its own continuous
  variables, all branches are optimized together, and the relaxed layout choice is a
  softmax over the branches' losses with a traced temperature (`layout_weights`), which
  hardening turns into an argmax. A branch runs in a kernel compiled for its static
  layout, or, when a grid has more aggregated layouts than cores, with other layouts in
  one vmapped kernel per core (the layouts as numbers, `Layout.numbers()`). With more
  layouts than `keep_layouts`, every branch runs its first `screen_steps` Adam steps
  (all of them in one vmapped kernel), is screened there (exactly, along the
  concurrency line through its rounded design, and by its relaxed loss), and only the
  best continue, in static kernels, from where they stopped and on the path they would
  have taken unscreened: successive halving, as in Hyperband (Li et al., JMLR 18, 2018),
  with one rung.

Constraints enter through an augmented Lagrangian (Rockafellar 1973; Nocedal & Wright,
"Numerical Optimization", 2nd ed., eq. 17.65 for inequalities), each written as a
dimensionless ratio g = value / limit - 1 <= 0:

    L(x; lam, mu) = -log objective(x) + sum_i [max(0, lam_i + mu g_i(x))^2 - lam_i^2] / (2 mu),
    lam_i <- max(0, lam_i + mu g_i(x))   after each inner block of Adam steps.

At a solution lam_i is the shadow price d log(objective) / d g_i: relaxing limit_i by one unit
buys about objective * lam_i / limit_i. Hardening rounds and argmaxes every branch, re-evaluates
it exactly (`hard=True`), repairs and polishes it by local search over grid neighbours, and
keeps the best feasible design; relaxed and hardened metrics are reported side by side. The
reported shadow prices are those of the hardened design itself: its KKT multipliers along the
continuous coordinates (concurrency, power cap), from the exact model's derivatives there
(`_shadow_prices`), so they do not depend on how far the Adam phase converged.
Each branch's Adam phase and hardening run in one compiled kernel (`_solve_impl`), with
reverse-mode gradients; branches compile and run in parallel threads. `exhaustive`
enumerates the same grid for comparison.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
import sys
import threading
import time
from typing import NamedTuple

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax

from .architecture import Model
from .design import (
    PLACEMENTS,
    STATE_CLASSES,
    Design,
    Disaggregated,
    Layout,
    Precision,
    Runtime,
    SliceMapping,
)
from .formats import COMPUTE_CLASSES, FORMAT_BYTES, compute_class, resolve_format
from .hardware import Chip
from .serving import Metrics, predict
from .smooth import DEFAULT_SHARPNESS
from .workload import Workload

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
_UNITS = {"tpot": ("ms", 1e3), "ttft": ("ms", 1e3), "e2e": ("s", 1.0), "power": ("W", 1.0),
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

_FEASIBLE_TOL = 1e-9
#: Grid coordinates (`Space.shape`): concurrency, 3 formats, 4 placements, power cap.
_NDIM = 9
_CAP = 8
_CHUNK = 4096   # designs per exhaustive kernel call: 2.5x faster than 1024 on CPU


# ----------------------------------------------------------------------------------------
# Specs: targets (traced) and the design space (static)
# ----------------------------------------------------------------------------------------

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
    for key, value in given.items():
        if value is not None and not value > 0:
            raise ValueError(f"targets: {key} must be > 0, got {value!r}")
    for key, value in (("usd_per_chip_hour", usd_per_chip_hour), ("usd_per_kwh", usd_per_kwh)):
        if value is not None and value < 0:
            raise ValueError(f"targets: {key} must be >= 0, got {value!r}")
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


class Space(eqx.Module):
    """The discrete design grid (static). Build with `design_space`.

    Coordinates, in this order: concurrency, weights format, experts format, KV format, the
    slice placements of attention weights, dense weights, expert weights and the KV cache,
    power cap; plus the layout (one branch each).
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

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.concurrency), len(self.weights), len(self.experts), len(self.kv),
                len(self.attention_placements), len(self.dense_placements),
                len(self.expert_placements), len(self.kv_placements), len(self.power_caps))

    @property
    def placements(self) -> dict[str, tuple[str, ...]]:
        """Allowed placements per state class (`design.STATE_CLASSES`)."""
        return {"attention": self.attention_placements, "dense": self.dense_placements,
                "experts": self.expert_placements, "kv": self.kv_placements}

    @property
    def size(self) -> int:
        """Discrete designs in the grid (layouts included)."""
        return len(self.layouts) * math.prod(self.shape)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
    from .sweep import candidate_layouts as fitting  # same name here: import locally

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
                 power_caps=caps, quality=quality_table)


# ----------------------------------------------------------------------------------------
# Numeric option tables and the evaluation shared by the relaxed and the hard model
# ----------------------------------------------------------------------------------------

class _Tables(eqx.Module):
    log_concurrency: jnp.ndarray
    weight_bytes: jnp.ndarray
    weight_compute: jnp.ndarray
    expert_bytes: jnp.ndarray
    expert_compute: jnp.ndarray
    kv_bytes: jnp.ndarray
    attention_compute: jnp.ndarray
    quality_weights: jnp.ndarray
    quality_experts: jnp.ndarray
    quality_kv: jnp.ndarray
    attention_placement: jnp.ndarray
    dense_placement: jnp.ndarray
    expert_placement: jnp.ndarray
    kv_placement: jnp.ndarray
    caps: jnp.ndarray


def _one_hot(index: int, n: int) -> list[float]:
    return [1.0 if i == index else 0.0 for i in range(n)]


def _tables(space: Space, chip: Chip) -> _Tables:
    """The numeric tables of `space` on `chip` (cached: the optimizer builds them on every
    call, and its whole search takes about a millisecond)."""
    return _cached_tables(space, chip.native_classes, chip.fp4_flavor, float(chip.tdp))


@functools.lru_cache(maxsize=64)
def _cached_tables(space: Space, native, flavor, tdp: float) -> _Tables:
    n = len(COMPUTE_CLASSES)

    def compute(name):
        return _one_hot(COMPUTE_CLASSES.index(compute_class(name, native, flavor)), n)

    def attention(name):
        cls = "fp8" if (name == "fp8" and "fp8" in native) else "bf16"
        return _one_hot(COMPUTE_CLASSES.index(cls), n)

    def placement(names):
        return [_one_hot(PLACEMENTS.index(p), len(PLACEMENTS)) for p in names]

    def arr(x):
        # numpy leaves: cheap to build, and jit takes them as inputs like device arrays.
        return np.asarray(x, dtype=float)

    return _Tables(
        log_concurrency=np.log(arr(space.concurrency)),
        weight_bytes=arr([FORMAT_BYTES[f] for f in space.weights]),
        weight_compute=arr([compute(f) for f in space.weights]),
        expert_bytes=arr([FORMAT_BYTES[f] for f in space.experts]),
        expert_compute=arr([compute(f) for f in space.experts]),
        kv_bytes=arr([FORMAT_BYTES[f] for f in space.kv]),
        attention_compute=arr([attention(f) for f in space.kv]),
        quality_weights=arr(space.quality[0]),
        quality_experts=arr(space.quality[1]),
        quality_kv=arr(space.quality[2]),
        attention_placement=arr(placement(space.attention_placements)),
        dense_placement=arr(placement(space.dense_placements)),
        expert_placement=arr(placement(space.expert_placements)),
        kv_placement=arr(placement(space.kv_placements)),
        caps=arr(space.power_caps) * tdp)


class Choice(eqx.Module):
    """One point of the design, relaxed or hard: concurrency, power cap and probability
    vectors over each coordinate's options (one-hot for a real design)."""

    concurrency: jnp.ndarray
    """Requests in flight across the deployment."""
    power_cap: jnp.ndarray
    """Chip power cap (W)."""
    weights: jnp.ndarray
    experts: jnp.ndarray
    kv: jnp.ndarray
    attention_placement: jnp.ndarray
    dense_placement: jnp.ndarray
    expert_placement: jnp.ndarray
    kv_placement: jnp.ndarray


def _runtime(chip: Chip) -> Runtime:
    # `sweep.default_runtime` (activation reserve capped at 10% of HBM), traced.
    return Runtime(activation_reserve=jnp.minimum(4e9, 0.1 * chip.hbm_capacity))


def _materialize(chip: Chip, layout, tables: _Tables, choice: Choice, vectorize=False):
    def mix(probabilities, table):
        """`probabilities @ table`; vectorized, as a multiply and a sum, which XLA:CPU
        fuses with their neighbours (a tiny `dot` is a library call of its own)."""
        if not vectorize:
            return probabilities @ table
        p = probabilities if table.ndim == 1 else probabilities[..., None]
        return jnp.sum(p * table, axis=-table.ndim)

    prec = Precision(
        weight_bytes=mix(choice.weights, tables.weight_bytes),
        expert_bytes=mix(choice.experts, tables.expert_bytes),
        kv_bytes=mix(choice.kv, tables.kv_bytes), activation_bytes=FORMAT_BYTES["bf16"],
        weight_compute=mix(choice.weights, tables.weight_compute),
        expert_compute=mix(choice.experts, tables.expert_compute),
        attention_compute=mix(choice.kv, tables.attention_compute))
    mapping = SliceMapping(attention=mix(choice.attention_placement, tables.attention_placement),
                           dense=mix(choice.dense_placement, tables.dense_placement),
                           experts=mix(choice.expert_placement, tables.expert_placement),
                           kv=mix(choice.kv_placement, tables.kv_placement))
    design = Design(concurrency=choice.concurrency, layout=layout, precision=prec,
                    mapping=mapping, runtime=_runtime(chip))
    capped = eqx.tree_at(lambda c: c.tdp, chip, choice.power_cap)
    quality = (mix(choice.weights, tables.quality_weights)
               + mix(choice.experts, tables.quality_experts) + mix(choice.kv, tables.quality_kv))
    return capped, design, quality


def _objective_value(objective: str, metrics: Metrics, tgt: Targets):
    if objective == "tok_s_per_kw":
        return metrics.tok_s_per_kw_tdp
    if objective == "tok_s_per_kw_modeled":
        return metrics.throughput_per_chip / (metrics.power_per_chip / 1e3)
    if objective == "tok_s_per_mw_allin":
        return metrics.tok_s_per_mw_allin
    if objective == "tok_s_per_chip":
        return metrics.throughput_per_chip
    hourly = tgt.usd_per_chip_hour + metrics.power_per_chip / 1e3 * tgt.usd_per_kwh
    return hourly / 3600.0 / metrics.throughput_per_chip * 1e6


def evaluate(model: Model, chip: Chip, workload: Workload, layout, tables: _Tables,
             choice: Choice, tgt: Targets, objective: str, sharpness=DEFAULT_SHARPNESS,
             hard: bool = False, vectorize: bool = False):
    """Objective, constraint vector and metrics of one (relaxed or hard) design point.

    `vectorize` (static) selects `predict`'s evaluation order: True for single designs
    (the gradient steps), False under a wide vmap (enumeration); the numbers agree.

    Returns:
        (score, g, metrics, value): `score` is log(objective) for objectives to maximize and
        -log(objective) for costs (larger is better either way); `g` has one dimensionless
        entry per `CONSTRAINTS` (<= 0 is feasible); `value` the objective in its units.
    """
    capped, design, quality = _materialize(chip, layout, tables, choice, vectorize)
    metrics = predict(model, capped, workload, design, sharpness=sharpness, hard=hard,
                      check=False, vectorize=vectorize)
    value = _objective_value(objective, metrics, tgt)
    sign = 1.0 if OBJECTIVES[objective][1] else -1.0
    score = sign * jnp.log(jnp.maximum(value, 1e-300))
    measured = jnp.stack([metrics.tpot, metrics.ttft, metrics.e2e, metrics.power_per_chip,
                          metrics.memory_excess + 1.0, quality])
    g = measured / tgt.limits() - 1.0
    return score, g, metrics, value


# ----------------------------------------------------------------------------------------
# Relaxed parameters
# ----------------------------------------------------------------------------------------

class Relaxed(eqx.Module):
    """Unconstrained parameters of one branch (one layout): what Adam updates.

    concurrency = exp(lo + (hi - lo) sigmoid(concurrency_logit)) over the grid's range,
    power cap = cap_lo + (cap_hi - cap_lo) sigmoid(cap_logit), and logits of softmaxes over
    each coordinate's options (divided by a traced temperature).
    """

    concurrency_logit: jnp.ndarray
    cap_logit: jnp.ndarray
    weights: jnp.ndarray
    experts: jnp.ndarray
    kv: jnp.ndarray
    attention_placement: jnp.ndarray
    dense_placement: jnp.ndarray
    expert_placement: jnp.ndarray
    kv_placement: jnp.ndarray

    def choice(self, tables: _Tables, temperature) -> Choice:
        lo, hi = tables.log_concurrency[0], tables.log_concurrency[-1]
        c = jnp.exp(lo + (hi - lo) * jax.nn.sigmoid(self.concurrency_logit))
        cap_lo, cap_hi = tables.caps[0], tables.caps[-1]
        cap = cap_lo + (cap_hi - cap_lo) * jax.nn.sigmoid(self.cap_logit)

        # The seven softmaxes as one, over rows padded to the widest and masked: XLA:CPU
        # runs each softmax as its own handful of small kernels, and a step pays per
        # kernel at this size (56 of the 326 of an Adam step were these).
        logits = (self.weights, self.experts, self.kv, self.attention_placement,
                  self.dense_placement, self.expert_placement, self.kv_placement)
        sizes = [x.shape[-1] for x in logits]
        width = max(sizes)
        rows = jnp.stack([jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
                          for x, n in zip(logits, sizes, strict=True)], axis=-2)
        mask = np.arange(width)[None, :] < np.asarray(sizes)[:, None]
        p = jax.nn.softmax(rows / temperature, axis=-1, where=mask)
        weights, experts, kv, attention, dense, expert_pl, kv_pl = (
            p[..., i, :n] for i, n in enumerate(sizes))
        return Choice(concurrency=c, power_cap=cap, weights=weights, experts=experts, kv=kv,
                      attention_placement=attention, dense_placement=dense,
                      expert_placement=expert_pl, kv_placement=kv_pl)


def _initial(space: Space, start: float) -> Relaxed:
    logit = math.log(start / (1.0 - start))
    # Explicit dtypes (numpy float64 leaves): weakly typed leaves would retrace the kernel.
    def zeros(n):
        return np.zeros(n, dtype=float)

    return Relaxed(concurrency_logit=np.asarray(logit, dtype=float),
                   cap_logit=np.asarray(2.0, dtype=float), weights=zeros(len(space.weights)),
                   experts=zeros(len(space.experts)), kv=zeros(len(space.kv)),
                   attention_placement=zeros(len(space.attention_placements)),
                   dense_placement=zeros(len(space.dense_placements)),
                   expert_placement=zeros(len(space.expert_placements)),
                   kv_placement=zeros(len(space.kv_placements)))


@functools.lru_cache(maxsize=64)
def _initial_stack(space: Space, starts: tuple[float, ...]) -> Relaxed:
    """`_initial` of every start, stacked along a leading axis (cached; read-only)."""
    return jax.tree_util.tree_map(lambda *xs: np.stack(xs),
                                  *[_initial(space, s) for s in starts])


@functools.lru_cache(maxsize=64)
def _schedule(blocks: int, inner: int, t_start: float, t_end: float, n_starts: int, mu: float,
              sharpness: float, max_iterations: int):
    """The annealed temperatures (host copy, and on the device as (blocks, inner)), initial
    multipliers and penalty weights of every start, and the kernel's scalar settings."""
    schedule = t_start * (t_end / t_start) ** (np.arange(inner * blocks) / max(
        inner * blocks - 1, 1))
    lam, mus = np.zeros((n_starts, len(CONSTRAINTS))), np.full((n_starts,), mu)
    return (schedule, schedule.reshape(blocks, inner), lam, mus,
            np.asarray(sharpness, dtype=float), np.asarray(max_iterations))


class _Inputs(NamedTuple):
    """What a search kernel reads: the stacked starts, their multipliers and penalty
    weights, the annealed temperatures (blocks, inner), the specs, the grid's tables, the
    targets, the smooth-max p, the local search's neighbourhood (`_moves`) and its cap on
    moves; in the order of `_solve_impl`'s arguments (the first nine are `_screen_impl`'s
    and `_head_impl`'s)."""

    params: Relaxed
    lam: jnp.ndarray
    mu: jnp.ndarray
    temperatures: jnp.ndarray
    chip: Chip
    workload: Workload
    tables: _Tables
    tgt: Targets
    sharpness: jnp.ndarray
    moves: tuple
    max_iterations: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static structure of a packed `_Inputs` vector (`_packed`): the pytree and each
    leaf's shape and dtype (a kernel's static argument; `_jit` hashes it once per object,
    as it does the `Model`)."""

    treedef: object
    leaves: tuple


def _flatten(tree) -> tuple[np.ndarray, _Spec]:
    """`tree` (`_Inputs`, or the exact evaluation's specs and tables) as one float vector
    (host) and its `_Spec`; integers and booleans are small and exact in float."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(x) for x in leaves]
    spec = _Spec(treedef, tuple((x.shape, jax.dtypes.canonicalize_dtype(x.dtype))
                                for x in arrays))
    return np.concatenate([x.ravel().astype(float) for x in arrays]), spec


def _unflatten(flat, spec: _Spec):
    """The pytree packed by `_flatten` into `flat` (traced)."""
    leaves, start = [], 0
    for shape, dtype in spec.leaves:
        size = math.prod(shape)
        leaves.append(flat[start:start + size].reshape(shape).astype(dtype))
        start += size
    return jax.tree_util.tree_unflatten(spec.treedef, leaves)


_PACKED: dict = {}


def _packed(space: Space, chip: Chip, workload: Workload, tgt: Targets,
            starts: tuple[float, ...], schedule: tuple):
    """(host tables, host schedule, stacked starts, and the search kernels' `_Inputs` as one
    vector on the device with its `_Spec`), memoized on the identity of the specs and the
    values of the settings (`schedule`: `_schedule`'s arguments). A kernel takes its inputs
    as this one vector: passing them as the pytrees they are cost about 60 us a call,
    against 4 us (85 leaves: jit flattens each module in Python and hands each leaf to the
    runtime), and a search makes three calls of about half a millisecond."""
    key = (id(space), id(chip), id(workload), id(tgt), starts, schedule)
    hit = _PACKED.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], (space, chip, workload, tgt),
                                                      strict=True)):
        if len(_PACKED) > 64:
            _PACKED.clear()
        tables = _tables(space, chip)
        params = _initial_stack(space, starts)
        host, temps, lam, mus, sharpness, max_iterations = _schedule(*schedule)
        flat, spec = _flatten(_Inputs(params, lam, mus, temps, chip, workload, tables, tgt,
                                      sharpness, _moves(space.shape), max_iterations))
        hit = _PACKED[key] = ((space, chip, workload, tgt), tables, host, params,
                              jax.device_put(flat), spec)
    return hit[1:]


def relaxed_evaluate(model: Model, chip: Chip, workload: Workload, layout, space: Space,
                     params: Relaxed, tgt: Targets, objective: str = "tok_s_per_kw",
                     temperature=1.0, sharpness=DEFAULT_SHARPNESS):
    """Score, constraints and metrics of relaxed parameters (differentiable in `params`).

    Example:
        >>> import perfmodel as pm
        >>> chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-8b")
        >>> space = design_space(model, chip, 1, concurrency=(1, 64))
        >>> p = _initial(space, 0.5)
        >>> s, g, m = relaxed_evaluate(model, chip, pm.Workload(1024, 256), space.layouts[0],
        ...                            space, p, targets(max_tpot_ms=20))
        >>> g.shape, bool(jnp.isfinite(s))
        ((6,), True)
    """
    tables = _tables(space, chip)
    score, g, metrics, _ = evaluate(model, chip, workload, layout, tables,
                                    params.choice(tables, temperature), tgt, objective,
                                    sharpness, vectorize=True)
    return score, g, metrics


def _augmented_loss(score, g, lam, mu):
    # Rockafellar's augmented Lagrangian for g <= 0 (Nocedal & Wright eq. 17.65).
    return -score + jnp.sum(jnp.maximum(lam + mu * g, 0.0) ** 2 - lam ** 2) / (2.0 * mu)


# ----------------------------------------------------------------------------------------
# Compiled kernels (one per static structure; compiled once, cached by jax.jit)
# ----------------------------------------------------------------------------------------

# XLA:CPU's fusion emitters triple the compile time of this scalar-heavy graph without
# speeding it up (measured with jaxlib 0.10: 7.5 s -> 3.9 s for one layout's gradient, same
# run time). Newer XLA (jaxlib 0.11) has dropped the flag and rejects it.
_CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


@functools.cache
def _compiler_options():
    """`_CPU_COMPILER_OPTIONS` on the CPU backend where this XLA knows them (probed once
    by compiling a one-operation function), else None."""
    if jax.default_backend() != "cpu":
        return None
    try:
        jax.jit(lambda x: x + 1.0, compiler_options=_CPU_COMPILER_OPTIONS).lower(
            np.float32(0.0)).compile()
    except jax.errors.JaxRuntimeError as error:
        if "compile option" not in str(error):
            raise
        return None
    return _CPU_COMPILER_OPTIONS


class _Static:
    """A static argument hashed once. `jax.jit` hashes its static arguments on every call,
    and a `Model`'s hash walks all its fields (about 9 us a call, measured; a warm search
    on a small grid makes three calls of about a millisecond together). Equal when the
    values are the same object or equal."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return type(other) is _Static and (other.value is self.value or other.value == self.value)


_STATICS: dict = {}


def _static(value):
    """`value` wrapped as `_Static`, one wrapper per object (the entry keeps the object
    alive, so its id is not reused while the entry stands). Cheap values, and tuples (a
    search builds its layout groups afresh on every call, so a wrapper would never be
    reused), pass through."""
    if isinstance(value, (str, int, float, tuple)):
        return value
    hit = _STATICS.get(id(value))
    if hit is None or hit.value is not value:
        if len(_STATICS) > 256:
            _STATICS.clear()
        hit = _STATICS[id(value)] = _Static(value)
    return hit


def _jit(fun, static_argnames):
    cache, lock = {}, threading.Lock()

    def unwrapped(*args, **kwargs):
        return fun(*args, **{k: v.value if type(v) is _Static else v
                             for k, v in kwargs.items()})

    def call(*args, **kwargs):
        with lock:      # branches are dispatched from a thread pool
            if "jitted" not in cache:
                cache["jitted"] = jax.jit(unwrapped, static_argnames=static_argnames,
                                          compiler_options=_compiler_options())
            for name in static_argnames:
                if name in kwargs:
                    kwargs[name] = _static(kwargs[name])
        return cache["jitted"](*args, **kwargs)

    return call


def _map_branches(fun, layouts) -> list:
    """`fun(layout)` for every layout, from one thread per core: XLA compiles and runs
    kernels with the GIL released, so the branches' compilations (seconds each) overlap,
    and their runs partly (a warm kernel of about a millisecond spends much of it in
    dispatch and thread hand-offs). Results are whatever `fun` returns (usually device
    arrays still computing)."""
    if len(layouts) == 1 or (os.cpu_count() or 1) == 1:
        return [fun(layout) for layout in layouts]
    return list(_branch_pool().map(fun, layouts))


@functools.cache
def _branch_pool() -> concurrent.futures.ThreadPoolExecutor:
    # One pool for the process: starting threads on every call costs a tenth of a small
    # search.
    return concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1,
                                                 thread_name_prefix="perfmodel-branch")


def _relaxed_loss(params, chip, workload, tables, tgt, sharpness, *, model, layout,
                  objective):
    """`loss(flat, lam, mu, temperature) -> (augmented loss, (score, g))` of one start's
    flattened parameters, and `unravel` from them back to `Relaxed` (the structure of one
    start of `params`, stacked over the starts). Through the model's vectorized evaluation
    order (`vectorize=True`)."""
    _, unravel = jax.flatten_util.ravel_pytree(jax.tree_util.tree_map(lambda x: x[0], params))

    def loss(flat, lam_, mu_, temperature):
        choice = unravel(flat).choice(tables, temperature)
        score, g, _, _ = evaluate(model, chip, workload, layout, tables, choice, tgt,
                                  objective, sharpness, vectorize=True)
        return _augmented_loss(score, g, lam_, mu_), (score, g)

    return loss, unravel


def _block(loss, optimizer, carry, temps, update=True):
    """Adam steps of one start at the temperatures `temps` from `carry` = (flat parameters,
    Adam state, lam, mu, last violation), under the carry's multipliers; with `update`
    (the block's end), then lam <- max(0, lam + mu g) and mu doubles (up to 1e4) while the
    violation does not halve. Returns the carry, the per-step (score, largest violation)
    and, with `update`, the (lam, mu) the steps used and the augmented loss under them at
    the block's end, which the update evaluates anyway (None without `update`). (Also
    returning the loss of every step doubled the cost of every Adam step on XLA:CPU.)

    Gradients are reverse mode: XLA:CPU pays per operation, not per number, at this size,
    and with the operators stacked a reverse pass has fewer operations than a forward pass
    carrying ~20 tangents (per-operator, it was the other way round).
    `tests/test_optimize.py` checks them against forward mode."""
    flat, state, lam_, mu_, previous = carry

    def step(inner, temperature):
        x, st = inner
        grads, (score, g) = jax.grad(loss, has_aux=True)(x, lam_, mu_, temperature)
        updates, st = optimizer.update(grads, st, x)
        # The trajectory keeps the score and the largest violation per step, not the
        # constraint vector: stacked over a block, that is a buffer of the step's loop over
        # 512 bytes. XLA:CPU runs a loop body in order on one thread only when all its
        # buffers are at most 512 bytes; otherwise it hands each of the step's ~250 small
        # kernels to its thread pool, which costs more than the kernel itself at this size.
        return (optax.apply_updates(x, updates), st), (score, jnp.max(jnp.maximum(g, 0.0)))

    (flat, state), trace = jax.lax.scan(step, (flat, state), temps)
    if not update:
        return (flat, state, lam_, mu_, previous), (trace, None)
    end_loss, (_, g) = loss(flat, lam_, mu_, temps[-1])
    used = (lam_, mu_, end_loss)
    violation = jnp.max(jnp.maximum(g, 0.0))
    mu_ = jnp.where(violation > 0.5 * previous, jnp.minimum(mu_ * 2.0, 1e4), mu_)
    lam_ = jnp.maximum(lam_ + used[1] * g, 0.0)
    return (flat, state, lam_, mu_, violation), (trace, used)


def _run_blocks(loss, optimizer, carry, temperatures):
    """Augmented-Lagrangian blocks of one start (`_block`), one per row of `temperatures`
    (blocks, inner), in one scan. Returns the carry, the per-step (score, violation), shaped
    (blocks, inner, ...), and the (lam, mu, block-end loss) of each block."""
    return jax.lax.scan(lambda c, t: _block(loss, optimizer, c, t), carry, temperatures)


def _run_steps(loss, optimizer, carry, temperatures, first: int, last: int):
    """Adam steps `first` to `last` (static; counted over the whole schedule
    `temperatures` (blocks, inner)) of one start from `carry`: the rest of a block begun
    before `first`, the whole blocks, then the start of the block that `last` ends in,
    without its multiplier update. Returns the carry, the steps' (scores, violations)
    (flat) and the (lams, mus, losses) of the blocks that ended (`_block`), with a leading
    block axis."""
    blocks, inner = temperatures.shape
    flat_t = temperatures.reshape(-1)
    pieces, ended = [], []
    if first % inner and first < last:            # finish the block begun before `first`
        end = min(last, (first // inner + 1) * inner)
        carry, (trace, used) = _block(loss, optimizer, carry, flat_t[first:end],
                                      update=end % inner == 0)
        pieces.append(trace)
        if end % inner == 0:
            ended.append(jax.tree_util.tree_map(lambda x: x[None], used))
        first = end
    if last // inner > first // inner:             # whole blocks
        carry, (trace, used) = _run_blocks(loss, optimizer, carry,
                                           temperatures[first // inner:last // inner])
        pieces.append(jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), trace))
        ended.append(used)
        first = last // inner * inner
    if first < last:                               # the start of the last block
        carry, (trace, _) = _block(loss, optimizer, carry, flat_t[first:last], update=False)
        pieces.append(trace)
    scores = jnp.concatenate([p[0] for p in pieces])
    violations = jnp.concatenate([p[1] for p in pieces])
    lam0, mu0 = carry[2], carry[3]
    if ended:
        used = tuple(jnp.concatenate(x) for x in zip(*ended, strict=True))
    else:
        used = (jnp.zeros((0, *lam0.shape), lam0.dtype), jnp.zeros((0, *mu0.shape), mu0.dtype),
                jnp.zeros((0,), mu0.dtype))
    return carry, (scores, violations), used


def _head_impl(params, lam, mu, temperatures, chip, workload, tables, tgt, sharpness, *,
               model, layout, objective, learning_rate, head_steps):
    """The first `head_steps` Adam steps of the relaxed search of one branch, vmapped over
    the starts (`params` stacked): (carry, (scores, violations) per step, (lams, mus,
    losses) per ended block), all with a leading start axis. A head that ends inside a
    block leaves its multiplier update to `_tail_impl`, so a search split there follows the
    same path as one run whole."""
    optimizer = _optimizer(learning_rate)
    loss, _ = _relaxed_loss(params, chip, workload, tables, tgt, sharpness, model=model,
                            layout=layout, objective=objective)

    def one_start(p0, lam0, mu0):
        flat0, _ = jax.flatten_util.ravel_pytree(p0)
        carry = (flat0, optimizer.init(flat0), lam0, mu0, jnp.asarray(jnp.inf, dtype=float))
        return _run_steps(loss, optimizer, carry, temperatures, 0, head_steps)

    return jax.vmap(one_start)(params, lam, mu)


def _tail_impl(head, params, temperatures, chip, workload, tables, tgt, sharpness, moves,
               max_iterations, *, model, layout, objective, learning_rate, head_steps):
    """The rest of one branch from `_head_impl`'s result `head`: the remaining blocks, the
    relaxed side of the report (at the last temperature, with its loss under the last
    block's multipliers), then rounding, repair and polish (`_harden`). Returns (lam after
    the last block, per-step (scores, violations), relaxed (loss, score, g, metrics, value),
    hardened), with a leading start axis where per start."""
    optimizer = _optimizer(learning_rate)
    loss, unravel = _relaxed_loss(params, chip, workload, tables, tgt, sharpness, model=model,
                                  layout=layout, objective=objective)

    def one_start(carry, trace, used):
        scores, violations = trace
        lams, mus, _ = used
        if temperatures.size > head_steps:          # static: more steps only when needed
            carry, (more, v_more), (lam_more, mu_more, _) = _run_steps(
                loss, optimizer, carry, temperatures, head_steps, temperatures.size)
            scores = jnp.concatenate([scores, more])
            violations = jnp.concatenate([violations, v_more])
            lams, mus = jnp.concatenate([lams, lam_more]), jnp.concatenate([mus, mu_more])
        lam_last, mu_last = lams[-1], mus[-1]
        p = unravel(carry[0])
        choice = p.choice(tables, temperatures[-1, -1])
        score, g, metrics, value = evaluate(model, chip, workload, layout, tables, choice,
                                            tgt, objective, sharpness, vectorize=True)
        final_loss = _augmented_loss(score, g, lam_last, mu_last)
        return p, carry[2], (scores, violations), (final_loss, score, g, metrics.arrays(), value)

    p, lam_out, trace, final = jax.vmap(one_start)(*head)
    hardened = _harden(p, chip, workload, tables, tgt, moves, max_iterations, model=model,
                       layout=layout, objective=objective)
    return lam_out, trace, final, hardened


def _screen_impl(params, lam, mu, temperatures, chip, workload, tables, tgt, sharpness, *,
                 model, layout, objective, learning_rate, head_steps):
    """`_head_impl`, and what ranks the branch against the others after it, per start: the
    augmented loss at the head's end, and the exact rank (`_rank`) of the best grid design
    on the concurrency line through the design the parameters round to there (its
    formats, placements and power cap at every grid concurrency, `hard=True`). Returns
    (head, [losses, line ranks])."""
    head = _head_impl(params, lam, mu, temperatures, chip, workload, tables, tgt, sharpness,
                      model=model, layout=layout, objective=objective,
                      learning_rate=learning_rate, head_steps=head_steps)
    loss, unravel = _relaxed_loss(params, chip, workload, tables, tgt, sharpness, model=model,
                                  layout=layout, objective=objective)
    carry, _, (_, _, block_losses) = head
    if head_steps % temperatures.shape[1]:
        # Inside a block: the loss under the multipliers the steps used (the carry's).
        losses = jax.vmap(lambda flat, lam_, mu_: loss(
            flat, lam_, mu_, temperatures.reshape(-1)[head_steps - 1])[0])(
                carry[0], carry[2], carry[3])
    else:
        # At a block's end the multiplier update has evaluated it already.
        losses = block_losses[:, -1]

    def line(flat):
        index = _round_index(tables, unravel(flat))
        n = tables.log_concurrency.shape[0]
        indices = jnp.tile(index, (n, 1)).at[:, 0].set(jnp.arange(n, dtype=index.dtype))
        score, g, _ = _hard_impl(indices, chip, workload, tables, tgt, model=model,
                                 layout=layout, objective=objective)
        return jnp.max(_rank(score, g))

    return head, jnp.concatenate([losses, jax.vmap(line)(carry[0])])


def _round_index(tables: _Tables, params: Relaxed):
    """The grid design nearest relaxed parameters: concurrency and power cap to the nearest
    grid value, each softmax to its argmax (traceable)."""
    log_c, caps = tables.log_concurrency, tables.caps
    c = log_c[0] + (log_c[-1] - log_c[0]) * jax.nn.sigmoid(params.concurrency_logit)
    cap = caps[0] + (caps[-1] - caps[0]) * jax.nn.sigmoid(params.cap_logit)
    return jnp.stack([jnp.argmin(jnp.abs(log_c - c)), jnp.argmax(params.weights),
                      jnp.argmax(params.experts), jnp.argmax(params.kv),
                      jnp.argmax(params.attention_placement),
                      jnp.argmax(params.dense_placement), jnp.argmax(params.expert_placement),
                      jnp.argmax(params.kv_placement),
                      jnp.argmin(jnp.abs(caps - cap))]).astype(jnp.int32)


_CONCURRENCY_MOVES = (-8, -4, -2, -1, 1, 2, 4, 8)
_COMBINED_MOVES = (0, -4, -2, -1, 1, 2, 4)


@functools.cache
def _moves(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """The local search's neighbourhood as rows (mask, value, delta) and the grid's largest
    index `upper`: the neighbour of grid index i is clip(where(mask, value, i) + delta, 0,
    upper). Concurrency moves alone; every option of each format and placement coordinate,
    and the power cap one step either way, each combined with small concurrency moves. A
    fixed size, so one kernel evaluates it."""
    rows = []

    def row(axis=None, value=0, step=0, concurrency=0):
        mask, values = np.zeros(_NDIM, bool), np.zeros(_NDIM, np.int32)
        delta = np.zeros(_NDIM, np.int32)
        if axis is not None and step == 0:
            mask[axis], values[axis] = True, value
        elif axis is not None:
            delta[axis] = step
        delta[0] += concurrency
        rows.append((mask, values, delta))

    for d in _CONCURRENCY_MOVES:
        row(concurrency=d)
    for axis in range(1, _CAP):
        for k in range(shape[axis] if shape[axis] > 1 else 0):
            for d in _COMBINED_MOVES:
                row(axis, value=k, concurrency=d)
    if shape[_CAP] > 1:
        for step in (-1, 1):
            for d in _COMBINED_MOVES:
                row(_CAP, step=step, concurrency=d)
    mask, values, delta = (np.stack(x) for x in zip(*rows, strict=True))
    return mask, values, delta, np.asarray(shape, dtype=np.int32) - 1


def _rank(score, g):
    """Larger is better: feasible designs by score, infeasible ones below them by their
    total violation. Traceable; `exhaustive` applies it to numpy results."""
    feasible = jnp.all(g <= _FEASIBLE_TOL, axis=-1)
    return jnp.where(feasible, score, -1e6 - jnp.sum(jnp.maximum(g, 0.0), axis=-1))


def _harden(params, chip, workload, tables, tgt, moves, max_iterations, *, model, layout,
            objective):
    """Round every start, then steepest ascent over the fixed neighbourhood `moves` from
    the best rounded start with the exact (`hard`) model: repairs a violated constraint
    first, then improves the objective; stops when no neighbour ranks higher."""
    mask, values, delta, upper = moves

    def hard(indices):
        return _hard_impl(indices, chip, workload, tables, tgt, model=model, layout=layout,
                          objective=objective)

    def around(index):
        return jnp.clip(jnp.where(mask, values, index[None, :]) + delta, 0, upper[None, :])

    starts = jax.vmap(lambda p: _round_index(tables, p))(params)
    s0, g0, _ = hard(starts)
    r0 = _rank(s0, g0)
    first = jnp.argmax(r0)
    n_moves = mask.shape[0]

    def cond(carry):
        it, _, _, improved, _ = carry
        return improved & (it < max_iterations)

    def body(carry):
        it, current, current_rank, _, _ = carry
        candidates = around(current)
        s, g, _ = hard(candidates)
        r = _rank(s, g)
        j = jnp.argmax(r)
        improved = r[j] > current_rank + 1e-12
        return (it + 1, jnp.where(improved, candidates[j], current),
                jnp.where(improved, r[j], current_rank), improved, (s, g))

    last = (jnp.zeros(n_moves), jnp.zeros((n_moves, len(CONSTRAINTS))))
    it, current, _, improved, last = jax.lax.while_loop(
        cond, body, (jnp.asarray(0), starts[first], r0[first], jnp.asarray(True), last))
    # The neighbourhood of the final design (evaluated again only when the iteration cap
    # stopped an improving search), for the constraints that block an improvement.
    s, g = jax.lax.cond(improved, lambda: hard(around(current))[:2], lambda: last)
    score, g_final, metrics, value = evaluate(model, chip, workload, layout, tables,
                                              _index_choice(tables, current), tgt, objective,
                                              hard=True, vectorize=True)
    # Per constraint: the smallest violation among better-scoring neighbours (inf if none).
    better = (s > score + 1e-12)[:, None] & (g > _FEASIBLE_TOL)
    blocking = jnp.min(jnp.where(better, g, jnp.inf), axis=0)
    evaluations = starts.shape[0] + (it + improved) * n_moves
    return dict(index=current, start=first, rank=_rank(score, g_final), score=score,
                g=g_final, limits=tgt.limits(), value=value, metrics=metrics.arrays(),
                blocking=blocking, evaluations=evaluations,
                sensitivity=_sensitivity(chip, workload, tables, tgt, current, model=model,
                                         layout=layout, objective=objective))


def _sensitivity(chip, workload, tables, tgt, index, *, model, layout, objective):
    """Derivatives of the score and the constraints of the grid design `index` along its
    two continuous coordinates, u = (log concurrency, power cap / TDP), formats and
    placements held (exact model), and which coordinates a grid bound holds: at the edge
    of its range with the score pushing outward. `_shadow_prices` turns them into the
    design's Lagrange multipliers."""
    base = _index_choice(tables, index)
    tdp = chip.tdp

    def at(u):
        choice = eqx.tree_at(lambda c: (c.concurrency, c.power_cap), base,
                             (jnp.exp(u[0]), u[1] * tdp))
        score, g, _, _ = evaluate(model, chip, workload, layout, tables, choice, tgt,
                                  objective, hard=True, vectorize=True)
        return score, g

    u = jnp.stack([jnp.log(base.concurrency), base.power_cap / tdp])
    lo = jnp.stack([tables.log_concurrency[0], tables.caps[0] / tdp])
    hi = jnp.stack([tables.log_concurrency[-1], tables.caps[-1] / tdp])
    ds, dg = jax.jacfwd(at)(u)
    held = ((u <= lo * (1 + 1e-12)) & (ds < 0)) | ((u >= hi * (1 - 1e-12)) & (ds > 0))
    return dict(score=ds, g=dg, held=held)


def _shadow_prices(sensitivity: dict, active: np.ndarray) -> np.ndarray:
    """Lagrange multipliers of a grid design's `active` constraints (host arrays): the
    least-squares solution of grad score = sum_i lam_i grad g_i over the free continuous
    coordinates, clipped at 0: the first-order (KKT) condition, solved as the
    least-squares multiplier estimate of SQP methods (Nocedal & Wright, Numerical
    Optimization, 2nd ed., chapters 12 and 18). Inactive constraints get 0."""
    # In Python floats: the arrays are a few numbers, and right after the kernels ran,
    # each numpy call on them cost several microseconds (about 50 us in all, measured
    # inside `optimize`, against 10 us in a warm loop).
    g = np.asarray(sensitivity["g"]).tolist()
    score = np.asarray(sensitivity["score"]).tolist()
    free = [j for j, held in enumerate(np.asarray(sensitivity["held"]).tolist()) if not held]
    cols = [i for i, on in enumerate(np.asarray(active).tolist()) if on]
    lam = [0.0] * len(g)
    if free and cols:
        x = _least_squares([[g[i][j] for i in cols] for j in free], [score[j] for j in free])
        for i, value in zip(cols, x, strict=True):
            lam[i] = max(value, 0.0)
    return np.array(lam)


def _least_squares(a, b) -> list[float]:
    """The minimum-norm least-squares solution of a x = b, as `np.linalg.lstsq(a, b,
    rcond=None)` gives it (to rounding), in closed form for `a` of at most two rows (the
    free continuous coordinates): Gram-Schmidt on the rows, the larger first, a = L Q with L
    lower triangular and Q's rows orthonormal; then x = Q^T z with L z = b, or, when the
    second row lies along the first (to lstsq's default cutoff), the projection on that
    direction."""
    rows = [[float(v) for v in row] for row in a]
    b = [float(v) for v in b]
    n = len(rows[0]) if rows else 0
    if len(rows) > 2:
        return np.linalg.lstsq(np.array(rows), np.array(b), rcond=None)[0].tolist()
    norms = [math.sqrt(sum(v * v for v in row)) for row in rows]
    if n == 0 or not max(norms, default=0.0) > 0.0:
        return [0.0] * n
    if len(rows) == 2 and norms[1] > norms[0]:
        rows, b, norms = rows[::-1], b[::-1], norms[::-1]
    r11 = norms[0]
    q1 = [v / r11 for v in rows[0]]
    if len(rows) == 1:
        return [v * (b[0] / r11) for v in q1]
    r12 = sum(p * q for p, q in zip(q1, rows[1], strict=True))
    rest = [v - r12 * q for v, q in zip(rows[1], q1, strict=True)]
    r22 = math.sqrt(sum(v * v for v in rest))
    if r22 <= sys.float_info.epsilon * max(2, n) * math.hypot(r11, r12):
        t = (r11 * b[0] + r12 * b[1]) / (r11 * r11 + r12 * r12)
        return [v * t for v in q1]
    z1 = b[0] / r11
    z2 = (b[1] - r12 * z1) / r22
    return [z1 * p + z2 * v / r22 for p, v in zip(q1, rest, strict=True)]


def _solve_impl(params, lam, mu, temperatures, chip, workload, tables, tgt, sharpness, moves,
                max_iterations, *, model, layout, objective, learning_rate):
    """One branch end to end in one kernel: the relaxed search (`_head_impl` runs every
    block, in one scan: a second scan would double the compiled code and slow each step),
    then `_tail_impl`: the relaxed report, rounding, repair and polish (`_harden`)."""
    static = dict(model=model, layout=layout, objective=objective,
                  learning_rate=learning_rate, head_steps=temperatures.size)
    head = _head_impl(params, lam, mu, temperatures, chip, workload, tables, tgt, sharpness,
                      **static)
    return _tail_impl(head, params, temperatures, chip, workload, tables, tgt, sharpness,
                      moves, max_iterations, **static)


@functools.cache
def _optimizer(learning_rate: float):
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate))


def _solve_key(params, temperatures) -> tuple:
    """What fixes the structure of a branch's result (`_tail_impl`): the number of starts
    (`params`' leading axis) and the schedule's shape (`temperatures`). Not the model,
    layout or objective, which change no shape: a key holding the `Model` cost about
    12 us to build and look up (hashing it), per branch and call."""
    return params.concurrency_logit.shape[0], tuple(temperatures.shape)


#: Structure of a branch's packed result by `_solve_key`, recorded when it is traced.
_SOLVE_OUTPUTS: dict = {}


def _pack(tree, key) -> jnp.ndarray:
    """`tree` packed into one float vector: one device-to-host copy instead of about 60
    (each costs more than the whole local search on CPU). Its structure is recorded in
    `_SOLVE_OUTPUTS[key]`, at trace time, for `_unpack`; indices and counts are small
    integers, exact in float."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in paths]
    ends = np.cumsum([x.size for x in leaves]).tolist()
    specs = [(end - x.size, end, x.shape, None if x.dtype == float else x.dtype)
             for x, end in zip(leaves, ends, strict=True)]
    _SOLVE_OUTPUTS[key] = (treedef, specs, {jax.tree_util.keystr(path): spec for (path, _), spec
                                            in zip(paths, specs, strict=True)})
    return jnp.concatenate([jnp.ravel(x).astype(float) for x in leaves])


def _unpack(flat: np.ndarray, key: tuple):
    """The pytree `_pack` packed into `flat` (host arrays)."""
    treedef, specs, _ = _SOLVE_OUTPUTS[key]
    if flat.shape != (specs[-1][1],):
        raise AssertionError(f"optimize: a packed result of {flat.shape} values, expected "
                             f"{specs[-1][1]} (a kernel's output structure changed)")
    leaves = [flat[start:end].reshape(shape) if dtype is None
              else flat[start:end].reshape(shape).astype(dtype)
              for start, end, shape, dtype in specs]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _unpack_leaf(flat: np.ndarray, key: tuple, path: str):
    """One leaf of the pytree `_pack` packed into `flat`, by its `jax.tree_util.keystr`
    path (`_unpack` of a whole branch costs about 15 us; ranking the branches needs three
    of its leaves)."""
    start, end, shape, dtype = _SOLVE_OUTPUTS[key][2][path]
    leaf = flat[start:end].reshape(shape)
    return leaf if dtype is None else leaf.astype(dtype)


def _stacked_numbers(layouts):
    """Static layouts as one `LayoutNumbers` with a leading layout axis."""
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[x.numbers() for x in layouts])


def _counted_solve(flat, *, spec, **kwargs):
    """`_solve_impl` of the packed inputs `flat` (`_packed`), its result packed (`_pack`)."""
    TRACES[("solve", kwargs["model"].name, kwargs["layout"].describe(),
            kwargs["objective"])] += 1
    x = _unflatten(flat, spec)
    return _pack(_solve_impl(*x, **kwargs), _solve_key(x.params, x.temperatures))


def _counted_solve_layouts(flat, *, spec, layouts, **kwargs):
    """`_counted_solve` of every layout of `layouts` (static `Layout`s, at least two) in one
    kernel: the layouts enter as numbers (`Layout.numbers()`, stacked) and `jax.vmap` runs
    their searches side by side, so the kernel's cost per Adam step is about that of one
    layout (XLA:CPU pays per operation at this size, not per number). One row per layout."""
    TRACES[("solve", kwargs["model"].name, "+".join(x.describe() for x in layouts),
            kwargs["objective"])] += 1
    x = _unflatten(flat, spec)
    key = _solve_key(x.params, x.temperatures)
    return jax.vmap(lambda layout: _pack(_solve_impl(*x, layout=layout, **kwargs), key))(
        _stacked_numbers(layouts))


def _screen_inputs(x: _Inputs) -> tuple:
    """The arguments of `_screen_impl` among `x`: all but the local search's."""
    return x[:9]


def _counted_screen(flat, *, spec, **kwargs):
    """`_screen_impl` of one static layout, with a leading layout axis of 1 (as
    `_counted_screen_layouts` has one per layout)."""
    TRACES[("screen", kwargs["model"].name, kwargs["layout"].describe(),
            kwargs["objective"])] += 1
    return jax.tree_util.tree_map(lambda x: x[None], _screen_impl(
        *_screen_inputs(_unflatten(flat, spec)), **kwargs))


def _counted_screen_layouts(flat, *, spec, layouts, **kwargs):
    """`_screen_impl` of every layout of `layouts` in one vmapped kernel (as
    `_counted_solve_layouts`)."""
    TRACES[("screen", kwargs["model"].name, "+".join(x.describe() for x in layouts),
            kwargs["objective"])] += 1
    args = _screen_inputs(_unflatten(flat, spec))
    return jax.vmap(lambda layout: _screen_impl(*args, layout=layout, **kwargs))(
        _stacked_numbers(layouts))


def _counted_finish(heads, row, flat, *, spec, **kwargs):
    """`_tail_impl` of one static layout from row `row` of a screening kernel's heads,
    packed (`_pack`) like `_counted_solve`."""
    TRACES[("finish", kwargs["model"].name, kwargs["layout"].describe(),
            kwargs["objective"])] += 1
    head = jax.tree_util.tree_map(lambda x: x[row], heads)
    x = _unflatten(flat, spec)
    return _pack(_tail_impl(head, x.params, x.temperatures, x.chip, x.workload, x.tables,
                            x.tgt, x.sharpness, x.moves, x.max_iterations, **kwargs),
                 _solve_key(x.params, x.temperatures))


#: Traces of the compiled kernels by (kernel, model, layout, objective): targets,
#: temperatures and penalty weights are traced, so a new target must not add one.
TRACES: collections.Counter = collections.Counter()

_solve = _jit(_counted_solve, ("spec", "model", "layout", "objective", "learning_rate"))
_solve_layouts = _jit(_counted_solve_layouts, ("spec", "model", "layouts", "objective",
                                               "learning_rate"))
_screen = _jit(_counted_screen, ("spec", "model", "layout", "objective", "learning_rate",
                                 "head_steps"))
_screen_layouts = _jit(_counted_screen_layouts, ("spec", "model", "layouts", "objective",
                                                 "learning_rate", "head_steps"))
_finish = _jit(_counted_finish, ("spec", "model", "layout", "objective", "learning_rate",
                                 "head_steps"))


def _screen_order(entries: list, n_starts: int) -> list:
    """Branches in the order they continue after the screen. `entries` are (screen
    row, ...) with the row [losses, line ranks] of `_screen_impl`: the best line rank
    first, then the lowest relaxed loss, then alternately by each (each rank without the
    branches already placed). The exact line finds the best layout for a given relaxed
    format and placement choice; the relaxed loss still sees a layout whose choice has not
    settled yet (`benchmarks/bench_layouts.py` reports where the grid's best layout
    ranks)."""
    rows = {id(e): e[0].tolist() for e in entries}      # floats: cheaper to compare
    by_line = sorted(entries, key=lambda e: -max(rows[id(e)][n_starts:]))
    by_loss = sorted(entries, key=lambda e: min(rows[id(e)][:n_starts]))
    order, placed = [], set()
    for pair in zip(by_line, by_loss, strict=True):
        for entry in pair:
            if id(entry) not in placed:
                placed.add(id(entry))
                order.append(entry)
    return order


def _branch_groups(layouts, kernels: int | None = None) -> list:
    """How the branches run. With more aggregated layouts than `kernels` (default: one per
    core), they share `kernels` vmapped kernels (tuples of layouts, as numbers); otherwise
    each layout, and always each disaggregated one (its pools stay static), has a static
    kernel of its own. A vmapped kernel is arithmetic-bound with many layouts and costs
    more than a static one with few, so it pays only past one layout per core
    (`benchmarks/bench_optimize.py --layouts 13` against `--layouts 2`)."""
    kernels = kernels or os.cpu_count() or 1
    aggregated = [x for x in layouts if isinstance(x, Layout)]
    alone = [x for x in layouts if not isinstance(x, Layout)]
    if len(aggregated) <= kernels:
        return aggregated + alone
    return [tuple(aggregated[i::kernels]) for i in range(kernels)] + alone


def _screen_groups(layouts) -> list:
    """How the screen's heads run: `_branch_groups` with one vmapped kernel for every
    aggregated layout. Unlike the whole searches, the heads do not gain from one kernel
    per core: each kernel of this kind already keeps both cores busy (XLA:CPU runs
    independent operations side by side), so one kernel for all was as fast or faster on
    2 cores with 4, 6, 9 and 13 layouts (the grids of `benchmarks/bench_optimize.py`)."""
    return _branch_groups(layouts, kernels=1)


def _hard_impl(indices, chip, workload, tables, tgt, *, model, layout, objective):
    """(score, g, objective value) of each grid index row of `indices` with the exact model
    (`hard=True`, per-operator order: fastest under this wide vmap)."""
    def one(index):
        choice = _index_choice(tables, index)
        score, g, _, value = evaluate(model, chip, workload, layout, tables, choice, tgt,
                                      objective, hard=True)
        return score, g, value

    return jax.vmap(one)(indices)


def _packed_hard(indices, flat, *, spec, **kwargs):
    """`_hard_impl` with (chip, workload, tables, tgt) packed into `flat` (`_flatten`)."""
    return _hard_impl(indices, *_unflatten(flat, spec), **kwargs)


_hard = _jit(_packed_hard, ("spec", "model", "layout", "objective"))


def _index_choice(tables: _Tables, index) -> Choice:
    def hot(i, n):
        return jax.nn.one_hot(i, n, dtype=float)

    return Choice(concurrency=jnp.exp(tables.log_concurrency[index[0]]),
                  power_cap=tables.caps[index[_CAP]],
                  weights=hot(index[1], tables.weight_bytes.shape[0]),
                  experts=hot(index[2], tables.expert_bytes.shape[0]),
                  kv=hot(index[3], tables.kv_bytes.shape[0]),
                  attention_placement=hot(index[4], tables.attention_placement.shape[0]),
                  dense_placement=hot(index[5], tables.dense_placement.shape[0]),
                  expert_placement=hot(index[6], tables.expert_placement.shape[0]),
                  kv_placement=hot(index[7], tables.kv_placement.shape[0]))


# ----------------------------------------------------------------------------------------
# Hard evaluation and exhaustive enumeration
# ----------------------------------------------------------------------------------------

class _Evaluator:
    """Hard evaluation of grid indices in chunks of `_CHUNK` (one compile per layout): every
    chunk is dispatched before any result is read."""

    def __init__(self, model, chip, workload, space, tgt, objective):
        self.model, self.objective = model, objective
        # Inputs shared by every chunk and layout, on the device once, packed as the
        # search kernels' are (`_packed`).
        flat, self.spec = _flatten((chip, workload, _tables(space, chip), tgt))
        self.flat = jax.device_put(flat)
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, layout, indices: np.ndarray):
        """(score, g, value) of each index row; thread-safe."""
        indices = np.asarray(indices, dtype=np.int32).reshape(-1, _NDIM)
        n, chunk = indices.shape[0], _CHUNK
        pad = -n % chunk
        if pad:
            indices = np.concatenate([indices, np.repeat(indices[-1:], pad, axis=0)])
        pending = [_hard(indices[start:start + chunk], self.flat, spec=self.spec,
                         model=self.model, layout=layout, objective=self.objective)
                   for start in range(0, n + pad, chunk)]
        with self._lock:
            self.count += n
        score, g, value = (np.concatenate(x)[:n] for x in zip(*jax.device_get(pending),
                                                              strict=True))
        return score, g, value


_LAYOUT_NAMES: dict = {}


def _layout_name(layout) -> str:
    """`layout.describe()`, memoized on the layout's identity (hashing a layout to look it
    up costs as much as describing it)."""
    hit = _LAYOUT_NAMES.get(id(layout))
    if hit is None or hit[0] is not layout:
        if len(_LAYOUT_NAMES) > 256:
            _LAYOUT_NAMES.clear()
        hit = _LAYOUT_NAMES[id(layout)] = (layout, layout.describe())
    return hit[1]


def _describe(space: Space, tables: _Tables, layout, index) -> dict:
    index = [int(i) for i in index]
    placements = space.placements
    return {"layout": _layout_name(layout), "chips": layout.chips,
            "concurrency": int(space.concurrency[index[0]]),
            "formats": {"weights": space.weights[index[1]],
                        "experts": space.experts[index[2]], "kv": space.kv[index[3]]},
            "placements": {cls: placements[cls][index[4 + i]]
                           for i, cls in enumerate(STATE_CLASSES)},
            "power_cap_w": float(tables.caps[index[_CAP]])}


def _design(space: Space, chip: Chip, layout, index, tables: _Tables):
    capped, design, _ = _materialize(chip, layout, tables, _index_choice(
        tables, jnp.asarray(index, dtype=jnp.int32)))
    names = (space.weights[index[1]], space.experts[index[2]], space.kv[index[3]])
    design = eqx.tree_at(lambda d: d.precision, design,
                         dataclasses.replace(design.precision, names=names))
    return capped, design


@dataclasses.dataclass
class ExhaustiveResult:
    """Best design of the grid by enumeration."""

    design: dict | None
    """Description of the best feasible design (None when none is feasible)."""
    objective_value: float | None
    feasible: bool
    points: int
    wall_s: float
    closest: dict | None = None
    """When nothing is feasible: the design with the smallest total violation."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def exhaustive(model: Model, chip: Chip, workload: Workload, space: Space, tgt: Targets,
               objective: str = "tok_s_per_kw") -> ExhaustiveResult:
    """Enumerate every design of `space` with the exact (hard) model and keep the best
    feasible one.

    Example:
        >>> import perfmodel as pm
        >>> chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-8b")
        >>> space = design_space(model, chip, 1, concurrency=(1, 8, 64))
        >>> r = exhaustive(model, chip, pm.Workload(1024, 256), space, targets(max_tpot_ms=50))
        >>> r.points, r.feasible   # 3 concurrencies x 2 weight x 2 KV formats
        (12, True)
    """
    _check(model, chip, workload, space, objective)
    start = time.perf_counter()
    evaluator = _Evaluator(model, chip, workload, space, tgt, objective)
    grid = np.stack(np.unravel_index(np.arange(math.prod(space.shape)), space.shape), -1)
    # Layouts in parallel threads, as `optimize` runs its branches.
    results = _map_branches(lambda layout: evaluator(layout, grid), space.layouts)
    best, best_layout = None, None
    for layout, (score, g, value) in zip(space.layouts, results, strict=True):
        ranks = np.asarray(_rank(score, g))
        k = int(np.argmax(ranks))
        if best is None or ranks[k] > best[0]:
            best, best_layout = (float(ranks[k]), grid[k], float(value[k]), g[k]), layout
    wall = time.perf_counter() - start
    feasible = bool(np.all(best[3] <= _FEASIBLE_TOL))
    described = _describe(space, _tables(space, chip), best_layout, best[1])
    if feasible:
        return ExhaustiveResult(design=described, objective_value=best[2], feasible=True,
                                points=evaluator.count, wall_s=wall)
    return ExhaustiveResult(design=None, objective_value=None, feasible=False,
                            points=evaluator.count, wall_s=wall,
                            closest={"design": described, "violations": _violations(best[3])})


# ----------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class OptimizeResult:
    """Hardened design and its relaxed counterpart.

    `design` / `objective_value` / `metrics` are the hardened (exact, `hard=True`) design;
    when no feasible design was found they are None and `closest` holds the design with the
    smallest total constraint violation and what it achieves.
    """

    objective: str
    design: dict | None
    objective_value: float | None
    feasible: bool
    metrics: dict | None
    binding: list
    """Constraints at their limit on the grid (within `binding_tol`) or violated by a
    better-scoring grid neighbour (the ones `multipliers` prices); when infeasible, the
    violated ones."""
    multipliers: dict
    """Per constraint: `lambda`, the hardened design's shadow price (its KKT multiplier
    along concurrency and power cap, d log objective / d g), with `per_unit` the objective
    bought by one more unit of the limit; `relaxed_lambda`, the relaxed problem's
    augmented-Lagrangian multiplier. When infeasible, `lambda` is the relaxed one."""
    relaxed_metrics: dict
    relaxed_objective_value: float
    layout_weights: dict
    """Relaxed layout choice: softmax of minus each branch's final loss / temperature (0 for
    the layouts in `screened_out`)."""
    trajectory: dict
    """Per Adam step, for the chosen branch: score, max violation, temperature."""
    evaluations: int
    """Hard evaluations spent in screening, hardening and local search."""
    wall_s: float
    result: str
    """"feasible" or "infeasible"."""
    closest: dict | None = None
    screened_out: list = dataclasses.field(default_factory=list)
    """Layouts dropped by the screen (`keep_layouts`, `screen_steps`), best first."""
    blocking: dict = dataclasses.field(default_factory=dict)
    """Constraints that better-scoring grid neighbours violate, with the limit the nearest
    of them would need: why the grid design stops where it does (no shadow price)."""
    spec_args: tuple | None = dataclasses.field(default=None, repr=False)
    """(space, chip, layout, index, tables) of the hardened design, for `specs`."""

    def specs(self) -> tuple[Chip, Design] | None:
        """The hardened design as model inputs: (chip with the chosen power cap as its TDP,
        `Design`), or None when infeasible. Built on demand (eager JAX, milliseconds)."""
        return None if self.spec_args is None else _design(*self.spec_args)

    def as_dict(self) -> dict:
        """JSON-ready dict (the `perfmodel optimize --format json` keys)."""
        keys = ("design", "metrics", "objective", "objective_value", "feasible", "binding",
                "blocking", "multipliers", "relaxed_metrics", "relaxed_objective_value",
                "layout_weights", "screened_out", "evaluations", "wall_s", "result",
                "closest")
        return {k: getattr(self, k) for k in keys}


def _blocking(gmin, limits) -> dict:
    """Discrete blockers: for each constraint that a better-scoring grid neighbour violates,
    the limit that neighbour would need (user units), or the memory excess."""
    out = {}
    for i, name in enumerate(CONSTRAINTS):
        if not np.isfinite(gmin[i]):
            continue
        if name == "memory":
            out[name] = {"excess": float(gmin[i])}
            continue
        unit, scale = _UNITS[name]
        out[name] = {"needs": float((gmin[i] + 1.0) * limits[i] * scale), "unit": unit}
    return out


def _violations(g) -> dict:
    return {name: float(g[i]) for i, name in enumerate(CONSTRAINTS) if g[i] > _FEASIBLE_TOL}


def _check(model, chip, workload, space, objective):
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}; valid objectives: {tuple(OBJECTIVES)}")
    if not isinstance(model, Model) or not isinstance(chip, Chip):
        raise ValueError("model and chip must be perfmodel Model and Chip (see get_model, "
                         "get_chip)")
    if not isinstance(workload, Workload):
        raise ValueError("workload must be a perfmodel Workload")
    if not isinstance(space, Space):
        raise ValueError("space must be a Space (see design_space)")


def optimize(model: Model, chip: Chip, workload: Workload, space: Space, tgt: Targets,
             objective: str = "tok_s_per_kw", *, steps: int = 24, blocks: int = 4,
             learning_rate: float = 0.2, temperature=(1.0, 0.05), starts=(0.3, 0.7),
             mu=10.0, sharpness=DEFAULT_SHARPNESS, binding_tol: float = 0.03,
             max_iterations: int = 40, keep_layouts: int | None = 2,
             screen_steps: int | None = None, throw: bool = False) -> OptimizeResult:
    """Find the best design of `space` under `tgt` by gradient descent, then harden it.

    Every layout is a branch; each branch runs `len(starts)` Adam trajectories (vectorized)
    for `steps` steps split into `blocks` augmented-Lagrangian blocks, with the softmax
    temperature annealed geometrically from `temperature[0]` to `temperature[1]`. With
    more layouts than `keep_layouts`, every branch runs the first `screen_steps` steps
    only and is screened there: the `keep_layouts` best continue from where they stopped,
    on the path they would have taken unscreened (`_screen_order`: the best exact design
    on the concurrency line through each branch's rounded relaxed design, and the lowest
    relaxed loss), the others are reported in `screened_out`.

    Args:
        model, chip, workload: what is served, on what.
        space: the grid (`design_space`).
        tgt: limits and prices (`targets`).
        objective: one of `OBJECTIVES`.
        steps, blocks, learning_rate: Adam schedule. The default (24 steps in 4 blocks)
            finds the same hardened designs as longer schedules on the test scenarios;
            longer ones converge the relaxed solution further
            (`benchmarks/bench_schedules.py`).
        temperature: (start, end) of the softmax temperature (traced: no recompiles).
        starts: initial concurrency positions in [0, 1] of the log range (one trajectory
            each).
        mu: initial penalty weight of the augmented Lagrangian (doubled per block while the
            violation does not halve).
        sharpness: smooth-max p of the relaxed model.
        binding_tol: a constraint binds when the hardened design is within this fraction
            of its limit, or when a better-scoring grid neighbour violates it.
        max_iterations: cap on the local search's moves (each evaluates one neighbourhood,
            ~100 designs, exactly).
        keep_layouts: layouts searched past the screen when the grid has more (None:
            all). The screen costs `screen_steps` Adam steps and an exact concurrency line
            per layout; on `benchmarks/bench_layouts.py`'s multi-layout scenarios the
            defaults find the grid's optimum within 2% in every one.
        screen_steps: Adam steps every layout runs before the screen (None: the first
            block, `steps // blocks`; no screen when it is not below `steps`). Earlier
            screens are cheaper but blinder: after 2 to 4 of the default 6 steps, the grid
            optimum's layout ranked 7th of 13 on one of `benchmarks/bench_optimize.py`'s
            grids.
        throw: raise `RuntimeError` when no feasible design is found.

    Returns:
        `OptimizeResult`.

    Raises:
        ValueError: unknown objective, bad arguments (before tracing).
        RuntimeError: infeasible, with `throw=True`.

    Example:
        >>> import perfmodel as pm
        >>> chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-8b")
        >>> space = design_space(model, chip, 1, concurrency=(1, 2, 4, 8, 16, 32, 64))
        >>> r = optimize(model, chip, pm.Workload(1024, 256), space,
        ...              targets(max_tpot_ms=8), steps=60, blocks=3)
        >>> r.feasible, r.metrics["tpot_s"] <= 0.008
        (True, True)
    """
    _check(model, chip, workload, space, objective)
    if steps < blocks or blocks < 1:
        raise ValueError(f"optimize: need steps >= blocks >= 1, got steps={steps}, "
                         f"blocks={blocks}")
    if not starts or any(not 0 < s < 1 for s in starts):
        raise ValueError("optimize: starts are positions in (0, 1)")
    if keep_layouts is not None and (not isinstance(keep_layouts, int) or keep_layouts < 1):
        raise ValueError(f"optimize: keep_layouts is a number of layouts >= 1, or None to "
                         f"search every layout to the end; got {keep_layouts!r}")
    if screen_steps is not None and (not isinstance(screen_steps, int) or screen_steps < 1):
        raise ValueError(f"optimize: screen_steps is the number of Adam steps (>= 1) every "
                         f"layout runs before the layout screen, or None for the first "
                         f"block; got {screen_steps!r}")
    t0 = time.perf_counter()
    inner = steps // blocks
    screen_steps = inner if screen_steps is None else screen_steps
    t_start, t_end = temperature
    tables, schedule, params, flat, spec = _packed(
        space, chip, workload, tgt, tuple(starts),
        (blocks, inner, float(t_start), float(t_end), len(starts), float(mu),
         float(sharpness), int(max_iterations)))
    # Unscreened, every branch is one kernel (search, rounding, repair, polish); screened,
    # a screening kernel then, for the kept ones, a finishing one. Each stage's kernels are
    # all dispatched before any result is read. Inputs that do not change between calls
    # (tables, starts, schedule, neighbourhood) are cached on the device: a numpy argument
    # costs jit a copy on every call (about 0.1 ms for the 30 of them, a tenth of a small
    # search).
    static = dict(spec=spec, model=model, objective=objective,
                  learning_rate=float(learning_rate))
    screen = (keep_layouts is not None and len(space.layouts) > keep_layouts
              and screen_steps < inner * blocks)
    branches, screened = [], []
    if not screen:
        groups = _branch_groups(space.layouts)

        def run(group):
            if isinstance(group, tuple):
                return _solve_layouts(flat, layouts=group, **static)
            return _solve(flat, layout=group, **static)

        pending = _map_branches(run, groups)
        for group, flat in zip(groups, jax.device_get(pending), strict=True):
            rows = zip(group, flat, strict=True) if isinstance(group, tuple) else [(group, flat)]
            branches.extend(dict(layout=layout, row=row) for layout, row in rows)
    else:
        # Every layout runs the first `screen_steps` steps (vmapped kernels, as
        # `_screen_groups` says); the `keep_layouts` best by the screen continue, each in a
        # static kernel from where its head stopped.
        static["head_steps"] = screen_steps
        groups = _screen_groups(space.layouts)

        def run_head(group):
            if isinstance(group, tuple):
                return _screen_layouts(flat, layouts=group, **static)
            return _screen(flat, layout=group, **static)

        heads = _map_branches(run_head, groups)
        # (screen row, layout, its kernel's heads, its row there) per layout.
        entries = []
        for group, (head, _), screens in zip(groups, heads, jax.device_get(
                [h[1] for h in heads]), strict=True):
            members = group if isinstance(group, tuple) else (group,)
            for row, (layout, values) in enumerate(zip(members, screens, strict=True)):
                entries.append((values, layout, head, row))
        order = _screen_order(entries, len(starts))
        kept = order[:keep_layouts]
        screened = [_layout_name(e[1]) for e in order[keep_layouts:]]

        def run_tail(entry):
            _, layout, head, row = entry
            return _finish(head, np.int32(row), flat, layout=layout, **static)

        pending = _map_branches(run_tail, kept)
        for (_, layout, _, _), row in zip(kept, jax.device_get(pending), strict=True):
            branches.append(dict(layout=layout, row=row))
    key = _solve_key(params, schedule.reshape(blocks, inner))
    # Ranked by three leaves of each packed result; only the chosen branch is unpacked.
    evaluations = int(sum(_unpack_leaf(b["row"], key, "[3]['evaluations']")
                          for b in branches))
    if screen:      # the screen's concurrency lines
        evaluations += len(space.layouts) * len(starts) * len(space.concurrency)
    bi = int(np.argmax([_unpack_leaf(b["row"], key, "[3]['rank']") for b in branches]))
    branch = branches[bi]
    branch["lam"], branch["trace"], branch["final"], branch["hardened"] = _unpack(
        branch["row"], key)
    found = branch["hardened"]
    layout, si = branch["layout"], int(found["start"])
    index, g, value = found["index"], found["g"], float(found["value"])
    feasible = all(x <= _FEASIBLE_TOL for x in g.tolist())

    # Relaxed side of the report: the chosen branch's relaxed design at the final temperature.
    final_loss, relaxed_score, relaxed_g, relaxed_metrics, relaxed_value = branch["final"]
    relaxed = {k: float(v[si]) for k, v in relaxed_metrics.items()}
    losses = np.array([float(np.min(_unpack_leaf(b["row"], key, "[2][0]")))
                       for b in branches])
    weights = np.exp(-(losses - losses.min()) / float(t_end))
    weights = weights / weights.sum()
    layout_weights = {_layout_name(b["layout"]): float(w) for b, w in
                      zip(branches, weights, strict=True)}
    layout_weights.update({name: 0.0 for name in screened})
    scores, violations = branch["trace"]
    trajectory = {"score": scores[si].tolist(),
                  "max_violation": violations[si].tolist(),
                  "temperature": schedule[:inner * blocks].tolist()}

    described = _describe(space, tables, layout, index)
    limits = found["limits"]
    relaxed_lam = branch["lam"][si]
    # Shadow prices of the hardened design: its KKT multipliers along the continuous
    # coordinates over the constraints that bind on the grid (within binding_tol of their
    # limit, or violated by a better-scoring neighbour); the relaxed problem's
    # augmented-Lagrangian multipliers are reported beside them.
    priced = np.array([np.isfinite(limits[i]) or name == "memory"
                       for i, name in enumerate(CONSTRAINTS)])
    active = priced & ((g >= -binding_tol) | np.isfinite(found["blocking"]))
    lam = _shadow_prices(found["sensitivity"], active) if feasible else relaxed_lam
    multipliers = {}
    for i, name in enumerate(CONSTRAINTS):
        if not priced[i]:
            continue
        unit, scale = _UNITS[name]
        entry = {"lambda": float(lam[i]), "relaxed_lambda": float(relaxed_lam[i])}
        if feasible and name not in ("memory",) and np.isfinite(limits[i]):
            # d objective / d limit = objective * lam / limit (at a binding constraint).
            sign = 1.0 if OBJECTIVES[objective][1] else -1.0
            entry["per_unit"] = float(sign * value * lam[i] / (limits[i] * scale))
            entry["unit"] = f"{objective} per {unit}" if unit else objective
        multipliers[name] = entry
    if feasible:
        metrics = found["metrics"]
        metric_dict = {k: float(v) for k, v in metrics.items()}
        # Binding: at its limit on the grid, or what stops a better grid neighbour.
        near = {name for i, name in enumerate(CONSTRAINTS) if active[i] and name != "memory"}
        if metric_dict["running_batch"] >= (1.0 - binding_tol) * metric_dict["max_batch"]:
            near.add("memory")
        binding = [name for name in CONSTRAINTS if name in near]
        blocking = _blocking(found["blocking"], limits)
        result = OptimizeResult(
            objective=objective, design=described, objective_value=value, feasible=True,
            metrics=metric_dict, binding=binding, blocking=blocking, multipliers=multipliers,
            relaxed_metrics=relaxed, relaxed_objective_value=float(relaxed_value[si]),
            layout_weights=layout_weights, trajectory=trajectory,
            evaluations=evaluations, wall_s=time.perf_counter() - t0, result="feasible",
            screened_out=screened, spec_args=(space, chip, layout, index, tables))
        return result
    metrics = found["metrics"]
    closest = {"design": described,
               "metrics": {k: float(v) for k, v in metrics.items()},
               "objective_value": value, "violations": _violations(g),
               "achievable": {name: float((g[i] + 1.0) * limits[i] * _UNITS[name][1])
                              for i, name in enumerate(CONSTRAINTS)
                              if g[i] > _FEASIBLE_TOL and name != "memory"}}
    if throw:
        raise RuntimeError(f"optimize: no feasible design in the grid; closest: {closest}")
    return OptimizeResult(
        objective=objective, design=None, objective_value=None, feasible=False, metrics=None,
        binding=[name for name in _violations(g)], multipliers=multipliers,
        relaxed_metrics=relaxed, relaxed_objective_value=float(relaxed_value[si]),
        layout_weights=layout_weights, trajectory=trajectory, evaluations=evaluations,
        wall_s=time.perf_counter() - t0, result="infeasible", closest=closest,
        screened_out=screened)
