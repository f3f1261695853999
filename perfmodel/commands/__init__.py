"""Subcommands of the `perfmodel` command line, one module each.

Every module listed in `perfmodel.cli._COMMANDS` exposes `register(subparsers)`, which adds
its parser and `set_defaults(func=run)`; `run(args)` prints its result and returns the exit
status. Raise `ValueError` with a one-line message naming the bad value and the valid
choices: `perfmodel.cli.main` prints it as ``perfmodel: error: ...``.

This module holds what the commands share: the workload arguments, spec resolution and the
table / JSON / CSV writers.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math

FORMATS = ("table", "json", "csv")


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (the message names the value)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def add_spec_args(parser: argparse.ArgumentParser, model: str = "deepseek-r1",
                  chip: str = "gb200") -> None:
    """--model, --chip, --isl, --osl and --precision, with the InferenceMAX 8K/1K defaults."""
    parser.add_argument("--model", default=model,
                        help=f"model preset or Hugging Face id (default {model}; "
                             "see perfmodel.model_names())")
    parser.add_argument("--chip", default=chip,
                        help=f"chip preset (default {chip}; see perfmodel.chip_names())")
    parser.add_argument("--isl", type=int, default=8192,
                        help="nominal input length, tokens (default 8192)")
    parser.add_argument("--osl", type=int, default=1024,
                        help="nominal output length, tokens (default 1024)")
    parser.add_argument("--precision", default=None,
                        help="weight format (fp4, fp8, int8, bf16, mxfp4, nvfp4, int4); default: "
                             "the narrowest format the chip computes natively")


def add_format_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMATS, default="table",
                        help="output format (default table)")


def check_lengths(isl: int, osl: int) -> None:
    """Raise ValueError unless ISL >= 1 and OSL >= 2 tokens."""
    if isl < 1:
        raise ValueError(f"--isl must be a positive number of tokens, got {isl}")
    if osl < 2:
        raise ValueError(f"--osl must be at least 2 tokens, got {osl}")


def resolve(args):
    """(model, chip, precision name) from parsed arguments; ValueError on unknown names."""
    from ..formats import resolve_format
    from ..presets import find_model, get_chip
    from ..sweep import default_precision

    model, chip = find_model(args.model), get_chip(args.chip)
    check_lengths(args.isl, args.osl)
    fmt = args.precision
    if fmt is None:
        fmt = default_precision(chip, model)
    else:
        resolve_format(fmt, chip.fp4_flavor)   # raises, naming the valid formats
    return model, chip, fmt


def _check_finite(rows):
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"non-finite {key} in the result ({value}); please report "
                                 "the command line")


def _format(value, spec: str) -> str:
    if spec != "sig" or not isinstance(value, float):
        return format(value, spec if spec != "sig" else "")
    if value == 0.0:
        return "0"
    # Four significant digits without an exponent: 14696, 12.60, 0.02130.
    decimals = max(0, 3 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def render(rows: list[dict], fmt: str, columns) -> str:
    """Rows as an aligned table, a JSON list or CSV.

    Args:
        rows: dicts of plain values.
        fmt: one of `FORMATS`.
        columns: (key, header, format spec) triples for the table, where the spec "sig"
            prints four significant digits; JSON and CSV carry every key of the rows.

    Raises:
        ValueError: a non-finite number in a row (never printed as NaN).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    _check_finite(rows)
    if fmt == "json":
        return json.dumps(rows, indent=1, allow_nan=False)
    if fmt == "csv":
        out = io.StringIO()
        keys = list(rows[0]) if rows else [key for key, _, _ in columns]
        writer = csv.DictWriter(out, fieldnames=keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue().rstrip("\n")
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([_format(row[key], spec) for key, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)
