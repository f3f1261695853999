"""Published measurement tables: loading, validation, and the mapping of a benchmark row to
the specs the model predicts from (model, chip, workload, design).

Every loader checks the columns it needs and the values in them, and a bad file raises
`DataError` naming the file, the line and the column, before anything is traced.

Interpretation of InferenceMAX rows (documented assumptions, see calibration/README.md):

- Aggregated rows: one instance of `tp` chips, `ep` expert-parallel, DP attention as logged;
  `conc` is the number of clients of that instance.
- Disaggregated rows: `num_*_gpu / *_num_workers` chips per worker. Where the logged
  `*_tp * *_num_workers` disagrees with `num_*_gpu` (Dynamo-SGLang and SGLang-disagg log
  tp = 1 for wide-EP DP-attention workers), the worker size wins: tp = chips per worker, and
  ep = tp when DP attention is on (wide EP, as those recipes run), else the logged ep if it
  divides tp.
- MTP rows: the optional `mtp_draft_tokens` column, the draft tokens the run's recipe set
  (Dynamo-TRT's `DECODE_MTP_SIZE`, SGLang's `--speculative-num-steps`); empty is
  `MTP_DRAFT_TOKENS` (assumption: the InferenceMAX recipes run 1-3 MTP steps), at a
  per-token acceptance the latency fit fits per framework
  (`calibration.params.FRAMEWORK_FIELDS` "mtp_acceptance"), from the prior
  `MTP_ACCEPTANCE` (DeepSeek-V3 reports 85-90 % acceptance of the second token on real
  text; these prompts are random tokens).
- KV-cache format: the optional `kv_cache_dtype` column (what the run's recipe set:
  `--kv-cache-dtype fp8_e4m3`, `kv_cache_config.dtype: fp8`); empty, missing or "auto" is
  the engine's default, the model's BF16. The shipped InferenceMAX rows carry the
  InferenceX recipes' value per group (sources in calibration/README.md). Attention math
  follows from it (`design.attention_class`: FP8 for MLA with an FP8 cache on
  Blackwell, BF16 otherwise).
- Scheduler polling: the optional `poll_steps` column, the decode steps between the
  scheduler's looks for new requests (SGLang's `--scheduler-recv-interval`); empty or
  missing is 1, the engines' default. The
  shipped rows carry the InferenceX recipes' value (calibration/README.md).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass

from .formats import ALIASES, resolve_format

#: Draft tokens assumed for InferenceMAX rows with MTP, and the prior of the per-token
#: acceptance the latency fit fits for them.
MTP_DRAFT_TOKENS = 2.0
MTP_ACCEPTANCE = 0.7

#: A stalled run (`BenchRow.stalled`): p99 TTFT above this many seconds and above
#: `STALL_RATIO` x the run's median TTFT.
STALL_SECONDS = 30.0
STALL_RATIO = 20.0

#: Columns of an InferenceMAX row the model reads (measured columns are optional).
INFERENCEMAX_INPUTS = ("model", "hardware", "framework", "precision", "isl", "osl", "conc")
INFERENCEMAX_MEASURED = ("tput_per_gpu", "output_tput_per_gpu", "median_ttft_s",
                         "median_tpot_s", "median_e2el_s", "median_intvty_tok_s_user",
                         "p99_ttft_s", "p99_tpot_s")


class DataError(ValueError):
    """A data file is missing, corrupt or incomplete; the message names file, line, column."""


@dataclass(frozen=True)
class Table:
    """Rows of a CSV file with their line numbers (header = line 1)."""

    path: str
    columns: tuple[str, ...]
    rows: tuple[dict, ...]
    lines: tuple[int, ...]

    def where(self, i: int, column: str) -> str:
        return f"{self.path}, line {self.lines[i]}, column {column!r}"


def read_table(path: str | os.PathLike, required: tuple[str, ...] = ()) -> Table:
    """Read a CSV file, checking the header has every `required` column.

    Raises:
        DataError: missing or unreadable file, a folder, text that is not UTF-8, empty
            file, ragged row or missing column, naming them.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "t.csv"
        >>> _ = p.write_text("a,b\\n1,2\\n")
        >>> read_table(p, ("a",)).rows[0]["b"]
        '2'
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise DataError(f"{path}: is a folder, not a CSV file")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    try:
        return _read_table(path, required)
    except UnicodeDecodeError as error:
        byte = error.object[error.start:error.start + 1]
        raise DataError(f"{path}: not UTF-8 text (byte {error.start} is {byte!r}); a CSV "
                        "file was expected") from None
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror})") from None


def _read_table(path: str, required: tuple[str, ...]) -> Table:
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        try:
            header = next(reader)
        except StopIteration:
            raise DataError(f"{path}: empty file (no header line)") from None
        header = [h.strip() for h in header]
        twice = sorted({h for h in header if header.count(h) > 1})
        if twice:
            raise DataError(f"{path}, line 1: column(s) {', '.join(map(repr, twice))} appear "
                            "more than once; keep one of each")
        missing = [c for c in required if c not in header]
        if missing:
            raise DataError(f"{path}, line 1: missing column(s) {', '.join(map(repr, missing))}")
        rows, lines = [], []
        for cells in reader:
            line = reader.line_num
            if not cells or all(not c.strip() for c in cells):
                continue
            if len(cells) != len(header):
                raise DataError(f"{path}, line {line}: {len(cells)} fields, the header has "
                                f"{len(header)} (truncated or corrupt row)")
            rows.append(dict(zip(header, (c.strip() for c in cells), strict=True)))
            lines.append(line)
    return Table(path=path, columns=tuple(header), rows=tuple(rows), lines=tuple(lines))


def number(table: Table, i: int, column: str, *, positive: bool = False,
           optional: bool = False) -> float | None:
    """The float in row `i`, `column`; None for an empty optional cell.

    Raises:
        DataError: an empty required cell, text that is not a number, a NaN/inf, or a
            non-positive value where `positive`, naming file, line and column.
    """
    text = table.rows[i].get(column, "")
    if text == "":
        if optional:
            return None
        raise DataError(f"{table.where(i, column)}: empty, a number is required")
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{table.where(i, column)}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise DataError(f"{table.where(i, column)}: {text!r} is not finite")
    if positive and value <= 0:
        raise DataError(f"{table.where(i, column)}: {value!r} must be > 0")
    return value


def flag(table: Table, i: int, column: str, default: bool = False) -> bool:
    """A True/False cell (empty -> `default`)."""
    text = table.rows[i].get(column, "").lower()
    if text in ("", "nan", "none"):
        return default
    if text in ("true", "1", "1.0", "yes"):
        return True
    if text in ("false", "0", "0.0", "no"):
        return False
    raise DataError(f"{table.where(i, column)}: {text!r} is not True/False")


@dataclass(frozen=True)
class PoolLayout:
    """Parallel layout of one pool, as plain ints (turned into `perfmodel.Layout`)."""

    tp: int
    ep: int
    dp_attention: bool
    replicas: int = 1


@dataclass(frozen=True)
class BenchRow:
    """One InferenceMAX-style row, interpreted; `measured` holds whatever was measured."""

    index: int
    line: int
    model: str
    hardware: str
    framework: str
    precision: str
    isl: float
    osl: float
    conc: float
    mtp: bool
    layout: PoolLayout | None
    prefill: PoolLayout | None
    decode: PoolLayout | None
    measured: dict
    range_ratio: float = 0.8
    """Shortest request over the longest of the row's input and output lengths
    (InferenceMAX's random range ratio 0.8; 1 for fixed lengths)."""
    first_wave: float = 0.1
    """`workload.Workload.first_wave_fraction` of the row's load (an opening burst of a
    benchmark client; ~0 for an Offline run that keeps its engine full)."""
    max_batched_tokens: float = 8192.0
    """The engine's token budget per step (`design.Runtime.max_batched_tokens`; tokens);
    the InferenceMAX rows do not record it, and take the default."""
    kv: str | None = None
    """KV-cache format where known (`design.precision`'s `kv`); None: BF16, the engines'
    "auto", which the InferenceMAX rows do not record."""
    poll_steps: float = 1.0
    """Decode steps between the scheduler's looks for new requests
    (`design.Runtime.poll_steps`; the optional `poll_steps` column; 1, the engines'
    default, where empty) (steps)."""
    mtp_draft_tokens: float | None = None
    """The optional `mtp_draft_tokens` cell: the draft tokens the row's recipe set (an MTP
    row only); None where empty (tokens)."""

    @property
    def draft_tokens(self) -> float:
        """MTP draft tokens per decode step (`design.SpecDecode.draft_tokens`): the row's
        `mtp_draft_tokens`, else `MTP_DRAFT_TOKENS` on an MTP row and 0 without MTP."""
        if self.mtp_draft_tokens is not None:
            return self.mtp_draft_tokens
        return MTP_DRAFT_TOKENS if self.mtp else 0.0

    @property
    def disaggregated(self) -> bool:
        return self.decode is not None

    @property
    def stalled(self) -> bool:
        """Whether the run kept requests waiting tens of seconds for a first token: p99
        TTFT above `STALL_SECONDS` and above `STALL_RATIO` x its median TTFT (False where
        not measured). Such a run is stretched by its stall, so its measured throughput
        is low while its medians are not (`calibration/stalled_runs.py`); the latency fit
        fits its medians only."""
        tail, median = self.measured.get("p99_ttft_s"), self.measured.get("median_ttft_s")
        if tail is None or median is None:
            return False
        return tail > STALL_SECONDS and tail > STALL_RATIO * median

    @property
    def structure(self) -> tuple:
        """What must be equal for two rows to share one batched evaluation."""
        return (self.model, self.hardware, self.precision, self.kv, self.layout,
                self.prefill, self.decode)


def _as_int(value: float | None, where: str) -> int:
    if value is None or value < 1 or abs(value - round(value)) > 1e-6:
        raise DataError(f"{where}: {value!r} must be a positive integer")
    return int(round(value))


def _pool(table: Table, i: int, prefix: str) -> PoolLayout:
    tp = _as_int(number(table, i, f"{prefix}tp"), table.where(i, f"{prefix}tp"))
    ep_value = number(table, i, f"{prefix}ep", optional=True)
    ep = 1 if ep_value is None else _as_int(ep_value, table.where(i, f"{prefix}ep"))
    dpa = flag(table, i, f"{prefix}dp_attention")
    return PoolLayout(tp=tp, ep=ep, dp_attention=dpa)


def _worker(table: Table, i: int, side: str) -> PoolLayout:
    logged = _pool(table, i, f"{side}_")
    workers = _as_int(number(table, i, f"{side}_num_workers"),
                      table.where(i, f"{side}_num_workers"))
    chips = _as_int(number(table, i, f"num_{side}_gpu"), table.where(i, f"num_{side}_gpu"))
    if chips % workers:
        raise DataError(f"{table.where(i, f'num_{side}_gpu')}: {chips} chips do not split "
                        f"into {workers} workers")
    size = chips // workers
    if logged.tp == size:
        tp, ep = size, logged.ep
    else:
        tp = size
        ep = size if logged.dp_attention else logged.ep
    if tp % ep:
        ep = math.gcd(tp, ep)
    return PoolLayout(tp=tp, ep=ep, dp_attention=logged.dp_attention, replicas=workers)


def load_benchmarks(path: str | os.PathLike, require_measured: bool = False) -> list[BenchRow]:
    """InferenceMAX-style rows (the columns of `benchmarks_inferencemax.csv`).

    Args:
        path: the CSV file.
        require_measured: also require the measured columns the fit uses (throughput, median
            TPOT and TTFT) to be present and positive.

    Raises:
        DataError: a missing column or a corrupt value, naming file, line and column.
    """
    required = INFERENCEMAX_INPUTS + (("tput_per_gpu", "median_tpot_s", "median_ttft_s")
                                      if require_measured else ())
    table = read_table(path, required)
    out = []
    for i, row in enumerate(table.rows):
        for column in ("model", "hardware", "framework", "precision"):
            if not row[column]:
                raise DataError(f"{table.where(i, column)}: empty, a name is required")
        isl = number(table, i, "isl", positive=True)
        osl = number(table, i, "osl", positive=True)
        conc = number(table, i, "conc", positive=True)
        if osl <= 1:
            raise DataError(f"{table.where(i, 'osl')}: must be > 1 token")
        disagg = flag(table, i, "disagg")
        if disagg:
            for c in ("prefill_tp", "decode_tp", "prefill_num_workers", "decode_num_workers",
                      "num_prefill_gpu", "num_decode_gpu"):
                if c not in table.columns:
                    raise DataError(f"{table.path}, line 1: missing column {c!r} needed by "
                                    f"the disaggregated row on line {table.lines[i]}")
            layout, prefill, decode = None, _worker(table, i, "prefill"), \
                _worker(table, i, "decode")
        else:
            for c in ("tp",):
                if c not in table.columns:
                    raise DataError(f"{table.path}, line 1: missing column {c!r}")
            layout, prefill, decode = _pool(table, i, ""), None, None
        measured = {}
        for column in INFERENCEMAX_MEASURED:
            if column in table.columns:
                strict = require_measured and column in ("tput_per_gpu", "median_tpot_s",
                                                         "median_ttft_s")
                try:
                    value = number(table, i, column, positive=strict, optional=not strict)
                except DataError:
                    if require_measured:
                        raise
                    value = None   # predictions do not read measured columns
                if value is not None and value > 0:
                    measured[column] = value
        spec = row.get("spec_decoding", "none").lower()
        kv = _kv_format(table, i)
        poll = number(table, i, "poll_steps", optional=True)
        if poll is not None and poll < 1.0:
            raise DataError(f"{table.where(i, 'poll_steps')}: {poll} must be at least 1 (decode "
                            "steps between the scheduler's looks for new requests; leave it "
                            "empty for 1, the engines' default)")
        mtp = spec not in ("", "none", "false", "no")
        out.append(BenchRow(index=i, line=table.lines[i], model=row["model"],
                            hardware=row["hardware"], framework=row["framework"].lower(),
                            precision=row["precision"].lower(), isl=isl, osl=osl, conc=conc,
                            mtp=mtp, layout=layout,
                            prefill=prefill, decode=decode, measured=measured, kv=kv,
                            poll_steps=1.0 if poll is None else poll,
                            mtp_draft_tokens=_draft_tokens(table, i, mtp)))
    return out


def _draft_tokens(table: Table, i: int, mtp: bool) -> float | None:
    """The optional `mtp_draft_tokens` cell of row `i`: a positive integer, on MTP rows
    only; None where empty (`BenchRow.draft_tokens` then takes the default)."""
    value = number(table, i, "mtp_draft_tokens", optional=True)
    if value is None:
        return None
    if not mtp:
        raise DataError(f"{table.where(i, 'mtp_draft_tokens')}: {value} draft tokens on a row "
                        "whose spec_decoding is none; leave it empty or set spec_decoding "
                        "to mtp")
    return float(_as_int(value, table.where(i, "mtp_draft_tokens")))


#: `kv_cache_dtype` cells meaning the engine's default ("auto": the model's BF16).
_KV_AUTO = ("", "auto", "none", "nan")


def _kv_format(table: Table, i: int) -> str | None:
    """The optional `kv_cache_dtype` cell of row `i` (what the run's `--kv-cache-dtype` or
    `kv_cache_config.dtype` set): a format name (``fp8``, ``fp8_e4m3`` -> fp8, ``bf16``),
    or None for "auto" or an empty cell (BF16 in `design.precision`)."""
    text = table.rows[i].get("kv_cache_dtype", "").strip().lower()
    if text in _KV_AUTO:
        return None
    try:
        resolve_format(text)   # the engines' names are `formats.ALIASES` (fp8_e4m3 -> fp8)
    except ValueError as err:
        raise DataError(f"{table.where(i, 'kv_cache_dtype')}: {err}; leave it empty or "
                        "'auto' for the engine default (BF16)") from None
    return ALIASES.get(text, text)   # plain "fp4" stays for `design.precision`'s chip


#: aiconfigurator system names -> chip presets.
SYSTEMS = {"h100_sxm": "h100", "h200_sxm": "h200", "b200_sxm": "b200", "gb200": "gb200",
           "b300_sxm": "b300", "gb300": "gb300"}
#: GEMM dtype -> (weight bytes, activation bytes, compute class). NVFP4 carries one FP8
#: scale per 16 values (0.5 + 1/16 bytes per value).
GEMM_DTYPES = {"bfloat16": (2.0, 2.0, "bf16"), "fp8": (1.0, 1.0, "fp8"),
               "fp8_block": (1.0, 1.0, "fp8"), "nvfp4": (0.5625, 0.5625, "fp4")}
#: nccl-tests op names -> `perfmodel.interconnect.COLLECTIVES`.
NCCL_OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather",
            "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all"}


def load_gemm(path: str | os.PathLike) -> list[dict]:
    """GEMM timings: dicts with chip, dtype, m, n, k, seconds."""
    table = read_table(path, ("system", "dtype", "m", "n", "k", "latency_ms"))
    out = []
    for i, row in enumerate(table.rows):
        if row["system"] not in SYSTEMS:
            raise DataError(f"{table.where(i, 'system')}: unknown system {row['system']!r}; "
                            f"known: {', '.join(SYSTEMS)}")
        if row["dtype"] not in GEMM_DTYPES:
            raise DataError(f"{table.where(i, 'dtype')}: unknown dtype {row['dtype']!r}")
        out.append(dict(chip=SYSTEMS[row["system"]], dtype=row["dtype"], line=table.lines[i],
                        m=number(table, i, "m", positive=True),
                        n=number(table, i, "n", positive=True),
                        k=number(table, i, "k", positive=True),
                        seconds=number(table, i, "latency_ms", positive=True) * 1e-3))
    return out


def load_nccl(path: str | os.PathLike) -> list[dict]:
    """NCCL collective timings: dicts with chip, op, n, bytes, seconds."""
    table = read_table(path, ("system", "op_name", "num_gpus", "message_bytes_derived",
                              "latency_us"))
    out = []
    for i, row in enumerate(table.rows):
        if row["system"] not in SYSTEMS:
            raise DataError(f"{table.where(i, 'system')}: unknown system {row['system']!r}")
        if row["op_name"] not in NCCL_OPS:
            raise DataError(f"{table.where(i, 'op_name')}: unknown collective "
                            f"{row['op_name']!r}; known: {', '.join(NCCL_OPS)}")
        n = _as_int(number(table, i, "num_gpus"), table.where(i, "num_gpus"))
        out.append(dict(chip=SYSTEMS[row["system"]], op=NCCL_OPS[row["op_name"]], n=n,
                        line=table.lines[i],
                        bytes=number(table, i, "message_bytes_derived", positive=True),
                        seconds=number(table, i, "latency_us", positive=True) * 1e-6))
    return out
