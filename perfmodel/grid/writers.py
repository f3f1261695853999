"""Sweep output written as it comes, chunk by chunk, so an interrupted sweep can resume.

Beside the output `OUT` a state file `OUT.sweep.json` records the spec's digest, the chunk
size, the columns, the next chunk to compute and (CSV) the length of the file holding the
finished chunks. A chunk is committed by appending its rows, flushing them to disk, then
replacing the state file (write to a temporary file, `os.replace`): a process killed at any
moment leaves a state that names only rows fully on disk, and `--resume` cuts anything past
them before it continues.

- CSV (`CsvStore`): rows appended to `OUT`; the file is valid after every chunk.
- Parquet (`ParquetStore`, needs `pyarrow`): each chunk is one file in `OUT.chunks/`
  (written whole, then renamed); `close` gathers them into `OUT`, one row group per chunk,
  so `OUT` holds every finished row after a normal end or an interrupt (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

#: Output formats by file extension.
EXTENSIONS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


def output_format(path: str) -> str:
    """"csv" or "parquet" from the extension of `path`.

    Raises:
        ValueError: another extension; parquet without `pyarrow` installed.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise ValueError(f"--out {path!r}: the file name must end in .csv or .parquet")
    if EXTENSIONS[ext] == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError("--out .parquet needs pyarrow: pip install 'perfmodel[parquet]' "
                             "(or write .csv)") from None
    return EXTENSIONS[ext]


def state_path(path: str) -> str:
    return path + ".sweep.json"


def read_state(path: str) -> dict | None:
    """The state of a sweep writing `path`, or None when there is none."""
    try:
        with open(state_path(path)) as file:
            return json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"{state_path(path)}: cannot read the sweep state ({error})") from None


def _write_state(path: str, state: dict) -> None:
    target = state_path(path)
    tmp = target + ".tmp"
    with open(tmp, "w") as file:
        json.dump(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, target)


def _csv_field(text: str) -> str:
    if any(c in text for c in ',"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text


def csv_text(table: dict) -> str:
    """Rows of `table` ({column: array}) as CSV lines (no header), each ending in a newline.

    Floats are written in the shortest form that reads back to the same value (NumPy's
    `str`), NaN as an empty field, booleans as true/false, integers as integers.

    Example:
        >>> csv_text({"a": np.asarray([1.5, np.nan]), "b": np.asarray([True, False])})
        '1.5,true\\n,false\\n'
    """
    columns = []
    for values in table.values():
        values = np.asarray(values)
        if values.dtype == bool:
            text = np.where(values, "true", "false").tolist()
        elif values.dtype.kind in "iu":
            text = list(map(str, values.tolist()))
        elif values.dtype.kind == "f":
            # float.__repr__ is the shortest round-trip form (NumPy's str gives the same).
            text = list(map(float.__repr__, values.astype(float).tolist()))
            for i in np.flatnonzero(np.isnan(values)).tolist():
                text[i] = ""
        else:
            escaped: dict = {}
            text = [escaped[v] if v in escaped else escaped.setdefault(v, _csv_field(str(v)))
                    for v in values.tolist()]
        columns.append(text)
    if not columns or not columns[0]:
        return ""
    return "\n".join(map(",".join, zip(*columns, strict=True))) + "\n"


class CsvStore:
    """CSV rows appended chunk by chunk, with the sweep state beside them."""

    def __init__(self, path: str, header: dict, state: dict | None):
        self.path = path
        if state is None:
            self.state = dict(header, next_chunk=0, rows=0, complete=False)
            with open(path, "w") as file:
                file.write(",".join(header["columns"]) + "\n")
                file.flush()
                os.fsync(file.fileno())
                self.state["bytes"] = file.tell()
            _write_state(path, self.state)
        else:
            self.state = state
        self.file = open(path, "r+")
        # Rows of a chunk whose commit did not finish are cut off.
        self.file.truncate(self.state["bytes"])
        self.file.seek(self.state["bytes"])

    def append(self, next_chunk: int, table: dict) -> None:
        """Write `table`'s rows and record `next_chunk` as the next one to compute."""
        text = csv_text(table)
        self.file.write(text)
        self.file.flush()
        os.fsync(self.file.fileno())
        rows = len(next(iter(table.values()))) if table else 0
        self.state.update(next_chunk=next_chunk, rows=self.state["rows"] + rows,
                          bytes=self.file.tell())
        _write_state(self.path, self.state)

    def close(self, complete: bool) -> None:
        self.file.close()
        if complete:
            self.state["complete"] = True
            _write_state(self.path, self.state)


def _arrow_table(table: dict):
    import pyarrow as pa

    return pa.table({k: pa.array(np.asarray(v).tolist() if np.asarray(v).dtype == object
                                 else np.asarray(v)) for k, v in table.items()})


class ParquetStore:
    """One Parquet file per chunk in `OUT.chunks/`, gathered into `OUT` on `close`."""

    def __init__(self, path: str, header: dict, state: dict | None):
        self.path = path
        self.folder = path + ".chunks"
        if state is None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.state = dict(header, next_chunk=0, rows=0, complete=False, parts=[])
            _write_state(path, self.state)
        else:
            self.state = state
        os.makedirs(self.folder, exist_ok=True)

    def append(self, next_chunk: int, table: dict) -> None:
        import pyarrow.parquet as pq

        name = f"{len(self.state['parts']):08d}.parquet"
        tmp = os.path.join(self.folder, name + ".tmp")
        pq.write_table(_arrow_table(table), tmp)
        os.replace(tmp, os.path.join(self.folder, name))
        rows = len(next(iter(table.values()))) if table else 0
        self.state.update(next_chunk=next_chunk, rows=self.state["rows"] + rows,
                          parts=self.state["parts"] + [name])
        _write_state(self.path, self.state)

    def close(self, complete: bool) -> None:
        """Gather the finished chunks into `OUT` (also after an interrupt)."""
        import pyarrow.parquet as pq

        tmp = self.path + ".tmp"
        writer = None
        for name in self.state["parts"]:
            part = pq.read_table(os.path.join(self.folder, name))
            if writer is None:
                writer = pq.ParquetWriter(tmp, part.schema)
            writer.write_table(part)
        if writer is None:
            return
        writer.close()
        os.replace(tmp, self.path)
        if complete:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.state["complete"] = True
            _write_state(self.path, self.state)


def open_store(path: str, header: dict, resume: bool, overwrite: bool):
    """The store writing `path`: a new one, or with `resume` the one an earlier run left.

    Args:
        path: the output file (.csv or .parquet).
        header: what the rows depend on (`digest`, `chunk_size`, `columns`, `process`);
            a resumed sweep must match it.
        resume: continue the sweep whose state is beside `path` (a fresh start when there
            is none).
        overwrite: start again even if an unfinished sweep's state is there.

    Raises:
        ValueError: an unfinished sweep is there and neither `resume` nor `overwrite`; the
            state there is of another spec, chunk size, columns or process share.
    """
    fmt = output_format(path)
    state = read_state(path)
    if state is not None and not resume and not overwrite and not state.get("complete"):
        raise ValueError(f"--out {path!r} holds an unfinished sweep ({state['rows']} rows); "
                         "pass --resume to continue it or --overwrite to start again")
    if not resume:
        state = None
    if state is not None:
        for key in ("digest", "chunk_size", "columns", "process"):
            if state.get(key) != header[key]:
                raise ValueError(f"--resume: the sweep at {path!r} was run with another "
                                 f"{key.replace('_', ' ')} ({state.get(key)!r}, now "
                                 f"{header[key]!r}); use the same spec and options, or "
                                 "--overwrite")
        if fmt == "csv" and not os.path.exists(path):
            raise ValueError(f"--resume: {path!r} is gone but its sweep state is there; "
                             "pass --overwrite to start again")
    return (CsvStore if fmt == "csv" else ParquetStore)(path, header, state)


def merge(out: str, parts: list[str], counts: list[list[int]]) -> int:
    """Merge the part files of several processes into `out`, rows in chunk order.

    Args:
        out: the merged file (.csv or .parquet, as the parts).
        parts: part file of each process.
        counts: for each process, the rows of each of its chunks in order; chunk i of the
            grid is chunk i // n of process i % n.

    Returns:
        Rows written.
    """
    n = len(parts)
    order = [(i % n, i // n) for i in range(sum(len(c) for c in counts))]
    tmp = out + ".tmp"
    if output_format(out) == "csv":
        files = [open(p) for p in parts]
        try:
            header = [f.readline() for f in files][0]
            with open(tmp, "w") as target:
                target.write(header)
                for process, k in order:
                    for _ in range(counts[process][k]):
                        target.write(files[process].readline())
        finally:
            for f in files:
                f.close()
    else:
        import pyarrow.parquet as pq

        tables = [pq.read_table(p) for p in parts]
        offsets = [np.concatenate([[0], np.cumsum(c)]).astype(int) for c in counts]
        writer = pq.ParquetWriter(tmp, tables[0].schema)
        for process, k in order:
            start = int(offsets[process][k])
            writer.write_table(tables[process].slice(start, counts[process][k]))
        writer.close()
    os.replace(tmp, out)
    return sum(sum(c) for c in counts)
