"""Fitted parameters: loaded from the versioned JSON files in `perfmodel/data/`.

- `fitted_params.json` (written by `perfmodel.calibrate` through `calibration/fit.py`):
  per chip family the `efficiency` fields and the `scale_up` collective terms; per serving
  framework the fitted `Runtime` fields (`step_overhead`, `request_overhead`,
  `admission_steps`) and documented settings (`activation_reserve` for SGLang);
  `family_fallback` and `framework_fallback` maps for the families and frameworks the fit
  had no data for; fit metadata (date, data files, seed, result code, points).
- `fitted_power.json` (written by the power calibration): per family `energy` coefficients
  and `idle_fraction` of TDP.

Each file is resolved on its own along the fallback map (rubin -> blackwell, ...), then the
two are merged, so a family with only power data still gets the fallback efficiencies.
Without the files, chips keep their priors.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import equinox as eqx
import jax.numpy as jnp

from .design import Runtime
from .hardware import Chip

FITTED_FILE = "fitted_params.json"
POWER_FILE = "fitted_power.json"


def _read_json(name: str) -> dict:
    path = resources.files("perfmodel").joinpath("data", name)
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"perfmodel/data/{name} is not valid JSON: {error}") from None


@functools.cache
def load_fitted() -> dict:
    """The fitted-parameter file as a dict ({} when none is shipped)."""
    return _read_json(FITTED_FILE)


@functools.cache
def load_power() -> dict:
    """The fitted power file as a dict ({} when none is shipped)."""
    return _read_json(POWER_FILE)


def _resolve(fitted: dict, family: str, fallback: dict) -> dict:
    families = fitted.get("families", {})
    seen = set()
    while family and family not in families and family not in seen:
        seen.add(family)
        family = fallback.get(family, "")
    return families.get(family, {})


def family_params(family: str) -> dict:
    """Fitted efficiency, collective, energy and idle-power parameters of a chip family.

    Each file is followed along the `family_fallback` maps (both files' maps, the
    calibration file's first) until a family it fitted is found.

    Example:
        >>> isinstance(family_params("rubin"), dict)
        True
    """
    fitted, power = load_fitted(), load_power()
    fallback = {**power.get("family_fallback", {}), **fitted.get("family_fallback", {})}
    merged = {}
    for source in (fitted, power):
        for key, value in _resolve(source, family, fallback).items():
            if isinstance(value, dict):
                merged[key] = {**merged.get(key, {}), **value}
            else:
                merged[key] = value
    return merged


def family_basis(family: str) -> str:
    """The family whose fitted performance parameters a chip family uses ("" for priors)."""
    fitted = load_fitted()
    families, fallback = fitted.get("families", {}), fitted.get("family_fallback", {})
    seen = set()
    while family and family not in families and family not in seen:
        seen.add(family)
        family = fallback.get(family, "")
    return family if family in families else ""


def framework_key(framework: str) -> str:
    """The fitted framework a framework name uses: itself, its `framework_fallback`, else
    the first fitted name it contains ("dynamo-trt" -> "trt"), else "" (prior)."""
    fitted = load_fitted()
    frameworks = fitted.get("frameworks", {})
    name = framework.strip().lower()
    seen = set()
    while name and name not in frameworks and name not in seen:
        seen.add(name)
        name = fitted.get("framework_fallback", {}).get(name, "")
    if name in frameworks:
        return name
    for key in sorted(frameworks, key=len, reverse=True):
        if key in framework.lower():
            return key
    return ""


def runtime_for(framework: str, **settings) -> Runtime:
    """A `Runtime` with the fitted overheads (step, request, admission) and settings of a
    serving framework (vllm, sglang, trt, dynamo-trt, ...); unknown frameworks keep the
    priors. `settings` override fields.

    Example:
        >>> rt = runtime_for("vllm")
        >>> rt.framework, float(rt.step_overhead) > 0
        ('vllm', True)
    """
    key = framework_key(framework)
    values = dict(load_fitted().get("frameworks", {}).get(key, {}))
    values.update(settings)
    return Runtime(framework=framework.strip().lower() or "generic", **values)


def apply_fitted(chip: Chip) -> Chip:
    """The chip with its family's fitted efficiency, energy and idle-power parameters."""
    params = family_params(chip.family)
    if not params:
        return chip
    for group in ("efficiency", "energy"):
        for name, value in params.get(group, {}).items():
            chip = eqx.tree_at(lambda c, g=group, n=name: getattr(getattr(c, g), n), chip,
                               jnp.asarray(value, dtype=float))
    if "idle_fraction" in params:
        chip = eqx.tree_at(lambda c: c.idle_power, chip, chip.tdp * params["idle_fraction"])
    for tier in ("scale_up", "scale_out"):
        for name, value in params.get(tier, {}).items():
            chip = eqx.tree_at(lambda c, t=tier, n=name: getattr(getattr(c, t), n), chip,
                               jnp.asarray(value, dtype=float))
    return chip
