"""`perfmodel pareto`: the throughput-per-chip vs interactivity front of one chip and model."""

from __future__ import annotations

import argparse
import json
import textwrap

from . import (
    add_format_arg,
    add_spec_args,
    check_output,
    chip_count,
    number,
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
    parser.add_argument("--emit", choices=("vllm", "sglang", "trtllm"), default=None,
                        help="also print the engine's launch command for one front point: "
                             "the most tok/s/chip at or above --at-interactivity")
    parser.add_argument("--at-interactivity", type=number(0.0, meaning="tokens/s/user"),
                        default=0.0, metavar="TOK_S_USER",
                        help="with --emit: the lowest tok/s/user the emitted point may have "
                             "(default 0: the peak-throughput point)")
    parser.set_defaults(func=run)
    return parser


def _launch(args, result, rows, model, chip):
    """`deploy.launch` of the front point with the most tok/s/chip at or above
    `--at-interactivity`."""
    from ..deploy import launch

    usable = [r for r in rows if r["interactivity"] >= args.at_interactivity]
    if not usable:
        best = max(r["interactivity"] for r in rows)
        raise ValueError(f"--at-interactivity {args.at_interactivity:g}: no point of the front "
                         f"reaches it (the most is {best:.4g} tok/s/user)")
    row = max(usable, key=lambda r: r["tput_per_chip_total"])
    weights, experts, kv = result.precision
    design = {"layout": row["layout"], "chips": row["chips"],
              "concurrency": int(round(row["concurrency"])),
              "formats": {"weights": weights, "experts": experts, "kv": kv},
              "power_cap_w": None}
    return launch(args.emit, design, model, chip, max_context=args.isl + args.osl)


def run(args) -> int:
    from ..sweep import default_runtime, sweep
    from ..workload import Workload

    model, chip, fmt = resolve(args)
    if args.emit:
        from ..deploy import check_engine
        check_engine(args.emit, chip)
        if args.format == "csv":
            raise ValueError("--emit prints a command beside the front: use --format table "
                             "or json")
    if args.plot is not None:
        if not args.plot.lower().endswith((".png", ".pdf", ".svg")):
            raise ValueError(f"--plot {args.plot!r}: the file name must end in .png, .pdf "
                             "or .svg")
        check_output(args.plot, "--plot")
    workload = Workload(args.isl, args.osl, output_cv2=args.output_cv2,
                        cached_fraction=args.cached_fraction)
    result = sweep(model, chip, workload, chips=args.chips, precision=fmt, jit=True,
                   progress=progress(args))
    rows = result.rows()
    if args.format == "table":
        shown = [dict(row, tpot_ms=row["tpot_s"] * 1e3) for row in rows]
    else:
        shown = rows
    inputs = provenance(command="pareto", model=result.model, chip=result.chip,
                        chips=result.chips, isl=args.isl, osl=args.osl,
                        output_cv2=args.output_cv2, cached_fraction=args.cached_fraction,
                        precision="/".join(result.precision),
                        engine=str(default_runtime(chip).framework))
    text = render(shown, args.format, COLUMNS, inputs=None if args.format == "table" else inputs)
    launch, refused = None, None
    if args.emit:
        try:
            launch = _launch(args, result, rows, model, chip)
        except ValueError as error:   # the front is printed all the same
            refused = error
    if launch is not None and args.format == "json":
        text = json.dumps({**json.loads(text), "launch": launch.as_dict()}, indent=1)
    if args.format == "table":
        print("\n".join(textwrap.wrap(
            f"# {result.model} on {result.chips} x {result.chip}, weights/experts/kv "
            f"{'/'.join(result.precision)}, ISL {args.isl} OSL {args.osl}: "
            f"{len(result.layouts)} layouts, {len(result.layout_index)} points that fit, "
            f"{len(rows)} on the front", 100, subsequent_indent="#   ")))
    print(text)
    if launch is not None and args.format == "table":
        print(launch.text())
    if args.plot is not None:
        from ..plots import pareto, save
        save(pareto([result]).figure, args.plot)
    if refused is not None:
        raise ValueError(f"--emit {args.emit}: {refused}")
    return 0
