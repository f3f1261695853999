"""Run a sweep: expand the spec, evaluate its chunks, write the rows as they come.

`run_sweep` is what `perfmodel sweep` calls. Each finished chunk is committed to the output
(`writers`) before the next one starts; Ctrl-C or SIGTERM stops the sweep between two
commits (a signal that arrives while a chunk is being committed waits for the commit), so
the output holds exactly the rows of the finished chunks and `resume=True` continues from
the first unfinished one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time

import numpy as np

from ..progress import bar
from .evaluate import finish, launch
from .expand import Grid, chunks, expand
from .shard import part_path, placement, share
from .spec import SweepSpec
from .writers import merge, open_store, output_format, read_state

#: Columns every row starts with: the point's inputs.
INPUT_COLUMNS = ("model", "chip", "chips", "layout", "precision", "isl", "osl", "concurrency")

#: Chunk sizes `chunk_size` chooses between (points per device). The largest is the
#: default wherever memory allows, so sweeps on any number of devices cut the grid into
#: the same chunks (and give the same rows, `evaluate.evaluate`).
MIN_CHUNK, MAX_CHUNK = 1024, 1 << 16

#: Memory a point takes while its chunk is evaluated, an upper bound from peak RSS
#: measured with `/usr/bin/time -v` (README "Sweeps") (bytes).
BYTES_PER_POINT = 8192

#: Fraction of the available memory the chunks of one step may take.
MEMORY_SHARE = 0.25


def chunk_size(available: float | None = None, devices: int = 1) -> int:
    """Points per chunk: a power of two between `MIN_CHUNK` and `MAX_CHUNK` such that
    `devices` chunks at once take at most `MEMORY_SHARE` of the available memory (the
    host's: CPU devices share it, and it bounds what the results take on the way out).

    Args:
        available: bytes of memory free for the sweep (default: MemAvailable of
            /proc/meminfo, else 2 GB).
        devices: chunks evaluated at once, one per device.

    Example:
        >>> chunk_size(32e9), chunk_size(32e9, devices=8), chunk_size(64e6)
        (65536, 65536, 1024)
    """
    if available is None:
        available = _available_memory()
    fit = int(available * MEMORY_SHARE // (BYTES_PER_POINT * devices))
    size = MIN_CHUNK
    while size * 2 <= min(fit, MAX_CHUNK):
        size *= 2
    return size


def _available_memory() -> float:
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024.0
    except OSError:
        pass
    return 2e9


@dataclasses.dataclass(frozen=True)
class Summary:
    """What a sweep did.

    Attributes:
        path: the file written (this process's part when several run).
        points: points of the grid.
        rows: rows in `path` now.
        computed: points computed in this run.
        feasible: feasible points among them.
        chunks: chunks of this process computed in this run.
        complete: whether every chunk of this process is in `path`.
        seconds: wall time of this run (s).
        merged: rows of the merged file, when process 0 merged the parts (else None).
    """

    path: str
    points: int
    rows: int
    computed: int
    feasible: int
    chunks: int
    complete: bool
    seconds: float
    merged: int | None = None


class _Signals:
    """SIGINT and SIGTERM as KeyboardInterrupt, held back while a chunk is committed."""

    def __init__(self):
        self.committing = False
        self.pending = None
        self.saved = {}

    def _handler(self, signum, frame):
        if self.committing:
            self.pending = signum
        else:
            raise KeyboardInterrupt(signal.Signals(signum).name)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)

    @contextlib.contextmanager
    def commit(self):
        self.committing = True
        try:
            yield
        finally:
            self.committing = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise KeyboardInterrupt(signal.Signals(signum).name)


def _table(grid: Grid, group_index: int, values: dict) -> dict:
    group = grid.groups[group_index]
    cells = values["cell"]
    table = {"model": np.full(cells.size, group.model.name, dtype=object),
             "chip": np.full(cells.size, group.chip.name, dtype=object),
             "chips": np.asarray([c.chips for c in group.cells], dtype=np.int64)[cells],
             "layout": np.asarray([c.layout for c in group.cells], dtype=object)[cells],
             "precision": np.asarray([c.precision for c in group.cells], dtype=object)[cells],
             "isl": values["isl"].astype(np.int64), "osl": values["osl"].astype(np.int64),
             "concurrency": values["concurrency"]}
    for key in grid.spec.metrics:
        table[key] = values[key]
    table["feasible"] = values["feasible"]
    table["reason"] = values["reason"]
    return table


def run_sweep(spec: SweepSpec | Grid, out: str, *, resume: bool = False,
              overwrite: bool = False, size: int | None = None, devices: int | None = None,
              process: int = 0, processes: int = 1, progress: bool | None = None,
              merge_timeout: float = 600.0, after_chunk=None) -> Summary:
    """Evaluate every point of a sweep and write one row per point to `out`.

    Args:
        spec: a `SweepSpec` (or its expanded `Grid`).
        out: a .csv or .parquet file.
        resume: continue the unfinished sweep at `out` (its state file `out.sweep.json`).
        overwrite: start again over an unfinished sweep.
        size: points per chunk (default: a resumed sweep's, else `chunk_size()`).
        devices: local devices to shard each chunk over (default: all).
        process, processes: this process's share (chunks whose index is `process` modulo
            `processes`); with several, each writes `shard.part_path(out, ...)` and process
            0 merges the parts into `out` once all are complete (it waits up to
            `merge_timeout` seconds; the parts need a shared file system).
        progress: a bar with an ETA on standard error (None: on a terminal).
        after_chunk: called with the index of each committed chunk (tests use it to
            interrupt a sweep).

    Returns:
        A `Summary`.

    Raises:
        ValueError: a bad output path, spec or resume state (see `writers.open_store`).
        KeyboardInterrupt: Ctrl-C or SIGTERM; `out` then holds every finished chunk.
    """
    start_time = time.perf_counter()
    output_format(out)
    place = placement(devices)
    grid = spec if isinstance(spec, Grid) else expand(spec)
    path = part_path(out, process, processes)
    if size is None:
        state = read_state(path) if resume else None
        size = state["chunk_size"] if state else chunk_size(devices=place.count)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"chunk size must be a positive integer, got {size!r}")
    place = placement(devices)
    plan = chunks(grid, size)
    mine = [c for c in plan if share(c.index, process, processes)]
    columns = list(INPUT_COLUMNS) + list(grid.spec.metrics) + ["feasible", "reason"]
    header = {"digest": grid.spec.digest(), "chunk_size": size, "columns": columns,
              "process": [process, processes]}
    store = open_store(path, header, resume, overwrite)
    todo = [c for c in mine if c.index >= store.state["next_chunk"]]
    # The chunk after each one of this process: what its state records once it is written.
    following = {c.index: n.index for c, n in zip(todo, todo[1:], strict=False)}
    if todo:
        following[todo[-1].index] = len(plan)
    feasible, done, computed, complete = 0, 0, 0, False
    label = os.path.basename(out) + (f" [{process}/{processes}]" if processes > 1 else "")
    try:
        with _Signals() as signals, bar(sum(c.stop - c.start for c in todo), label,
                                        progress, unit="pt") as shown:
            # One step ahead: the next kernel runs while this step's rows are written.
            pending = None
            for step in [*_steps(todo, place.count), None]:
                ahead = launch(grid, step, place, size) if step is not None else None
                if pending is not None:
                    for chunk, values in zip(pending.chunks, finish(pending.launched),
                                             strict=True):
                        with signals.commit():
                            store.append(following[chunk.index],
                                         _table(grid, chunk.group, values))
                        feasible += int(values["feasible"].sum())
                        done += 1
                        computed += chunk.stop - chunk.start
                        shown.update(chunk.stop - chunk.start)
                        if after_chunk is not None:
                            after_chunk(chunk.index)
                pending = _Step(step, ahead) if step is not None else None
        complete = True
    finally:
        store.close(complete)
    merged = None
    if processes > 1 and process == 0:
        merged = _merge_parts(out, plan, processes, merge_timeout)
    return Summary(path=path, points=grid.size, rows=store.state["rows"], computed=computed,
                   feasible=feasible,
                   chunks=done, complete=complete,
                   seconds=time.perf_counter() - start_time, merged=merged)


@dataclasses.dataclass(frozen=True)
class _Step:
    chunks: list
    launched: object


def _steps(todo, count: int):
    """`todo` in runs of up to `count` chunks of one group: one kernel call each."""
    step = []
    for chunk in todo:
        if step and (len(step) == count or chunk.group != step[0].group):
            yield step
            step = []
        step.append(chunk)
    if step:
        yield step


def _merge_parts(out: str, plan, processes: int, timeout: float) -> int:
    parts = [part_path(out, p, processes) for p in range(processes)]
    deadline = time.monotonic() + timeout
    while True:
        states = [read_state(p) for p in parts]
        if all(s is not None and s.get("complete") for s in states):
            break
        if time.monotonic() > deadline:
            missing = [p for p, s in zip(parts, states, strict=True)
                       if not (s and s.get("complete"))]
            raise ValueError(f"the parts {missing} did not complete within {timeout:g} s; "
                             "rerun process 0 with --resume once they have")
        time.sleep(0.2)
    counts = [[c.stop - c.start for c in plan if share(c.index, p, processes)]
              for p in range(processes)]
    return merge(out, parts, counts)
