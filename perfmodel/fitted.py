"""Fitted parameters: the one place that reads, resolves and applies them.

Two fits write versioned JSON files into `perfmodel/data/`:

- `fitted_params.json`, the latency fit (`calibration/fit.py`): per chip family the
  `Efficiency` fields and the scale-up collective terms; per serving framework the fitted
  `Runtime` terms (`step_overhead`, `request_overhead`, `admission_steps`,
  `prefill_request_time`, `stream_time`, `dp_admission_steps`, `dp_sync_time`) and documented
  settings; `family_fallback` and `framework_fallback` maps for the families and
  frameworks it had no data for.
- `fitted_power.json`, the power fit (`calibration/power/fit.py`): per measured family the
  energy coefficients and idle fraction of TDP; a `generic` set of TDP fractions for every
  other chip (`generic_energy`); and the engine terms of the measured vLLM harnesses
  (`runtimes`), which this module exposes as the frameworks `POWER_FRAMEWORKS`.

Every command builds a chip through `apply` (via `presets.get_chip`), so a chip is modelled
the same way whatever asks: its latency terms follow the family fallback chain (jalapeno ->
blackwell: the fit has no measured Jalapeno), its energy terms are its own family's power
fit where one was measured, else the generic rule scaled by the chip's own datasheet (TDP
over peak rates): the rule the power fit validates leave-one-family-out. A chip whose family
neither fit knows keeps its priors.

Example:
    >>> from perfmodel.presets import get_chip
    >>> resolve_family("jalapeno").latency_basis, resolve_family("jalapeno").power_basis
    ('blackwell', 'generic')
    >>> chip = apply(get_chip("h100", calibrated=False))
    >>> 0.1 < float(chip.idle_power / chip.tdp) < 0.3
    True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from importlib import resources

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .datasets import MTP_ACCEPTANCE
from .design import Runtime
from .formats import COMPUTE_CLASSES
from .hardware import Chip

LATENCY_FILE = "fitted_params.json"
POWER_FILE = "fitted_power.json"

#: Framework names under which the power fit's engines are exposed -> their key in
#: `fitted_power.json`'s `runtimes`. They describe the measured harnesses (ML.ENERGY's
#: vLLM 0.11 runs; its 2024 v2 runs, vLLM version unrecorded), not vLLM in general: the
#: InferenceMAX vLLM deployments are the latency fit's "vllm".
POWER_FRAMEWORKS = {"mlenergy-vllm": "vllm", "mlenergy-vllm-2024": "vllm-2024"}

_COLLECTIVE_FIELDS = ("efficiency", "latency", "base_latency")
_RUNTIME_FIELDS = {f.name for f in dataclasses.fields(Runtime)} - {"framework"}


def with_prefill_attention(efficiency: dict) -> dict:
    """A fitted family's efficiency values with `prefill_attention_max` and
    `window_prefill_attention_max`: files written before the first was a field priced
    prompt attention at `attention_max`, files written before the second priced windowed
    models' prompt attention at `prefill_attention_max`, and both keep doing so.

    Example:
        >>> v = with_prefill_attention({"attention_max": 0.2})
        >>> v["prefill_attention_max"], v["window_prefill_attention_max"]
        (0.2, 0.2)
    """
    v = dict(efficiency)
    if "attention_max" in v and "prefill_attention_max" not in v:
        v["prefill_attention_max"] = v["attention_max"]
    if "prefill_attention_max" in v and "window_prefill_attention_max" not in v:
        v["window_prefill_attention_max"] = v["prefill_attention_max"]
    return v


#: Fitted framework terms added after the first fits: a file without one was fitted without
#: it and reads it as 0 (`with_framework_terms`).
LATER_FRAMEWORK_TERMS = ("prefill_request_time", "stream_time", "dp_admission_steps",
                         "dp_sync_time")


def with_framework_terms(terms: dict) -> dict:
    """A fitted framework's terms with `prefill_request_time`, `stream_time`,
    `dp_admission_steps` and `dp_sync_time`: files written before they were fitted fields
    were fitted without them, and keep being predicted so (0, as `design.Runtime`'s
    defaults give `runtime_for`).

    Example:
        >>> t = with_framework_terms({"step_overhead": 1e-3})
        >>> t["prefill_request_time"], t["stream_time"], t["dp_admission_steps"]
        (0.0, 0.0, 0.0)
        >>> t["dp_sync_time"]
        0.0
    """
    v = dict(terms)
    for name in LATER_FRAMEWORK_TERMS:
        v.setdefault(name, 0.0)
    return v


# ---------------------------------------------------------------------------------------
# Files.


def read(name: str) -> dict:
    """A fitted-parameter file of `perfmodel/data/` as a dict ({} when none is shipped).

    Raises:
        ValueError: the file is not valid JSON, naming it.
    """
    return _read_cached(name)


@functools.cache
def _read_cached(name: str) -> dict:
    path = resources.files("perfmodel").joinpath("data", name)
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"perfmodel/data/{name} is not valid JSON: {error}") from None


def write(data: Mapping, path: str | os.PathLike) -> None:
    """Write a fitted-parameter dict as the JSON the readers expect (floats in full)."""
    def plain(x):
        if isinstance(x, Mapping):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [plain(v) for v in x]
        if isinstance(x, np.generic | np.ndarray) or hasattr(x, "__jax_array__"):
            return plain(np.asarray(x).tolist())
        return x

    with open(path, "w") as handle:
        json.dump(plain(data), handle, indent=1)
        handle.write("\n")


# ---------------------------------------------------------------------------------------
# Resolution.


#: Framework terms whose meaning depends on the serving mode, lent by a framework fallback
#: only within a mode: a prompt's host time on an aggregated engine is its scheduling and
#: KV-block allocation, on a disaggregated prefill instance also the set-up of its KV
#: hand-off to a decode instance (`design.Runtime.prefill_request_time`). The shipped fit
#: puts them apart (TensorRT-LLM 0.9 ms a prompt, Dynamo-TRT 2.1 ms; SGLang 1.1 ms,
#: Dynamo-SGLang 6.0 ms; `calibration/README.md`, "Framework fallbacks across serving modes").
MODE_TERMS = ("prefill_request_time",)


def disaggregated(framework: str) -> bool:
    """True for a framework label of a disaggregated deployment (prefill and decode on
    separate pools): one that names Dynamo or "disagg".

    Example:
        >>> disaggregated("Dynamo-TRT"), disaggregated("sglang-disagg"), disaggregated("sglang")
        (True, True, False)
    """
    name = framework.strip().lower()
    return "dynamo" in name or "disagg" in name


def lent_terms(framework: str, basis: str, terms: Mapping) -> dict:
    """The fitted `terms` of framework `basis` as `framework` takes them: all of them when
    `basis` is `framework` itself or runs in the same serving mode, else without
    `MODE_TERMS` (which then keep the caller's defaults).

    Example:
        >>> lent_terms("dynamo-vllm", "vllm", {"step_overhead": 1e-3, "prefill_request_time": 0.01})
        {'step_overhead': 0.001}
        >>> lent_terms("trtllm-bench", "trt", {"prefill_request_time": 0.01})
        {'prefill_request_time': 0.01}
    """
    if disaggregated(framework) == disaggregated(basis):
        return dict(terms)
    return {k: v for k, v in terms.items() if k not in MODE_TERMS}


def follow(name: str, known, fallback: Mapping[str, str]) -> str:
    """The first name along `fallback` from `name` that is in `known`, else "".

    The one fallback walk of the package (families and frameworks alike); a cycle ends it.

    Example:
        >>> follow("rubin-cpx", {"blackwell"}, {"rubin-cpx": "rubin", "rubin": "blackwell"})
        'blackwell'
    """
    seen = set()
    while name and name not in known and name not in seen:
        seen.add(name)
        name = fallback.get(name, "")
    return name if name in known else ""


@dataclasses.dataclass(frozen=True)
class FamilyFit:
    """What the fits say about one chip family.

    Attributes:
        family: the family asked about.
        latency_basis: the family whose latency fit it uses ("" for priors).
        efficiency: `Efficiency` field values (dimensionless, tokens, s), {} for priors.
        scale_up: scale-up collective terms (`efficiency`, `latency` (s),
            `base_latency` (s)), {} for priors.
        power_basis: the family whose power fit it uses, "generic" for the TDP-fraction rule,
            "" for priors.
        energy: absolute coefficients (`per_flop` (J/FLOP, one per compute class),
            `per_hbm_byte`, `per_link_byte` (J/byte), `active_power` (W)) of a measured
            family; {} otherwise.
        fractions: TDP fractions of the generic rule (`generic_energy`), {} otherwise.
        idle_fraction: idle power over TDP, None for the prior.
    """

    family: str
    latency_basis: str = ""
    efficiency: Mapping = dataclasses.field(default_factory=dict)
    scale_up: Mapping = dataclasses.field(default_factory=dict)
    power_basis: str = ""
    energy: Mapping = dataclasses.field(default_factory=dict)
    fractions: Mapping = dataclasses.field(default_factory=dict)
    idle_fraction: float | None = None


def resolve_family(family: str, *, latency: Mapping | None = None,
                   power: Mapping | None = None, holdout: str | None = None) -> FamilyFit:
    """The fitted terms a chip family gets.

    Args:
        family: chip family ("blackwell", "jalapeno", ...).
        latency: a latency-fit dict (default: the shipped `fitted_params.json`).
        power: a power-fit dict (default: the shipped `fitted_power.json`).
        holdout: a family whose own power entry is ignored (leave-one-family-out checks):
            it takes the generic rule.
    """
    latency = read(LATENCY_FILE) if latency is None else latency
    power = read(POWER_FILE) if power is None else power
    families = latency.get("families", {})
    basis = follow(family, families, latency.get("family_fallback", {}))
    entry = families.get(basis, {})
    fit = dict(family=family, latency_basis=basis,
               efficiency=with_prefill_attention(entry.get("efficiency", {})),
               scale_up=dict(entry.get("scale_up", {})))
    measured = power.get("families", {})
    if family in measured and family != holdout:
        own = measured[family]
        fit.update(power_basis=family, energy=dict(own["energy"]),
                   idle_fraction=float(own["idle_fraction"]))
    elif power.get("generic"):
        fit.update(power_basis="generic", fractions=dict(power["generic"]),
                   idle_fraction=float(power["generic"]["idle"]))
    return FamilyFit(**fit)


def generic_energy(chip: Chip, fractions: Mapping) -> dict:
    """Energy coefficients of a chip from TDP fractions: the fraction of TDP each unit would
    draw running alone at its peak (`calibration/power/README.md`).

    Returns:
        {"per_flop": [one per compute class] (J/FLOP), "per_hbm_byte" (J/byte),
        "per_link_byte" (J/byte), "active_power" (W)}. Fractions without an "active" key
        give 0 W.
    """
    tdp = float(chip.tdp)
    peaks = np.asarray(chip.peak_flops, dtype=float)
    return {"per_flop": [fractions["flop"][i] * tdp / peaks[i]
                         for i in range(len(COMPUTE_CLASSES))],
            "per_hbm_byte": fractions["hbm"] * tdp / float(chip.hbm_bandwidth),
            "per_link_byte": fractions["link"] * tdp / float(chip.scale_up.bandwidth),
            "active_power": fractions.get("active", 0.0) * tdp}


def apply(chip: Chip, *, latency: Mapping | None = None, power: Mapping | None = None,
          holdout: str | None = None) -> Chip:
    """The chip with its family's fitted latency and power terms (see the module docstring).

    Args:
        chip: a chip with datasheet numbers and priors.
        latency, power, holdout: as `resolve_family`.
    """
    fit = resolve_family(chip.family, latency=latency, power=power, holdout=holdout)
    for name, value in fit.efficiency.items():
        chip = eqx.tree_at(lambda c, n=name: getattr(c.efficiency, n), chip, _array(value))
    for name, value in fit.scale_up.items():
        chip = eqx.tree_at(lambda c, n=name: getattr(c.scale_up, n), chip, _array(value))
    energy = fit.energy or (generic_energy(chip, fit.fractions) if fit.fractions else {})
    if energy:
        chip = eqx.tree_at(
            lambda c: (c.energy.per_flop, c.energy.per_hbm_byte, c.energy.per_link_byte,
                       c.energy.active_power), chip,
            (_array(energy["per_flop"]), _array(energy["per_hbm_byte"]),
             _array(energy["per_link_byte"]), _array(energy.get("active_power", 0.0))))
    if fit.idle_fraction is not None:
        chip = eqx.tree_at(lambda c: c.idle_power, chip, chip.tdp * fit.idle_fraction)
    return chip


def framework_key(framework: str, *, latency: Mapping | None = None) -> str:
    """The fitted framework a framework label uses: a power-fit harness
    (`POWER_FRAMEWORKS`), itself, its `framework_fallback`, else the longest fitted name it
    contains ("dynamo-trt-1.2" -> "trt"), else "" (priors).

    Example:
        >>> framework_key("Dynamo-VLLM-0.9"), framework_key("mlenergy-vllm")
        ('vllm', 'mlenergy-vllm')
    """
    latency = read(LATENCY_FILE) if latency is None else latency
    name = framework.strip().lower()
    if name in POWER_FRAMEWORKS:
        return name
    frameworks = latency.get("frameworks", {})
    key = follow(name, frameworks, latency.get("framework_fallback", {}))
    if key:
        return key
    for known in sorted(frameworks, key=len, reverse=True):
        if known in name:
            return known
    return ""


def runtime_terms(framework: str, family: str = "", *, latency: Mapping | None = None,
                  power: Mapping | None = None) -> dict:
    """The fitted `Runtime` field values of a framework ({} for priors); through a fallback
    to another serving mode without `MODE_TERMS` (`lent_terms`).

    A power-fit harness's kernel efficiency is per chip family; a family it did not measure
    runs at the latency fit's kernel speed (1).
    """
    key = framework_key(framework, latency=latency)
    if key in POWER_FRAMEWORKS:
        power = read(POWER_FILE) if power is None else power
        entry = dict(power.get("runtimes", {}).get(POWER_FRAMEWORKS[key], {}))
        kernel = entry.pop("kernel_efficiency", {})
        entry["kernel_efficiency"] = kernel.get(family, 1.0) if isinstance(kernel, Mapping) \
            else kernel
        return entry
    latency = read(LATENCY_FILE) if latency is None else latency
    return lent_terms(framework, key, latency.get("frameworks", {}).get(key, {}))


def mtp_acceptance(framework: str, *, latency: Mapping | None = None) -> float:
    """Per-token MTP acceptance of a framework's rows in the latency fit (fitted where it
    had MTP rows, InferenceMAX's random-token prompts; else the prior,
    `datasets.MTP_ACCEPTANCE`).

    Example:
        >>> 0.0 < mtp_acceptance("dynamo-trt") < 1.0
        True
    """
    terms = runtime_terms(framework, latency=latency)
    return float(terms.get("mtp_acceptance", MTP_ACCEPTANCE))


def runtime_for(framework: str, family: str = "", **settings) -> Runtime:
    """A `Runtime` with a serving framework's fitted terms; `settings` override fields.

    Args:
        framework: "vllm", "sglang", "trt", "dynamo-trt", "mlenergy-vllm", ... (unknown
            names keep the priors).
        family: the chip family, for terms fitted per family (power-fit harnesses).
        **settings: `Runtime` fields to set (s, tokens, bytes, ...).

    Raises:
        ValueError: a setting that is not a `Runtime` field, naming the valid ones.

    Example:
        >>> rt = runtime_for("vllm")
        >>> rt.framework, float(rt.step_overhead) > 0
        ('vllm', True)
    """
    unknown = sorted(set(settings) - _RUNTIME_FIELDS)
    if unknown:
        raise ValueError(f"runtime_for: unknown Runtime field(s) {', '.join(unknown)}; valid: "
                         f"{', '.join(sorted(_RUNTIME_FIELDS))}")
    values = {k: v for k, v in runtime_terms(framework, family).items()
              if k in _RUNTIME_FIELDS}
    values.update(settings)
    return Runtime(framework=framework.strip().lower() or "generic", **values)


def _array(x):
    return jnp.asarray(x, dtype=float)
