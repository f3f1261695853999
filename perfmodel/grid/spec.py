"""The sweep spec: a TOML file's `[sweep]` table read into a `SweepSpec`.

    [sweep]
    models = ["deepseek-r1", "gpt-oss-120b", "llama-3.1-70b"]
    chips = ["gb200", "h200", "mi355x", "jalapeno"]
    chip_counts = [4, 8]
    isl = [1024, 8192]
    osl = [1024]
    concurrency = { start = 1, stop = 4096, num = 400, scale = "log" }
    layouts = "all"            # or a list such as ["tp8-ep8", "4xtp2-dpa"]
    precision = "default"      # or a list of weight formats such as ["fp4", "fp8"]
    metrics = ["tput_per_chip", "interactivity", "ttft_s", "tpot_s", "power_w"]
    runtime = { step_overhead = 0.002, max_running = 256 }   # optional engine settings
    output_cv2 = 0.0           # optional: Var/mean^2 of the output lengths
    cached_fraction = 0.0      # optional: share of each prompt found in the prefix cache

Every numeric axis (`chip_counts`, `isl`, `osl`, `concurrency`) is a number, a list, or a
range table `{start, stop, num, scale}` (`scale` "linear" or "log", both ends included;
`chip_counts`, `isl` and `osl` are rounded to whole numbers). Key aliases: `model`, `chip`,
`chip_count`/`num_chips`, `input_len`, `output_len`, `concurrencies`, `layout`, `formats`/
`precisions`, `metric`, `engine` (for `runtime`). Metric names are `serving.COLUMNS` names or
`Metrics` fields, with the short forms of `METRIC_ALIASES`. Names of models and chips go
through `presets.find_model` and `presets.get_chip` when the grid is expanded
(`expand.expand`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys

import numpy as np

from ..checks import NON_NEGATIVE, Range
from ..design import Layout, Runtime
from ..serving import COLUMNS

#: Short metric names the issue's spec uses, and the `serving.COLUMNS` names they stand for.
METRIC_ALIASES = {"tput_per_chip": "tput_per_chip_total", "power_w": "power_w_modelled",
                  "tpot_ms": "tpot_s", "throughput_per_chip": "tput_per_chip_total"}

#: Metrics kept when the spec names none.
DEFAULT_METRICS = ("tput_per_chip_total", "interactivity", "ttft_s", "tpot_s", "e2e_s",
                   "power_w_modelled", "tok_s_per_kw_tdp", "max_batch")

#: Each key of `[sweep]` and the aliases it may be written as.
KEYS = {"models": ("model",), "chips": ("chip",), "chip_counts": ("chip_count", "num_chips"),
        "isl": ("input_len",), "osl": ("output_len",), "concurrency": ("concurrencies",),
        "layouts": ("layout",), "precision": ("precisions", "formats"),
        "metrics": ("metric",), "emulate": (), "allow_long_context": (),
        "runtime": ("engine",), "output_cv2": ("output_spread",), "cached_fraction": ()}

#: Largest number of values a range table may ask for on one axis.
MAX_AXIS = 10_000_000


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """What a sweep covers (the grid is their Cartesian product, layouts per chip count).

    Attributes:
        models, chips: preset names (or Hugging Face ids / config paths for models).
        chip_counts: chips per deployment (chips).
        isl, osl: nominal input and output lengths (tokens).
        concurrency: requests in flight over the whole deployment (requests).
        layouts: "all" (`expand.all_layouts`) or layout names as `Layout.describe` writes
            them ("tp8-ep8", "4xtp2-dpa").
        precision: "default" (`sweep.default_precision` of each chip) or weight format names.
        metrics: `serving.COLUMNS` names written per row.
        emulate: allow formats a chip does not compute natively (weight-only quantization);
            without it such points are infeasible.
        allow_long_context: model requests longer than a model's maximum context; without
            it such points are infeasible.
        runtime: (field, value) pairs replacing numbers of each chip's serving runtime
            (`sweep.default_runtime`, a `design.Runtime`: step_overhead in s,
            memory_fraction, max_running, ...), in the units of those fields.
        output_cv2: Var/mean^2 of the output lengths of every point (dimensionless, >= 0;
            `Workload.output_cv2`: a spread lengthens the running batch's mean context).
        cached_fraction: share of each point's prompt found in the prefix cache
            (dimensionless, in [0, 1); `Workload.cached_fraction`: the prefill computes the
            rest, the KV cache holds the whole prompt).
    """

    models: tuple[str, ...]
    chips: tuple[str, ...]
    chip_counts: tuple[int, ...]
    isl: tuple[float, ...]
    osl: tuple[float, ...]
    concurrency: tuple[float, ...]
    layouts: str | tuple[str, ...] = "all"
    precision: str | tuple[str, ...] = "default"
    metrics: tuple[str, ...] = DEFAULT_METRICS
    emulate: bool = False
    allow_long_context: bool = False
    runtime: tuple[tuple[str, float], ...] = ()
    output_cv2: float = 0.0
    cached_fraction: float = 0.0

    def digest(self) -> str:
        """A hash of everything that decides the rows (what `--resume` checks). A field
        added after sweeps were written (`cached_fraction`) is left out at its default, so
        those outputs keep their digest and still resume."""
        fields = dataclasses.asdict(self)
        if not fields["cached_fraction"]:
            del fields["cached_fraction"]
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _names(value, key: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or \
            not all(isinstance(v, str) and v.strip() for v in items):
        raise ValueError(f"sweep.{key} must be a name or a non-empty list of names, "
                         f"got {value!r}")
    return tuple(v.strip() for v in items)


def axis(value, key: str, integer: bool = False, low: float = 0.0) -> tuple[float, ...]:
    """The values of one numeric axis: a number, a list, or {start, stop, num, scale}.

    Raises:
        ValueError: naming `sweep.KEY`: not a number, below `low`, or a bad range table.

    Example:
        >>> axis({"start": 1, "stop": 1000, "num": 4, "scale": "log"}, "concurrency")
        (1.0, 10.0, 100.0, 1000.0)
    """
    if isinstance(value, dict):
        extra = set(value) - {"start", "stop", "num", "scale"}
        if extra or not {"start", "stop", "num"} <= set(value):
            raise ValueError(f"sweep.{key}: a range is {{start, stop, num, scale}}, got "
                             f"keys {sorted(value)}")
        start, stop, num = value["start"], value["stop"], value["num"]
        scale = value.get("scale", "linear")
        if not isinstance(num, int) or isinstance(num, bool) or not 1 <= num <= MAX_AXIS:
            raise ValueError(f"sweep.{key}.num must be an integer in [1, {MAX_AXIS:,}], "
                             f"got {num!r}")
        if scale not in ("linear", "log"):
            raise ValueError(f"sweep.{key}.scale must be 'linear' or 'log', got {scale!r}")
        for name, x in (("start", start), ("stop", stop)):
            if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
                raise ValueError(f"sweep.{key}.{name} must be a finite number, got {x!r}")
        if scale == "log" and min(start, stop) <= 0:
            raise ValueError(f"sweep.{key}: a log range needs positive start and stop, got "
                             f"{start!r} and {stop!r}")
        values = (np.geomspace(start, stop, num) if scale == "log"
                  else np.linspace(start, stop, num))
    else:
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                for v in items):
            raise ValueError(f"sweep.{key} must be a number, a non-empty list of numbers or "
                             f"a range {{start, stop, num, scale}}, got {value!r}")
        values = np.asarray(items, dtype=float)
    if integer:
        values = np.round(values)
    if not np.all(np.isfinite(values) & (values >= low)):
        raise ValueError(f"sweep.{key} values must be finite and at least {low:g}, got "
                         f"{values[~(np.isfinite(values) & (values >= low))][:3].tolist()}")
    # Duplicates would repeat rows (a rounded log range of chip counts makes them).
    return tuple(dict.fromkeys(float(v) for v in values))


def metric_names(value) -> tuple[str, ...]:
    """`serving.COLUMNS` names for the spec's metrics (aliases and `Metrics` fields mapped).

    Example:
        >>> metric_names(["tput_per_chip", "power_w", "ttft"])
        ('tput_per_chip_total', 'power_w_modelled', 'ttft_s')
    """
    out = []
    for name in _names(value, "metrics"):
        column = METRIC_ALIASES.get(name, COLUMNS.get(name, name))
        if column not in COLUMNS.values() or column == "concurrency":
            valid = sorted(set(COLUMNS.values()) - {"concurrency"} | set(METRIC_ALIASES))
            raise ValueError(f"sweep.metrics: unknown metric {name!r}; valid metrics: "
                             f"{', '.join(valid)}")
        if column not in out:
            out.append(column)
    return tuple(out)


def runtime_settings(value) -> tuple[tuple[str, float], ...]:
    """The `[sweep.runtime]` table as sorted (field, value) pairs of `design.Runtime`'s
    numeric fields (one value each; their ranges are checked when the grid is expanded).

    Example:
        >>> runtime_settings({"step_overhead": 0.002, "max_running": 256})
        (('max_running', 256.0), ('step_overhead', 0.002))
    """
    fields = [f.name for f in dataclasses.fields(Runtime) if f.name != "framework"]
    if not isinstance(value, dict):
        raise ValueError(f"sweep.runtime must be a table of Runtime fields ({', '.join(fields)})"
                         f", got {value!r}")
    out = []
    for name, number in value.items():
        if name not in fields:
            raise ValueError(f"sweep.runtime.{name}: unknown field; valid fields: "
                             f"{', '.join(fields)}")
        if not isinstance(number, (int, float)) or isinstance(number, bool):
            raise ValueError(f"sweep.runtime.{name} must be a number, got {number!r}")
        out.append((name, float(number)))
    return tuple(sorted(out))


def _choice(value, key: str, default: str) -> str | tuple[str, ...]:
    if isinstance(value, str) and value.strip().lower() == default:
        return default
    return _names(value, key)


def _number(found: dict, key: str, valid: Range, meaning: str) -> float:
    """`found[key]` (0 when absent) as a float, or ValueError naming `sweep.key`, its range
    (`checks.Range`, the specs' own) and `meaning`."""
    value = found.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not valid.holds(np.float64(value)):
        both = valid.low > -math.inf and valid.high < math.inf
        raise ValueError(f"sweep.{key} must be a {'' if both else 'finite '}number "
                         f"{valid.describe()} ({meaning}), got {value!r}")
    return float(value)


def from_dict(data: dict) -> SweepSpec:
    """A `SweepSpec` from the parsed TOML document (its `[sweep]` table, or the top level
    when there is none).

    Raises:
        ValueError: naming the key: unknown or repeated keys, missing required ones, values
            of the wrong kind, layout names `Layout.parse` cannot read.
    """
    table = data.get("sweep", data) if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise ValueError("the sweep spec needs a [sweep] table")
    alias = {a: key for key, names in KEYS.items() for a in (key, *names)}
    found: dict = {}
    for name, value in table.items():
        if name not in alias:
            raise ValueError(f"sweep.{name}: unknown key; valid keys: {', '.join(KEYS)}")
        key = alias[name]
        if key in found:
            raise ValueError(f"sweep.{name}: {key!r} is given twice")
        found[key] = value
    missing = [k for k in ("models", "chips", "chip_counts", "isl", "osl", "concurrency")
               if k not in found]
    if missing:
        raise ValueError(f"the sweep spec lacks {', '.join('sweep.' + k for k in missing)}")
    layouts = _choice(found.get("layouts", "all"), "layouts", "all")
    if layouts != "all":
        layouts = tuple(Layout.parse(name).describe() for name in layouts)
    for key in ("emulate", "allow_long_context"):
        if not isinstance(found.get(key, False), bool):
            raise ValueError(f"sweep.{key} must be true or false, got {found[key]!r}")
    spread = _number(found, "output_cv2", NON_NEGATIVE, "Var/mean^2 of the output lengths")
    cached = _number(found, "cached_fraction", Range(low=0.0, high=1.0, high_open=True),
                     "the share of each prompt found in the prefix cache")
    return SweepSpec(
        output_cv2=spread, cached_fraction=cached,
        runtime=runtime_settings(found.get("runtime", {})),
        models=_names(found["models"], "models"), chips=_names(found["chips"], "chips"),
        chip_counts=tuple(int(c) for c in axis(found["chip_counts"], "chip_counts",
                                                integer=True, low=1)),
        isl=axis(found["isl"], "isl", integer=True, low=1),
        osl=axis(found["osl"], "osl", integer=True, low=2),
        concurrency=axis(found["concurrency"], "concurrency", low=1e-9),
        layouts=layouts, precision=_choice(found.get("precision", "default"), "precision",
                                           "default"),
        metrics=metric_names(found.get("metrics", list(DEFAULT_METRICS))),
        emulate=found.get("emulate", False),
        allow_long_context=found.get("allow_long_context", False))


def load(path: str) -> SweepSpec:
    """Read a TOML sweep spec (`tomllib`, `tomli` before Python 3.11).

    Raises:
        ValueError: the file cannot be read or parsed (with the parser's line and column),
            or `from_dict` refuses it.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:   # pragma: no cover
        import tomli as tomllib
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except OSError as error:
        raise ValueError(f"sweep spec {path!r}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"sweep spec {path!r} is not valid TOML: {error}") from None
    return from_dict(data)
