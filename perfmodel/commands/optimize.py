"""`perfmodel optimize`: the design that serves the most tokens per watt (per chip, per dollar)
under latency, power and accuracy targets, found by gradient descent (`perfmodel.search`)."""

from __future__ import annotations

import argparse
import json
import math
import textwrap

from . import add_format_arg, add_spec_args, chip_count, positive_int

#: Median TPOT limits (ms) of MLPerf Inference v5.1's Server scenario, per model preset
#: (mlcommons/inference_results_v5.1, the `tpot_constraint_ms` column of
#: calibration/data/benchmarks_mlperf.csv): `perfmodel optimize` holds a design to its
#: model's limit when no latency target is given.
MLPERF_SERVER_TPOT_MS = {"deepseek-r1": 80.0, "llama-3.1-405b": 175.0, "llama-3.1-8b": 100.0,
                         "llama-2-70b": 200.0, "mixtral-8x7b": 200.0}
#: The limit for models MLPerf does not run: its strictest Server limit (DeepSeek-R1's).
DEFAULT_TPOT_MS = min(MLPERF_SERVER_TPOT_MS.values())


def default_tpot_ms(model_name: str) -> tuple[float, str]:
    """(TPOT limit in ms, why) of a search given no latency target."""
    if model_name in MLPERF_SERVER_TPOT_MS:
        return MLPERF_SERVER_TPOT_MS[model_name], \
            f"MLPerf Inference v5.1 Server limit for {model_name}"
    return DEFAULT_TPOT_MS, ("MLPerf Inference v5.1's strictest Server limit; "
                             f"MLPerf has none for {model_name}")


def _classes(items, name, valid):
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--{name} {item!r}: write CLASS=OPT1,OPT2 with CLASS one of "
                             f"{', '.join(valid)}")
        key, values = item.split("=", 1)
        key = key.strip().lower()
        if key not in valid:
            raise ValueError(f"--{name}: unknown class {key!r}; valid: {', '.join(valid)}")
        out[key] = tuple(v.strip() for v in values.split(",") if v.strip())
        if not out[key]:
            raise ValueError(f"--{name} {item!r}: no options given")
    return out


def _fractions(text: str) -> tuple[float, ...]:
    """argparse type of --power-caps: comma-separated fractions of TDP in (0, 1]."""
    usage = "comma-separated fractions of TDP in (0, 1], e.g. 0.6,0.8,1.0"
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {usage}") from None
    bad = [v for v in values if not (math.isfinite(v) and 0.0 < v <= 1.0)]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: {bad[0]:g} is not in (0, 1]; {usage}")
    return values


def _keep(text: str):
    if text == "all":
        return text
    return positive_int(text, largest=2**31 - 1)   # more than there are layouts is "all"


def register(subparsers) -> argparse.ArgumentParser:
    from ..search import OBJECTIVES

    parser = subparsers.add_parser(
        "optimize", help="best design under latency/power targets, by gradient descent",
        description="Optimize concurrency, number formats, parallel layout, slice mapping "
                    "and power cap for an objective under constraints (augmented Lagrangian "
                    "over a relaxed, differentiable model), then harden and repair the "
                    "design and re-evaluate it exactly.",
        epilog="Exit status: 0 with a design that meets every target, 1 when none does "
               "(the closest trade-off is reported; JSON has \"feasible\": false and "
               "\"result\": \"infeasible\"), 2 on bad input.")
    add_spec_args(parser, chip="jalapeno")
    parser.add_argument("--chips", type=chip_count, default=8,
                        help="chips in the deployment (default 8)")
    parser.add_argument("--objective", choices=tuple(OBJECTIVES), default="tok_s_per_kw",
                        help="what to maximize (usd_per_mtok is minimized; default "
                             "tok_s_per_kw)")
    parser.add_argument("--max-tpot-ms", type=float, default=None,
                        help="median TPOT limit (default, when no latency target is given: "
                             "MLPerf Inference v5.1's Server limit for the model, else its "
                             f"strictest, {DEFAULT_TPOT_MS:g} ms)")
    parser.add_argument("--min-interactivity", type=float, default=None,
                        help="tokens/s/user floor")
    parser.add_argument("--max-ttft-ms", type=float, default=None, help="median TTFT limit")
    parser.add_argument("--max-e2e-s", type=float, default=None, help="median E2E limit")
    parser.add_argument("--max-power-w", type=float, default=None,
                        help="modeled power limit per chip (W)")
    parser.add_argument("--max-deployment-power-kw", type=float, default=None,
                        help="power limit of the whole deployment (kW)")
    parser.add_argument("--max-quality-loss", type=float, default=None,
                        help="budget of summed per-format quality costs (e.g. 0.01)")
    parser.add_argument("--formats", nargs="+", metavar="CLASS=F1,F2", default=None,
                        help="allowed formats per tensor class (weights, experts, kv), e.g. "
                             "weights=fp4,fp8 kv=fp8")
    parser.add_argument("--placements", nargs="+", metavar="CLASS=P1,P2", default=None,
                        help="allowed slice placements per state class (attention, dense, "
                             "experts, kv; weights = the three weight classes) among "
                             "interleaved, partitioned, replicated")
    parser.add_argument("--power-caps", type=_fractions, default=(1.0,),
                        help="power caps to consider, fractions of TDP (default 1.0)")
    parser.add_argument("--disaggregated", action="store_true",
                        help="also consider prefill/decode splits of the chips")
    parser.add_argument("--usd-per-chip-hour", type=float, default=None,
                        help="chip cost for usd_per_mtok")
    parser.add_argument("--usd-per-kwh", type=float, default=None,
                        help="electricity price for usd_per_mtok")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="Adam steps (default: perfmodel.search.optimize's); more "
                             "steps converge the relaxed solution further")
    parser.add_argument("--blocks", type=positive_int, default=None,
                        help="augmented-Lagrangian blocks the steps are split into "
                             "(default: perfmodel.search.optimize's)")
    parser.add_argument("--keep-layouts", type=_keep, default=None, metavar="N|all",
                        help="layouts hardened after the relaxed search when the grid has "
                             "more (default: perfmodel.search.optimize's); 'all' hardens "
                             "every layout")
    parser.add_argument("--check-exhaustive", action="store_true",
                        help="also enumerate the whole grid and report its best design")
    parser.add_argument("--emit", choices=("vllm", "sglang", "trtllm"), default=None,
                        help="also print the engine's launch command for the design found "
                             "(perfmodel.deploy; refused, with the reason, when the engine "
                             "cannot express the design)")
    add_format_arg(parser, ("table", "json"))
    parser.set_defaults(func=run)
    return parser


def _result(args):
    from ..search import design_space, exhaustive, optimize, targets
    from ..workload import Workload
    from . import check_lengths, model_and_chip, progress, provenance

    model, chip = model_and_chip(args)
    check_lengths(args.isl, args.osl, model, args.allow_long_context)
    if args.emit:
        from ..deploy import check_engine
        check_engine(args.emit, chip, disaggregated=args.disaggregated)   # before the work
    if args.objective == "usd_per_mtok" and not args.usd_per_chip_hour:
        raise ValueError("--objective usd_per_mtok needs --usd-per-chip-hour (> 0)")
    formats = _classes(args.formats, "formats", ("weights", "experts", "kv"))
    if args.precision and "weights" not in formats:
        formats["weights"] = (args.precision,)
    placements = _classes(args.placements, "placements",
                          ("weights", "attention", "dense", "experts", "kv"))
    latency = ("max_tpot_ms", "min_interactivity", "max_ttft_ms", "max_e2e_s")
    default_target = None
    if all(getattr(args, k) is None for k in latency):
        # Without a latency target the densest batch wins: seconds per token for everyone.
        limit, why = default_tpot_ms(model.name)
        args.max_tpot_ms = limit
        default_target = (f"TPOT <= {limit:g} ms by default ({why}); set --max-tpot-ms, "
                          "--min-interactivity, --max-ttft-ms or --max-e2e-s to change it")
    workload = Workload(args.isl, args.osl, output_cv2=args.output_cv2,
                        cached_fraction=args.cached_fraction)
    space = design_space(model, chip, args.chips, workload=workload, formats=formats,
                         placements=placements, power_caps=args.power_caps,
                         disaggregated=args.disaggregated)
    tgt = targets(max_tpot_ms=args.max_tpot_ms, min_interactivity=args.min_interactivity,
                  max_ttft_ms=args.max_ttft_ms, max_e2e_s=args.max_e2e_s,
                  max_power_w=args.max_power_w,
                  max_deployment_power_kw=args.max_deployment_power_kw, chips=args.chips,
                  max_quality_loss=args.max_quality_loss,
                  usd_per_chip_hour=args.usd_per_chip_hour, usd_per_kwh=args.usd_per_kwh)
    schedule = {k: v for k, v in (("steps", args.steps), ("blocks", args.blocks)) if v}
    if args.keep_layouts is not None:
        schedule["keep_layouts"] = None if args.keep_layouts == "all" else args.keep_layouts
    # An unsuccessful search is reported (the closest design when infeasible), not raised.
    result = optimize(model, chip, workload, space, tgt, args.objective, throw=False,
                      progress=progress(args), **schedule)
    out = result.as_dict()
    limits = ("max_tpot_ms", "min_interactivity", "max_ttft_ms", "max_e2e_s", "max_power_w",
              "max_deployment_power_kw", "max_quality_loss", "usd_per_chip_hour",
              "usd_per_kwh")
    out["inputs"] = provenance(
        command="optimize", model=model.name, chip=chip.name, chips=args.chips, isl=args.isl,
        osl=args.osl, output_cv2=args.output_cv2, cached_fraction=args.cached_fraction,
        objective=args.objective,
        targets={k: getattr(args, k) for k in limits if getattr(args, k) is not None},
        formats={k: list(v) for k, v in formats.items()},
        placements={k: list(v) for k, v in placements.items()},
        power_caps=list(args.power_caps), disaggregated=args.disaggregated,
        default_target=default_target)
    out["grid_points"] = space.size
    if result.feasible:
        # Every number of the reported design, for `perfmodel predict --design` and
        # `Design.from_json`: its metrics are `predict(..., hard=True)` of these specs.
        from ..serialize import to_json

        capped, design = result.specs()
        out["spec"] = {"model": args.model, "chip": to_json(capped),
                       "workload": to_json(workload), "design": to_json(design),
                       "evaluation": {"hard": True}}
    if args.check_exhaustive:
        ex = exhaustive(model, chip, workload, space, tgt, args.objective,
                        progress=progress(args))
        out["exhaustive"] = {"design": ex.design, "objective_value": ex.objective_value,
                             "feasible": ex.feasible, "points": ex.points, "wall_s": ex.wall_s}
    run = None
    if args.emit and result.feasible:
        from ..deploy import launch
        try:
            run = launch(args.emit, result.design, model, chip,
                         max_context=args.isl + args.osl)
            out["launch"] = run.as_dict()
        except ValueError as error:
            out["launch"] = {"engine": args.emit, "refused": str(error)}
    return out, run


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _describe(design: dict) -> str:
    f, p = design["formats"], design["placements"]
    return (f"{design['layout']} on {design['chips']} chips, concurrency "
            f"{design['concurrency']}, formats weights/experts/kv/attention {f['weights']}/"
            f"{f['experts']}/{f['kv']}/{f['attention']}, placement attention/dense/experts/kv "
            f"{p['attention']}/{p['dense']}/{p['experts']}/{p['kv']}, power cap "
            f"{design['power_cap_w']:.0f} W")


def _table(out: dict) -> str:
    lines = []
    if out["inputs"].get("default_target"):
        lines += textwrap.wrap(f"target: {out['inputs']['default_target']}", 100,
                               subsequent_indent="  ")
    name = out["objective"]
    if out["feasible"]:
        lines.append(f"best design: {_describe(out['design'])}")
        lines.append(f"{name}: {out['objective_value']:.6g} (relaxed "
                     f"{out['relaxed_objective_value']:.6g})")
        m, r = out["metrics"], out["relaxed_metrics"]
        lines.append(f"{'metric':<22}{'hardened':>14}{'relaxed':>14}")
        for key in ("tput_per_chip_total", "interactivity", "ttft_s", "tpot_s", "e2e_s",
                    "power_w_modelled", "tok_s_per_kw_tdp", "j_per_output_token",
                    "running_batch", "max_batch"):
            lines.append(f"{key:<22}{m[key]:>14.6g}{r[key]:>14.6g}")
        lines.append("binding: " + (", ".join(out["binding"]) or "none"))
        for key, entry in out.get("blocking", {}).items():
            need = (f"a limit of {entry['needs']:.4g} {entry['unit']}" if "needs" in entry
                    else f"{entry['excess']:.3g} more memory")
            lines.append(f"  blocked by {key}: a better grid neighbour needs {need}")
    else:
        c = out["closest"]
        lines.append("INFEASIBLE: no design in the grid meets every target")
        lines.append(f"closest trade-off: {_describe(c['design'])}")
        for key, value in c["achievable"].items():
            lines.append(f"  best achievable {key}: {value:.6g}")
        lines.append("violated: " + ", ".join(out["binding"]))
    for key, entry in out["multipliers"].items():
        text = f"  lambda[{key}] = {entry['lambda']:.4g} (relaxed {entry['relaxed_lambda']:.4g})"
        if "per_unit" in entry:
            text += f"  ({entry['per_unit']:+.4g} {entry['unit']})"
        lines.append(text)
    if out["result"] == "nonlinear_max_steps_reached":
        lines.append("note: the local search stopped at its cap on moves while still "
                     "improving; the design may not be locally best")
    if out.get("screened_out"):
        lines.append(f"layouts screened out: "
                     f"{', '.join(out['screened_out'])}")
    lines.append(f"grid {out['grid_points']} designs, {out['evaluations']} exact evaluations, "
                 f"wall {out['wall_s']:.2f} s")
    if "exhaustive" in out:
        ex = out["exhaustive"]
        if ex["feasible"]:
            lines.append(f"exhaustive: {_describe(ex['design'])}")
            lines.append(f"exhaustive {name}: {ex['objective_value']:.6g} over {ex['points']} "
                         f"points, wall {ex['wall_s']:.2f} s")
        else:
            lines.append(f"exhaustive: infeasible over {ex['points']} points, wall "
                         f"{ex['wall_s']:.2f} s")
    return "\n".join(lines)


#: Exit status when no design of the grid meets every target (the report, with the closest
#: trade-off, is printed all the same); 2 stays the status of bad input.
EXIT_INFEASIBLE = 1


def run(args) -> int:
    out, launch = _result(args)
    out = _clean(out)
    if args.format == "json":
        print(json.dumps(out, indent=1, allow_nan=False))
    else:
        print(_table(out))
        if launch is not None:
            print(launch.text())
    refused = out.get("launch", {}).get("refused")
    if refused:
        raise ValueError(f"--emit {args.emit}: {refused}")
    return 0 if out["feasible"] else EXIT_INFEASIBLE
