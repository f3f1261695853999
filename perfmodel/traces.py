"""Request traces: arrival times and lengths from the shared traces' file formats.

- vLLM per-request JSONL (one object a line): `arrival_time` (s, any origin: epoch times are
  fine), `input_toks`, `output_toks`; other keys (the measured timestamps) are not read.
- Mooncake JSONL (kvcache-ai/Mooncake FAST25 traces): `timestamp` (ms), `input_length`,
  `output_length`.
- Azure LLM inference CSV (Azure/AzurePublicDataset 2023): `TIMESTAMP`
  ("2023-11-16 18:17:03.9799600"), `ContextTokens`, `GeneratedTokens`.

Times are shifted to start at 0 and requests sorted by arrival.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "t.jsonl")
    >>> with open(path, "w") as f:
    ...     _ = f.write('{"timestamp": 0, "input_length": 10, "output_length": 3}\\n'
    ...                 '{"timestamp": 500, "input_length": 20, "output_length": 4}\\n')
    >>> read_trace(path)["arrival"].tolist()
    [0.0, 0.5]
"""

from __future__ import annotations

import csv
import datetime
import json
import os

import numpy as np

from .simulate import Requests, trace

#: Each JSONL format: (time key, seconds per unit, input key, output key).
_JSONL_FORMATS = {
    "vllm": ("arrival_time", 1.0, "input_toks", "output_toks"),
    "mooncake": ("timestamp", 1e-3, "input_length", "output_length"),
}
_AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _azure_time(text: str) -> float:
    date, _, fraction = text.strip().partition(".")
    base = datetime.datetime.strptime(date, "%Y-%m-%d %H:%M:%S")
    base = base.replace(tzinfo=datetime.timezone.utc).timestamp()
    return base + (float("0." + fraction) if fraction else 0.0)


def read_trace(path: str | os.PathLike) -> dict:
    """Arrival times and lengths of a trace file, as NumPy arrays.

    Returns:
        {"arrival" (s, from 0, sorted), "input_len", "output_len" (tokens), "format"}.

    Raises:
        ValueError: an empty file, or one in none of the formats, naming the fields found
            and the ones each format needs.
    """
    path = os.fspath(path)
    with open(path) as handle:
        text = handle.read()
    if path.endswith(".csv"):
        rows = list(csv.DictReader(text.splitlines()))
        if not rows:
            raise ValueError(f"{path}: no requests")
        if not set(_AZURE) <= set(rows[0]):
            raise ValueError(f"{path}: a CSV trace needs columns {', '.join(_AZURE)}; found "
                             f"{', '.join(rows[0])}")
        times = [_azure_time(r[_AZURE[0]]) for r in rows]
        inputs = [float(r[_AZURE[1]]) for r in rows]
        outputs = [float(r[_AZURE[2]]) for r in rows]
        kind = "azure"
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        if not records:
            raise ValueError(f"{path}: no requests")
        keys = set(records[0])
        kind = next((k for k, (t, _, i, o) in _JSONL_FORMATS.items() if {t, i, o} <= keys),
                    None)
        if kind is None:
            need = "; ".join(f"{k}: {', '.join((t, i, o))}"
                             for k, (t, _, i, o) in _JSONL_FORMATS.items())
            raise ValueError(f"{path}: unknown JSONL trace (fields {', '.join(sorted(keys))});"
                             f" expected {need}")
        t, unit, i, o = _JSONL_FORMATS[kind]
        times = [float(r[t]) * unit for r in records]
        inputs = [float(r[i]) for r in records]
        outputs = [float(r[o]) for r in records]
    times = np.asarray(times, dtype=float)
    order = np.argsort(times, kind="stable")
    return {"arrival": times[order] - times[order][0],
            "input_len": np.asarray(inputs)[order], "output_len": np.asarray(outputs)[order],
            "format": kind}


def load_trace(path: str | os.PathLike, size: int | None = None,
               limit: int | None = None) -> Requests:
    """A trace file as simulator `Requests` (its first `limit` requests, padded to `size`)."""
    data = read_trace(path)
    cut = slice(None, limit)
    return trace(data["arrival"][cut], data["input_len"][cut], data["output_len"][cut],
                 size=size)
