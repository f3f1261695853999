"""Construction-time checks of spec fields: a wrong type or an out-of-range number is a
`TypeError` / `ValueError` naming the field, the value and the valid range, raised when the
spec is built (before any tracing), never a NaN or a silent clip later.

Values that are traced when the spec is built (inside `jax.jit`, `vmap` or `grad`) cannot
be checked here; the public entry points check them with `eqx.error_if`
(`serving._CHECKS`).

Example:
    >>> import equinox as eqx, jax.numpy as jnp
    >>> class Pipe(eqx.Module):
    ...     length: jnp.ndarray = eqx.field(converter=as_number)
    ...     def __check_init__(self):
    ...         check(self, {"length": Range(low=0.0, low_open=True)})
    >>> Pipe(length=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: Pipe.length must be > 0, got -1
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Range(NamedTuple):
    """The valid values of a number: bounds, whether each is open, integers only, and
    whether the upper bound may be infinity (a cap that means "none")."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    infinite: bool = False
    """+inf allowed (for example `Runtime.max_running`: no cap)."""
    optional: bool = False
    """None allowed (for example `Workload.request_rate`: a closed loop)."""

    def describe(self) -> str:
        """The range in words: "in [0, 1)", ">= 0", "an integer in [1, 1,048,576]" (whole
        bounds with thousands separators)."""
        kind = "an integer" if self.integer else "a number"
        has_low, has_high = self.low > -math.inf, self.high < math.inf
        low = f"{'>' if self.low_open else '>='} {_bound(self.low)}"
        high = f"{'<' if self.high_open else '<='} {_bound(self.high)}"
        if has_low and has_high:
            text = (f"in {'(' if self.low_open else '['}{_bound(self.low)}, "
                    f"{_bound(self.high)}{')' if self.high_open else ']'}")
        elif has_low:
            text = low
        elif has_high:
            text = high
        else:
            text = "finite"
        text = text if not self.integer else f"{kind} {text}"
        return text + (" (or inf for none)" if self.infinite else "")

    def holds(self, x: np.ndarray) -> np.ndarray:
        """Elementwise: True where `x` is valid (NaN never is)."""
        ok = np.isfinite(x) | (self.infinite & (x == np.inf))
        ok &= (x > self.low) if self.low_open else (x >= self.low)
        ok &= (x < self.high) if self.high_open else (x <= self.high)
        if self.integer:
            ok &= ~np.isfinite(x) | (np.floor(x) == x)
        return ok


def _bound(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


#: Common ranges.
POSITIVE = Range(low=0.0, low_open=True)
NON_NEGATIVE = Range(low=0.0)
FRACTION = Range(low=0.0, high=1.0, low_open=True)          # (0, 1]
UNIT_INTERVAL = Range(low=0.0, high=1.0)                    # [0, 1]


def as_number(x):
    """A field converter: `x` as a float array, or `x` as it is when it is no number (None,
    a string, a bool), for `check` to refuse naming the field."""
    if x is None or isinstance(x, (str, bytes, bool, np.bool_)):
        return x
    try:
        return jnp.asarray(x, dtype=float)
    except (TypeError, ValueError):
        return x


def check(owner, rules: dict) -> None:
    """Raise ValueError naming `Owner.field` for the first field of `rules` ({field: Range})
    whose concrete value is out of its range (NaN and infinity included, unless allowed),
    TypeError for one that is no number (None too, unless the range is `optional`).
    Traced values are skipped."""
    for field, valid in rules.items():
        value = getattr(owner, field)
        where = f"{type(owner).__name__}.{field}"
        if value is None and valid.optional or isinstance(value, jax.core.Tracer):
            continue
        if not isinstance(value, (jax.Array, np.ndarray)):   # `as_number` could not convert
            raise TypeError(f"{where} must be a number or an array of numbers, got "
                            f"{type(value).__name__} {str(value)[:60]!r}")
        x = np.asarray(value, dtype=float)
        ok = valid.holds(x)
        if not np.all(ok):
            bad = x[~ok].ravel()[0] if x.ndim else float(x)
            what = "NaN" if math.isnan(bad) else f"{bad:g}"
            raise ValueError(f"{where} must be {valid.describe()}, got {what}")


def distribution(owner, fields, names) -> None:
    """Raise ValueError naming `Owner.field` unless each concrete field of `fields` is a
    probability vector over `names` (its last axis): entries in [0, 1] summing to 1
    (within 1e-6), as a one-hot choice or a relaxed mix is. Traced values are skipped."""
    for field in fields:
        value = getattr(owner, field)
        if isinstance(value, jax.core.Tracer):
            continue
        x = np.asarray(value, dtype=float)
        where = f"{type(owner).__name__}.{field}"
        if not (np.all(np.isfinite(x)) and np.all(x >= 0) and np.all(x <= 1)
                and np.allclose(x.sum(axis=-1), 1.0, rtol=0, atol=1e-6)):
            raise ValueError(f"{where} must be probabilities over {tuple(names)} (entries in "
                             f"[0, 1] summing to 1; one-hot for a real design), got "
                             f"{np.round(x, 6).tolist()}")


def arguments(**given) -> None:
    """Raise ValueError for the first argument `name=(value, kind)` whose value is not a
    `kind` (the specs an entry point takes), naming it and what it got."""
    for name, (value, kind) in given.items():
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be a perfmodel {kind.__name__}, got "
                             f"{type(value).__name__}")


def instance(owner, field: str, *types) -> None:
    """Raise TypeError unless `Owner.field` is an instance of one of `types`."""
    value = getattr(owner, field)
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise TypeError(f"{type(owner).__name__}.{field} must be a {names}, got "
                        f"{type(value).__name__} {str(value)[:40]!r}")


def error_if(value, bad, message: str):
    """`eqx.error_if(value, bad, message)` for a run-time check of a possibly traced value.

    On concrete values (an eager call) the check runs at once and raises
    `equinox.EquinoxRuntimeError` with the message and the first offending value, so the
    error points at the call that failed and says what it got (NaN, infinity, a number out
    of range); traced values (under jit, vmap or grad) go through `eqx.error_if`.
    """
    import equinox as eqx

    if isinstance(value, jax.core.Tracer) or isinstance(bad, jax.core.Tracer):
        return eqx.error_if(value, bad, message)
    flags = np.asarray(bad)
    if flags.any():
        values = np.broadcast_to(np.asarray(value), flags.shape)[flags] if np.ndim(value) \
            else np.asarray(value).reshape(1)
        if values.dtype == bool:
            raise eqx.EquinoxRuntimeError(message)
        more = f" (and {flags.sum() - 1} more)" if flags.sum() > 1 else ""
        raise eqx.EquinoxRuntimeError(f"{message}; got {float(values.flat[0])!r}{more}")
    return value
