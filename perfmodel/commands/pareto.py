"""`perfmodel pareto`: the throughput-per-chip vs interactivity front of one chip and model."""

from __future__ import annotations

import argparse
import textwrap

from . import (
    add_format_arg,
    add_spec_args,
    check_output,
    chip_count,
    progress,
    provenance,
    render,
    resolve,
)

#: Table columns: (row key, header, format).
COLUMNS = (
    ("concurrency", "conc", ".0f"),
    ("layout", "layout", "s"),
    ("tput_per_chip_total", "tok/s/chip", "sig"),
    ("interactivity", "tok/s/user", "sig"),
    ("ttft_s", "TTFT s", "sig"),
    ("tpot_ms", "TPOT ms", "sig"),
    ("e2e_s", "E2E s", "sig"),
    ("power_w_modelled", "model W", ".0f"),
    ("tok_s_per_kw_tdp", "tok/s/kW TDP", "sig"),
    ("j_per_output_token", "J/out tok", "sig"),
)

#: What the columns count (`--help` and the README say the same).
LEGEND = ("tok/s/chip: input + output tokens per second per chip (tput_per_chip_total); "
          "tok/s/user: output tokens per second per request, 1 / TPOT (interactivity); "
          "TTFT, TPOT, E2E: medians; model W: the modelled average chip power while "
          "serving (power_w_modelled); tok/s/kW TDP: total tokens per second per kW of the "
          "chips' rated TDP, not of modelled power (tok_s_per_kw_tdp); J/out tok: chip "
          "energy per output token, prefill included.")


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "pareto", help="throughput per chip vs interactivity Pareto front",
        description="Sweep parallel layouts and concurrency on N chips and print the Pareto "
                    "front of throughput per chip against tokens/s/user.",
        epilog="Columns: " + LEGEND)
    add_spec_args(parser)
    parser.add_argument("--chips", type=chip_count, default=None,
                        help="chips in the deployment (default: the smallest power of two that "
                             "holds the weights and a useful batch)")
    add_format_arg(parser)
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also write a labelled plot of the sweep and its front")
    parser.set_defaults(func=run)
    return parser


def run(args) -> int:
    from ..sweep import default_runtime, sweep
    from ..workload import Workload

    model, chip, fmt = resolve(args)
    if args.plot is not None:
        if not args.plot.lower().endswith((".png", ".pdf", ".svg")):
            raise ValueError(f"--plot {args.plot!r}: the file name must end in .png, .pdf "
                             "or .svg")
        check_output(args.plot, "--plot")
    result = sweep(model, chip, Workload(args.isl, args.osl), chips=args.chips, precision=fmt,
                   progress=progress(args))
    rows = result.rows()
    if args.format == "table":
        shown = [dict(row, tpot_ms=row["tpot_s"] * 1e3) for row in rows]
    else:
        shown = rows
    inputs = provenance(command="pareto", model=result.model, chip=result.chip,
                        chips=result.chips, isl=args.isl, osl=args.osl,
                        precision="/".join(result.precision),
                        engine=str(default_runtime(chip).framework))
    text = render(shown, args.format, COLUMNS, inputs=None if args.format == "table" else inputs)
    if args.format == "table":
        print("\n".join(textwrap.wrap(
            f"# {result.model} on {result.chips} x {result.chip}, weights/experts/kv "
            f"{'/'.join(result.precision)}, ISL {args.isl} OSL {args.osl}: "
            f"{len(result.layouts)} layouts, {len(result.layout_index)} points that fit, "
            f"{len(rows)} on the front", 100, subsequent_indent="#   ")))
    print(text)
    if args.plot is not None:
        from ..plots import pareto, save
        save(pareto([result]).figure, args.plot)
    return 0
