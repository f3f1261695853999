"""`perfmodel sweep`: every point of a TOML grid spec, one row each, to CSV or Parquet."""

from __future__ import annotations

import argparse
import sys

from . import check_output, positive_int, progress

#: Exit status of a sweep stopped by Ctrl-C or SIGTERM (128 + SIGINT, as shells report).
INTERRUPTED = 130


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "sweep", help="evaluate a grid of models x chips x layouts x workloads to CSV/Parquet",
        description="Expand a TOML sweep spec into a grid (models, chips, chip counts, "
                    "layouts, precisions, ISL, OSL, concurrency), evaluate it in chunks "
                    "with vmap under jit, sharded over the local devices, and write one row "
                    "per point as the chunks finish. Infeasible points are kept, with "
                    "feasible=false and the reason.",
        epilog="See examples/sweep.toml and the README section 'Sweeps'. Ctrl-C leaves a "
               "valid file of the finished rows; rerun with --resume to continue.")
    parser.add_argument("spec", metavar="SPEC.toml", help="the sweep spec")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="results file, .csv or .parquet (Parquet needs pyarrow: "
                             "pip install 'perfmodel[parquet]')")
    parser.add_argument("--resume", action="store_true",
                        help="continue the interrupted sweep at --out (its state is in "
                             "FILE.sweep.json) without recomputing its rows")
    parser.add_argument("--overwrite", action="store_true",
                        help="start again over an unfinished sweep at --out")
    parser.add_argument("--chunk-size", type=lambda t: positive_int(t, 1 << 24), default=None,
                        metavar="POINTS",
                        help="points per chunk (default: from the available memory, at most "
                             "262144; a resumed sweep keeps its own)")
    parser.add_argument("--devices", type=lambda t: positive_int(t, 1 << 16), default=None,
                        help="local devices to shard each chunk over (default: all)")
    group = parser.add_argument_group(
        "several hosts", "one process per host, started with the same arguments; each takes "
                         "every n-th chunk and writes FILE.partP-of-N, and process 0 merges "
                         "the parts into FILE (on a shared file system)")
    group.add_argument("--distributed", action="store_true",
                       help="call jax.distributed.initialize (alone: the cluster is "
                            "detected, as on SLURM or Cloud TPU)")
    group.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="address of process 0 (implies --distributed)")
    group.add_argument("--num-processes", type=positive_int, default=None, metavar="N")
    group.add_argument("--process-id", type=int, default=None, metavar="P")
    group.add_argument("--merge-timeout", type=float, default=600.0, metavar="S",
                       help="seconds process 0 waits for the other parts (default 600)")
    parser.set_defaults(func=run)
    return parser


def run(args) -> int:
    from ..grid import load, run_sweep
    from ..grid.shard import initialize
    from ..grid.writers import output_format

    output_format(args.out)
    check_output(args.out, "--out")
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    spec = load(args.spec)
    process, processes = 0, 1
    if args.distributed or args.coordinator or args.num_processes or \
            args.process_id is not None:
        given = (args.coordinator, args.num_processes, args.process_id)
        if any(v is not None for v in given) and not all(v is not None for v in given):
            raise ValueError("--coordinator, --num-processes and --process-id go together "
                             "(or pass --distributed alone to detect the cluster)")
        if args.process_id is not None and not 0 <= args.process_id < args.num_processes:
            raise ValueError(f"--process-id {args.process_id} must lie in [0, "
                             f"{args.num_processes})")
        process, processes = initialize(*given)
    try:
        summary = run_sweep(spec, args.out, resume=args.resume, overwrite=args.overwrite,
                            size=args.chunk_size, devices=args.devices, process=process,
                            processes=processes, progress=progress(args),
                            merge_timeout=args.merge_timeout)
    except KeyboardInterrupt:
        print(f"perfmodel: sweep interrupted; {args.out} holds the finished rows; rerun "
              "with --resume to continue", file=sys.stderr)
        return INTERRUPTED
    rate = summary.computed / summary.seconds if summary.seconds > 0 else float("nan")
    print(f"{summary.path}: {summary.rows:,} rows of {summary.points:,} points; this run "
          f"computed {summary.computed:,} ({summary.feasible:,} feasible) in "
          f"{summary.chunks} chunks, {summary.seconds:.1f} s, {rate:,.0f} points/s")
    if summary.merged is not None:
        print(f"{args.out}: {summary.merged:,} rows merged from {processes} parts")
    return 0
