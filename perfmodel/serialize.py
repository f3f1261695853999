"""Specs as JSON: every field of a chip, workload or design, exactly (`to_json`,
`from_json`), so a design an optimizer reports can be fed back and reproduce its metrics.

A spec Module becomes `{"type": class name, field: value, ...}`: array leaves as floats or
nested lists (float64 values survive `json` exactly, as it writes the shortest repr that
reads back to the same float), non-finite numbers as the strings "inf", "-inf", "nan",
static fields as they are (tuples as lists). Reading builds each Module through its
constructor, so a file is validated like any other input.

Example:
    >>> import perfmodel as pm
    >>> layout = pm.Disaggregated(prefill=pm.Layout(tp=2), decode=pm.Layout(tp=4, replicas=2))
    >>> from_json(to_json(layout)) == layout
    True
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _classes() -> dict[str, type]:
    from . import design, hardware, interconnect, workload

    kinds = (hardware.Chip, hardware.Efficiency, hardware.EnergyCoefficients,
             interconnect.Switch, interconnect.Ring, interconnect.Torus, workload.Workload,
             design.Design, design.Layout, design.LayoutNumbers, design.Disaggregated,
             design.Precision, design.SliceMapping, design.SpecDecode, design.Runtime)
    return {cls.__name__: cls for cls in kinds}


def _number(x: float):
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def _encode(value):
    if isinstance(value, eqx.Module):
        name = type(value).__name__
        if name not in _classes():
            raise TypeError(f"to_json: {name} is not a perfmodel spec")
        out = {"type": name}
        for field in dataclasses.fields(value):
            out[field.name] = _encode(getattr(value, field.name))
        return out
    if isinstance(value, (jnp.ndarray, np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype == bool:
            return array.tolist()
        data = array.astype(float).tolist()
        return _number(data) if array.ndim == 0 else _deep(data)
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if isinstance(value, float):
        return _number(value)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    raise TypeError(f"to_json: cannot write {type(value).__name__} {value!r}")


def _deep(data):
    return [_deep(x) for x in data] if isinstance(data, list) else _number(data)


def to_json(spec) -> dict:
    """Every field of `spec` (a perfmodel spec Module) as JSON-ready data."""
    return _encode(spec)


def _decode(value, static: bool):
    if isinstance(value, dict):
        if "type" not in value or value["type"] not in _classes():
            raise ValueError(f"from_json: {value.get('type')!r} is not a perfmodel spec; "
                             f"valid types: {sorted(_classes())}")
        cls = _classes()[value["type"]]
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(value) - set(names) - {"type"}
        if unknown:
            raise ValueError(f"from_json: {cls.__name__} has no field(s) {sorted(unknown)}")
        kwargs = {k: _decode(v, names[k].metadata.get("static", False))
                  for k, v in value.items() if k != "type"}
        return cls(**kwargs)
    if static:
        return tuple(_decode(v, True) for v in value) if isinstance(value, list) else value
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, list):
        if any(isinstance(v, dict) for v in value):
            return tuple(_decode(v, False) for v in value)
        return jnp.asarray(_numbers(value))
    return value


def _numbers(data):
    if isinstance(data, list):
        return [_numbers(x) for x in data]
    if isinstance(data, bool):
        return data
    return _NONFINITE.get(data, data) if isinstance(data, str) else data


def from_json(data: dict):
    """The spec `to_json` wrote (validated by its constructors).

    Raises:
        ValueError: an unknown type or field, or a value its constructor refuses.
    """
    if not isinstance(data, dict):
        raise ValueError(f"from_json: expected an object with a 'type', got "
                         f"{type(data).__name__}")
    return _decode(data, False)
