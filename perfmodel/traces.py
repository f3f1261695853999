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


def vllm_engine(meta_path: str | os.PathLike, chip=None, framework: str = "vllm"):
    """(model, chip, design, policy) of a vLLM run from its `meta.json` (the format of the
    shared per-request runs): model, tensor parallelism, `max_num_seqs`,
    `max_num_batched_tokens`, `long_prefill_token_threshold`, KV blocks, block size, prefix
    caching and `gpu_memory_utilization` where recorded, with `framework`'s fitted runtime
    terms (`fitted.runtime_for`). Where the file records no KV blocks, the cache is what fits
    next to the weights and vLLM's profiling-pass activations
    (`kvcache.profile_activation_bytes`).

    Args:
        meta_path: the run's meta.json.
        chip: a `Chip` or preset name; default: the device the file names
            (`hardware.device_name`).

    Raises:
        ValueError: no chip given or named, an unknown model or chip, a dtype other than
            bfloat16, naming it.
    """
    from .design import Design, Layout, precision
    from .fitted import runtime_for
    from .kvcache import profile_activation_bytes
    from .presets import find_model, get_chip
    from .simulate import Policy

    with open(meta_path) as handle:
        meta = json.load(handle)
    kwargs = meta.get("engine_kwargs", {})
    scheduler = meta.get("resolved_config", {}).get("scheduler_config", {})
    cache = meta.get("kv_cache") or {}
    if "model" not in meta:
        raise ValueError(f"{meta_path}: no 'model' in the engine metadata")
    model = find_model(meta["model"])
    if chip is None:
        chip = meta.get("hardware", {}).get("device_name")
        if chip is None:
            raise ValueError(f"{meta_path} names no device (hardware.device_name): give the "
                             "chip")
    if isinstance(chip, str):
        chip = get_chip(chip)
    dtype = kwargs.get("dtype", "auto")
    if dtype not in ("bfloat16", "auto"):
        raise ValueError(f"{meta_path}: dtype {dtype!r} is not modelled (bfloat16 only)")
    # vLLM's data parallelism runs data_parallel_size engines (replicas of the tp group).
    layout = Layout(tp=int(kwargs.get("tensor_parallel_size", 1)),
                    replicas=int(kwargs.get("data_parallel_size", 1)))
    prec = precision(chip, model, "bf16")
    seqs = float(scheduler.get("max_num_seqs", kwargs.get("max_num_seqs", 256)))
    tokens = float(scheduler.get("max_num_batched_tokens",
                                 kwargs.get("max_num_batched_tokens", 2048)))
    # vLLM sizes its KV cache after a profiling pass over max_num_batched_tokens tokens.
    reserve = profile_activation_bytes(model, layout, prec, tokens, seqs)
    runtime = runtime_for(framework, chip.family, max_batched_tokens=tokens, max_running=seqs,
                          memory_fraction=float(cache.get("gpu_memory_utilization", 0.9)),
                          activation_reserve=reserve)
    design = Design(concurrency=1.0, layout=layout, precision=prec, runtime=runtime)
    threshold = float(scheduler.get("long_prefill_token_threshold", 0) or np.inf)
    blocks = cache.get("num_gpu_blocks")
    policy = Policy(max_num_seqs=seqs, max_num_batched_tokens=tokens,
                    long_prefill_token_threshold=threshold,
                    kv_blocks=float(blocks) if blocks else np.inf,
                    block_size=float(cache.get("block_size", 16)),
                    reserve_full_prompt=bool(scheduler.get("scheduler_reserve_full_isl", True)),
                    prefix_caching=bool(cache.get("enable_prefix_caching", True)))
    return model, chip, design, policy
