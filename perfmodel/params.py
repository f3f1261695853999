"""Fitted parameters: loaded from the versioned JSON in `perfmodel/data/fitted_params.json`
(written by `perfmodel.calibrate`). Without a fit, chips keep their priors."""

from __future__ import annotations

import functools
import json
from importlib import resources

import equinox as eqx
import jax.numpy as jnp

from .hardware import Chip


@functools.cache
def load_fitted() -> dict:
    """The fitted-parameter file as a dict ({} when none is shipped)."""
    path = resources.files("perfmodel").joinpath("data", "fitted_params.json")
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def family_params(family: str) -> dict:
    """Fitted efficiency/energy parameters of a chip family, falling back along the
    file's `family_fallback` map (e.g. rubin -> blackwell) and then to {} (priors)."""
    fitted = load_fitted()
    families = fitted.get("families", {})
    seen = set()
    while family and family not in families and family not in seen:
        seen.add(family)
        family = fitted.get("family_fallback", {}).get(family, "")
    return families.get(family, {})


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
