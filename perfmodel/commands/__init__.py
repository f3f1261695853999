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
import os

import numpy as np

from ..checks import Range

FORMATS = ("table", "json", "csv")
#: Characters a table line may take; wider tables continue in further blocks.
TABLE_WIDTH = 120


#: Upper bounds of integer options: far past any real use, short of sizes that overflow
#: the 32-bit integers of array shapes and grid indices.
MAX_CHIPS = 1_048_576
MAX_TOKENS = 100_000_000
MAX_STEPS = 100_000


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False, integer: bool = False, meaning: str = ""):
    """An argparse type: a finite number (an integer with `integer`) between `low` and `high`
    (either bound None for none; `low_open` / `high_open` exclude the bound itself), the
    range a `checks.Range` like the specs' own.

    A refused value raises `argparse.ArgumentTypeError` whose message names the value as
    given and the range, then `meaning` when given (argparse prefixes the option's name):

        >>> number(0.0, 1.0, high_open=True, meaning="a share")("1")
        Traceback (most recent call last):
        argparse.ArgumentTypeError: 1 is not in [0, 1): a share
    """
    valid = Range(low=-math.inf if low is None else low,
                  high=math.inf if high is None else high,
                  low_open=low_open, high_open=high_open)
    if low == 0 and low_open and high is None:
        span = "a positive finite number"
    elif low is not None and high is not None:
        span = valid.describe()
    else:
        span = "a finite number" + ("" if low is None and high is None
                                    else " " + valid.describe())

    def parse(text: str):
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if integer else 'a number'}") from None
        if not valid.holds(np.float64(value)):
            raise argparse.ArgumentTypeError(
                f"{text} is not {span}" + (f": {meaning}" if meaning else ""))
        return value

    return parse


def positive_int(text: str, largest: int = MAX_STEPS) -> int:
    """argparse type: an integer in [1, `largest`] (the message names the value)."""
    return number(1, largest, integer=True)(text)


#: argparse type of --chips: an integer in [1, `MAX_CHIPS`].
chip_count = number(1, MAX_CHIPS, integer=True)
#: argparse type of --isl and --osl: an integer in [1, `MAX_TOKENS`] (check_lengths adds the
#: model's own limits).
token_count = number(1, MAX_TOKENS, integer=True, meaning="tokens")
#: argparse type of --output-cv2: a finite number >= 0.
spread = number(0.0)
#: argparse type of --cached-fraction: a number in [0, 1).
cached_share = number(0.0, 1.0, high_open=True,
                      meaning="the share of each prompt found in the prefix cache")


def add_model_chip_args(parser: argparse.ArgumentParser, model: str = "deepseek-r1",
                        chip: str | None = "gb200", chip_default: str | None = None) -> None:
    """--model and --chip, read by `model_and_chip`: every command takes the same names.

    Args:
        model, chip: the defaults (`chip` None: `chip_default` describes the default).
        chip_default: the help's words for the default when `chip` is None.
    """
    parser.add_argument("--model", default=model,
                        help=f"model preset, alias or Hugging Face id (default {model}; "
                             "see perfmodel.model_names())")
    parser.add_argument("--chip", default=chip,
                        help=f"chip preset or alias (default {chip_default or chip}; "
                             "see perfmodel.chip_names())")


def model_and_chip(args, chip: str | None = None):
    """(model, chip) that --model and --chip name (`presets.find_model`, `presets.get_chip`:
    presets, aliases, qualified names, shipped Hugging Face configs), `chip` standing in for
    a --chip not given; ValueError naming the closest presets for a name that is neither."""
    from ..presets import find_model, get_chip

    return find_model(args.model), get_chip(args.chip or chip)


def add_spec_args(parser: argparse.ArgumentParser, model: str = "deepseek-r1",
                  chip: str = "gb200") -> None:
    """--model, --chip, --isl, --osl and --precision, with the InferenceMAX 8K/1K defaults."""
    add_model_chip_args(parser, model, chip)
    parser.add_argument("--isl", type=token_count, default=8192,
                        help="nominal input length, tokens (default 8192)")
    parser.add_argument("--osl", type=token_count, default=1024,
                        help="nominal output length, tokens (default 1024)")
    parser.add_argument("--output-cv2", type=spread, default=0.0,
                        help="Var/mean^2 of the output lengths (default 0): a spread "
                             "lengthens the running batch's mean context to ISL + OSL (1 + "
                             "cv2) / 2 (Workload.output_cv2; MLPerf's DeepSeek-R1 outputs: "
                             "1.42)")
    parser.add_argument("--cached-fraction", type=cached_share, default=0.0,
                        help="share of each prompt found in the prefix cache, in [0, 1) "
                             "(default 0): multi-turn chat and agents resend the "
                             "conversation so far; the prefill computes the rest, the KV "
                             "cache holds the whole prompt (Workload.cached_fraction)")
    add_long_context_arg(parser)
    parser.add_argument("--precision", default=None,
                        help="weight format (fp4, fp8, int8, bf16, mxfp4, nvfp4, int4); default: "
                             "the narrowest format the chip computes natively")
    parser.add_argument("--emulate", action="store_true",
                        help="allow a --precision the chip does not compute natively: weights "
                             "stored in it and computed in BF16 (weight-only quantization)")


def add_format_arg(parser: argparse.ArgumentParser, formats: tuple = FORMATS) -> None:
    """--format, offering only the `formats` the command writes."""
    parser.add_argument("--format", choices=formats, default="table",
                        help="output format (default table)")


def progress(args) -> bool | None:
    """The `progress` argument of long library calls: none with --quiet, else a bar on a
    terminal (`perfmodel.progress`)."""
    return False if getattr(args, "quiet", False) else None


def check_output(path: str, option: str) -> None:
    """Raise ValueError, naming `option`, unless `path` can be written: not a folder, in a
    folder that exists and is writable, and not a read-only file. Commands call it before
    any work, so a bad path costs nothing."""
    if os.path.isdir(path):
        raise ValueError(f"{option} {path!r} is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{option} {path!r}: the folder {folder!r} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{option} {path!r}: the file is not writable")
    if not os.path.exists(path) and not os.access(folder, os.W_OK):
        raise ValueError(f"{option} {path!r}: the folder {folder!r} is not writable")


def add_long_context_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-long-context", action="store_true",
                        help="model requests longer than the model's maximum context "
                             "(max_position_embeddings of its config)")


def check_lengths(isl: int, osl: int, model=None, allow_long: bool = False) -> None:
    """Raise ValueError unless ISL >= 1 and OSL >= 2 tokens and, unless `allow_long`,
    ISL + OSL fits in `model`'s maximum context (when its config gives one)."""
    if isl < 1:
        raise ValueError(f"--isl must be a positive number of tokens, got {isl}")
    if osl < 2:
        raise ValueError(f"--osl must be at least 2 tokens, got {osl}")
    limit = getattr(model, "max_context", 0)
    if limit and isl + osl > limit and not allow_long:
        raise ValueError(f"--isl {isl} + --osl {osl} = {isl + osl:,} tokens is longer than "
                         f"{model.name}'s maximum context of {limit:,} "
                         "(max_position_embeddings); pass --allow-long-context to model it "
                         "anyway")


def resolve(args):
    """(model, chip, `Precision`) from parsed arguments; ValueError on unknown names and on
    a --precision the chip does not compute natively without --emulate."""
    from ..design import precision
    from ..sweep import default_precision

    model, chip = model_and_chip(args)
    check_lengths(args.isl, args.osl, model, args.allow_long_context)
    if args.precision is None:
        return model, chip, precision(chip, model, default_precision(chip, model))
    try:
        return model, chip, precision(chip, model, args.precision, emulate=args.emulate)
    except ValueError as error:
        raise ValueError(f"--precision {args.precision}: "
                         f"{str(error).removeprefix('precision: ')}") from None


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


def versions() -> dict:
    """The perfmodel version and those of the fitted parameters it predicts with."""
    from importlib import metadata

    from .. import fitted

    try:
        number = metadata.version("perfmodel")
    except metadata.PackageNotFoundError:   # a source tree that was not installed
        number = "unknown"
    latency, power = fitted.read(fitted.LATENCY_FILE), fitted.read(fitted.POWER_FILE)
    return {"perfmodel_version": number,
            "fitted_latency": f"{fitted.LATENCY_FILE} v{latency.get('version', '?')} of "
                              f"{latency.get('date', '?')}",
            "fitted_power": f"{fitted.POWER_FILE} v{power.get('version', '?')}"}


def provenance(**inputs) -> dict:
    """What a saved result was computed from: the command's `inputs` (model, chip, lengths,
    targets, ...) and `versions()`."""
    return {**inputs, **versions()}


def render(rows: list[dict], fmt: str, columns, inputs: dict | None = None) -> str:
    """Rows as an aligned table, JSON or CSV.

    Args:
        rows: dicts of plain values.
        fmt: one of `FORMATS`.
        columns: (key, header, format spec) triples for the table, where the spec "sig"
            prints four significant digits; JSON and CSV carry every key of the rows.
        inputs: what the rows were computed from (`provenance`): JSON is then an object
            {"inputs": ..., "rows": [...]} and every CSV row starts with these columns
            (nested values as JSON), so a saved file describes itself. None: a JSON list.

    Raises:
        ValueError: a non-finite number in a row (never printed as NaN).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    _check_finite(rows)
    if fmt == "json":
        data = rows if inputs is None else {"inputs": inputs, "rows": rows}
        return json.dumps(data, indent=1, allow_nan=False)
    if fmt == "csv":
        if inputs:
            flat = {k: json.dumps(v) if isinstance(v, (dict, list, tuple)) else v
                    for k, v in inputs.items()}
            rows = [{**flat, **row} for row in rows]
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
    # Text columns read best flush left, numbers flush right.
    left = [spec == "s" for _, _, spec in columns]
    # The leading text columns name a row; past TABLE_WIDTH the other columns go to
    # further blocks, each repeating them.
    keys = next((i for i, flush in enumerate(left) if not flush), len(columns))
    blocks, block = [], []
    key_width = sum(widths[:keys]) + 2 * keys
    for i in range(keys, len(columns)):
        if block and key_width + sum(widths[j] + 2 for j in block) + widths[i] > TABLE_WIDTH:
            blocks.append(block)
            block = []
        block.append(i)
    blocks.append(block)
    parts = []
    for block in blocks:
        shown = list(range(keys)) + block
        parts.append("\n".join("  ".join(r[i].ljust(widths[i]) if left[i]
                                          else r[i].rjust(widths[i]) for i in shown).rstrip()
                               for r in cells))
    return "\n\n".join(parts)
