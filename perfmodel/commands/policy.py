"""`perfmodel policy`: tune the batch policy for a load under p99 SLOs (`perfmodel.policy`)."""

from __future__ import annotations

import argparse
import math
import time

from . import (
    add_format_arg,
    add_model_chip_args,
    check_lengths,
    chip_count,
    model_and_chip,
    positive_int,
    provenance,
    render,
    token_count,
)
from .simulate import MAX_REQUESTS, _positive, _seed

COLUMNS = (("metric", "metric", "s"), ("p50", "p50", "sig"), ("p95", "p95", "sig"),
           ("p99", "p99", "sig"), ("surrogate_p99", "surrogate p99", "sig"))
LATENCIES = (("ttft_s", "ttft"), ("tpot_s", "tpot"), ("e2e_s", "e2e"))


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "policy", help="tune the batch policy for a load under p99 TTFT/TPOT SLOs",
        description="Find the scheduler policy (token budget, running-sequence cap, prefill "
                    "chunk cap) and the layout of the chips (tp x replicas) with the most "
                    "goodput per chip under p99 TTFT and TPOT SLOs: by gradient on the "
                    "serving surrogate, rounded to engine values and verified (and backed off "
                    "when it misses) in the simulator. --check-grid also runs a grid search "
                    "of the same space in the simulator.")
    add_model_chip_args(parser, "llama-3.1-8b", "h100")
    parser.add_argument("--chips", type=chip_count, default=1,
                        help="chips of the pool, split into tp x replicas (default 1)")
    parser.add_argument("--engine", choices=("vllm",), default="vllm",
                        help="scheduler and fitted runtime terms (default vllm)")
    parser.add_argument("--rate", type=_positive, default=None,
                        help="arrivals per second of the pool (with --isl, --osl)")
    parser.add_argument("--isl", type=token_count, default=1024,
                        help="input tokens per request (default 1024)")
    parser.add_argument("--osl", type=token_count, default=256,
                        help="output tokens per request (default 256)")
    parser.add_argument("--cv", type=_positive, default=1.0,
                        help="coefficient of variation of the arrival gaps (1: Poisson, "
                             "default; above 1: bursty gamma)")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="arrivals and lengths from a trace (vLLM or Mooncake JSONL, "
                             "Azure CSV) instead of --rate, --isl, --osl")
    parser.add_argument("--requests", type=lambda t: positive_int(t, MAX_REQUESTS),
                        default=None, help="requests simulated to verify (default 1000; "
                                           "with --trace, its first ones, default all)")
    parser.add_argument("--seed", type=_seed, default=0,
                        help="random seed of the arrivals, >= 0 (default 0)")
    parser.add_argument("--max-ttft-p99-ms", type=_positive, required=True,
                        help="p99 TTFT SLO, ms")
    parser.add_argument("--max-tpot-p99-ms", type=_positive, required=True,
                        help="p99 TPOT SLO, ms")
    parser.add_argument("--objective", choices=("goodput_per_chip", "goodput_per_kw"),
                        default="goodput_per_chip", help="what to maximise (default "
                                                         "goodput_per_chip)")
    parser.add_argument("--check-grid", action="store_true",
                        help="also grid-search the same policy space in the simulator")
    add_format_arg(parser, ("table", "json"))
    parser.set_defaults(func=run)
    return parser


def _problem(args):
    from .. import policy
    from ..surrogate import Load
    from ..traces import load_trace

    model, chip = model_and_chip(args)
    ttft, tpot = args.max_ttft_p99_ms / 1e3, args.max_tpot_p99_ms / 1e3
    if args.trace is not None:
        if args.rate is not None:
            raise ValueError("give --trace or --rate, not both")
        requests = load_trace(args.trace, limit=args.requests)
        return policy.problem(model, chip, args.chips, policy.load_of(requests), ttft, tpot,
                              requests=requests, objective=args.objective,
                              engine=args.engine)
    if args.rate is None:
        raise ValueError("give --rate (arrivals per second) or --trace FILE")
    check_lengths(args.isl, args.osl, model)
    load = Load(rate=args.rate, input_len=args.isl, output_len=args.osl, cv=args.cv)
    return policy.problem(model, chip, args.chips, load, ttft, tpot,
                          num_requests=args.requests or 1000, seed=args.seed,
                          objective=args.objective, engine=args.engine)


def _policy(option, policy) -> dict:
    from ..policy import as_dict

    return {**as_dict(policy), "tp": option.tp, "replicas": option.replicas,
            "format": option.fmt}


def _finite(x):
    x = float(x)
    return x if math.isfinite(x) else None


def run(args) -> int:
    from .. import policy

    start = time.perf_counter()
    p = _problem(args)
    quiet = False if getattr(args, "quiet", False) else None
    tuned = policy.tune(p, progress=quiet)
    s, e = tuned.summary, tuned.estimate
    if int(s.finished) == 0:
        raise ValueError("no request finished in the simulation; lower --rate")
    out = {"policy": _policy(tuned.option, tuned.policy),
           "goodput_per_chip": float(s.goodput_per_chip), "slo_met": tuned.slo_met}
    for q in ("p50", "p95", "p99"):
        out[q] = {key: _finite(getattr(getattr(s, name), q)) for key, name in LATENCIES}
    out.update(utilization=float(s.utilization), power_w=float(s.power),
               surrogate={"p99": {"ttft_s": _finite(e.ttft.p99), "tpot_s": _finite(e.tpot.p99)},
                          "goodput_per_chip": float(tuned.option.replicas * e.goodput
                                                    / p.chips)},
               backoffs=tuned.backoffs, wall_s=time.perf_counter() - start)
    if args.check_grid:
        grid = policy.grid_search(p, progress=quiet)
        out["grid"] = {"policy": _policy(grid.option, grid.policy),
                       "goodput_per_chip": float(grid.summary.goodput_per_chip),
                       "slo_met": grid.slo_met, "points": grid.points, "wall_s": grid.wall_s}
    inputs = provenance(command="policy", model=p.model.name, chip=p.chip.name,
                        chips=p.chips, engine=args.engine,
                        arrivals=args.trace or f"rate {args.rate}/s, cv {args.cv}",
                        max_ttft_p99_s=p.max_ttft, max_tpot_p99_s=p.max_tpot,
                        objective=p.objective, requests=int(s.requests))
    if args.format == "json":
        import json

        print(json.dumps({"inputs": inputs, **out}, indent=1, allow_nan=False))
        return 0
    pol = out["policy"]
    chunk = pol["long_prefill_token_threshold"]
    print(f"# {p.model.name} on {p.chips} x {p.chip.name} ({tuned.option.describe()}): "
          f"max_num_batched_tokens {pol['max_num_batched_tokens']}, max_num_seqs "
          f"{pol['max_num_seqs']}, long_prefill_token_threshold "
          f"{'none' if chunk is None else chunk}; goodput/chip "
          f"{out['goodput_per_chip']:.3g} req/s, SLOs {'met' if out['slo_met'] else 'MISSED'} "
          f"in the simulator ({out['backoffs']} back-offs), utilization "
          f"{out['utilization']:.2f}, {out['power_w']:.0f} W/chip, {out['wall_s']:.1f} s")
    sur = out["surrogate"]["p99"]
    # A missing value (TPOT of one-token outputs) prints as 0.
    rows = [{"metric": key, **{q: out[q][key] or 0.0 for q in ("p50", "p95", "p99")},
             "surrogate_p99": sur.get(key) or 0.0} for key, _ in LATENCIES]
    print(render(rows, "table", COLUMNS))
    if args.check_grid:
        g = out["grid"]
        print(f"# grid: {g['points']} policies in {g['wall_s']:.1f} s, best goodput/chip "
              f"{g['goodput_per_chip']:.3g} req/s ({'met' if g['slo_met'] else 'MISSED'}): "
              f"{g['policy']}")
    return 0
