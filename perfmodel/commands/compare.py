"""`perfmodel compare`: the Jalapeno-style comparison of a chip against baselines."""

from __future__ import annotations

import argparse
import textwrap

from . import (
    add_format_arg,
    add_long_context_arg,
    check_lengths,
    progress,
    provenance,
    render,
    token_count,
)

#: Table columns: (row key, header, format).
COLUMNS = (
    ("model", "model", "s"),
    ("chip", "chip", "s"),
    ("baseline", "vs", "s"),
    ("mode", "mode", "s"),
    ("peak_tput_per_chip", "peak tok/s/chip", ".0f"),
    ("peak_tok_s_per_kw", "peak tok/s/kW", ".0f"),
    ("e2e_s_at_peak", "E2E@peak s", ".1f"),
    ("interactivity_at_peak", "tok/s/user@peak", ".1f"),
    ("interactivity_low_concurrency", "tok/s/user low", ".0f"),
    ("e2e_s_low_concurrency", "E2E low s", ".2f"),
    ("ratio_tok_s_per_kw_at_peak", "x tok/s/kW", ".2f"),
    ("ratio_e2e_latency", "x E2E", ".2f"),
    ("ratio_tok_s_per_kw_high_interactivity", "x tok/s/kW hi-int", ".2f"),
)
REPORTED = (("reported_ratio_tok_s_per_kw_at_peak", "rep x tok/s/kW", ".1f"),
            ("reported_ratio_e2e_latency", "rep x E2E", ".1f"))


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _chip_top(text: str):
    if text in ("same", "interactivity"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give same, interactivity or a positive "
                                         "number of requests per chip")
    return value


def _checks(rows) -> list[str]:
    """The consistency lines printed under the table (`claims.consistency`)."""
    lines = ["# checks (Little's law: x tok/s/kW = x E2E x TDP ratio x requests-per-chip "
             "ratio):"]
    for r in rows:
        head = f"#   {r['model']} vs {r['baseline']} ({r['mode']}):"
        text = (f"{head} requests/chip at peak {r['requests_per_chip_at_peak']:.1f} vs "
                f"{r['baseline_requests_per_chip_at_peak']:.1f} (x"
                f"{r['requests_per_chip_ratio_at_peak']:.2f}; x E2E x TDP x requests = "
                f"{r['littles_law_ratio_tok_s_per_kw']:.2f})")
        if "implied_requests_per_chip_ratio" in r:
            text += (f"; the reported pair implies x{r['implied_requests_per_chip_ratio']:.2f}")
        lines.append(text)
    reported = {r["model"]: r for r in rows if "implied_requests_per_chip_ratio" in r}
    for r in reported.values():
        for key, verdict in r.items():
            if key.startswith("check_"):
                name = key[len("check_"):].replace("_", " ").replace(" per ", "/")
                lines.append(f"#     {r['model']}: {name} {verdict}")
    return lines


def _inferred(chip: str, r: dict) -> list[str]:
    """The inferred fit's lines under the table: each parameter's value and how far the
    reported ratios identify it (`perfmodel.studies.inferred`)."""
    from ..studies.inferred import IDENTIFIED_BELOW, INFERRED, PLAUSIBLE_WIDTHS

    head = (f"# inferred {chip} ({r['inferred_result']}, {r['inferred_steps']} steps, loss "
            f"{r['inferred_loss']:.3g}; achievable HBM {r['inferred_hbm_tb_s_achievable']:.2f} "
            "TB/s): value (prior); prior and posterior widths of its log (times) or logit "
            f"(fractions); identified where posterior/prior < {IDENTIFIED_BELOW:g}")
    lines = textwrap.wrap(head, 100, subsequent_indent="#   ")

    def shown(name, value):
        return f"{value * 1e6:,.1f} us" if name.endswith(("latency", "overhead")) \
            else f"{value:.3f}"

    for name in INFERRED:
        key = f"inferred_{name}"
        verdict = "identified" if r[key + "_identified"] else "not identified"
        lines.append(f"#   {name} {shown(name, r[key])} ({shown(name, r[key + '_prior'])}): "
                     f"widths {r[key + '_prior_width']:.2f} -> {r[key + '_posterior_width']:.2f}"
                     f" (x{r[key + '_width_ratio']:.2f}, {verdict}; "
                     f"{r[key + '_widths_from_prior']:.1f} widths from the prior)")
    if r["inferred_implausible"]:
        lines.extend(textwrap.wrap(
            f"#   beyond {PLAUSIBLE_WIDTHS:g} prior widths (physically implausible): "
            f"{r['inferred_implausible']}", 100, subsequent_indent="#     "))
    return lines


def _claims(rows) -> list[str]:
    """Per row, each reported figure it evaluates against the report (`claim_<id>_*`), the
    inferred rows' fitted top concurrency beside the requests ratio the reported pair
    implies, and why a missed figure is missed (`inferred_unmet`)."""
    lines = ["# reported figures (value vs reported; ok: within 15 %):"]
    for r in rows:
        ids = [k[len("claim_"):-len("_value")] for k in r
               if k.startswith("claim_") and k.endswith("_value")]
        if not ids:
            continue
        parts = [f"{i} {r[f'claim_{i}_value']:.3g} vs {r[f'claim_{i}_reported']} "
                 f"{'ok' if r[f'claim_{i}_within_15pct'] else 'MISS'}" for i in ids]
        lines.extend(textwrap.wrap(f"#   {r['model']} ({r['mode']}): " + "; ".join(parts),
                                   100, subsequent_indent="#     "))
        key = "inferred_top_requests_per_chip"
        if key in r:
            verdict = "identified" if r[key + "_identified"] else "not identified"
            lines.append(
                f"#     fitted top {r[key]:.1f} requests/chip (predicted "
                f"{r[key + '_prior']:.1f}; widths {r[key + '_prior_width']:.2f} -> "
                f"{r[key + '_posterior_width']:.2f}, {verdict}): requests/chip at peak "
                f"x{r['requests_per_chip_ratio_at_peak']:.2f} the GPU's, the reported pair "
                f"implies x{r.get('implied_requests_per_chip_ratio', float('nan')):.2f}")
        if r.get("inferred_unmet"):
            for reason in r["inferred_unmet"].split("; "):
                lines.extend(textwrap.wrap(f"#     unmet: {reason}", 100,
                                           subsequent_indent="#       "))
    return lines


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "compare", help="a chip against baselines (the Jalapeno comparison)",
        description="Peak throughput per chip and per kW of TDP, E2E latency and "
                    "interactivity at the peak-throughput and low-concurrency points, and "
                    "the ratios between the chips, predicted from specs and inferred from "
                    "the reported ratios. Defaults: the three reported pairs (gpt-oss-120b "
                    "vs GB200, DeepSeek-R1 and Kimi-K2.5 vs GB300) at 8K/1K.")
    parser.add_argument("--model", default=None,
                        help="model(s), comma-separated (default: gpt-oss-120b,deepseek-r1,"
                             "kimi-k2.5)")
    parser.add_argument("--chips", default=None,
                        help="CHIP,BASELINE[,BASELINE...]: the chip compared, then one "
                             "baseline for all models or one per model (default: jalapeno "
                             "and each reported pair's baseline)")
    parser.add_argument("--isl", type=token_count, default=8192,
                        help="input length (default 8192)")
    parser.add_argument("--osl", type=token_count, default=1024,
                        help="output length (default 1024)")
    parser.add_argument("--mode", choices=("both", "predicted", "inferred"), default="both",
                        help="predicted from specs, inferred from the reported ratios, or "
                             "both (default)")
    parser.add_argument("--reported", action="store_true",
                        help="add the reported ratios (jalapeno_claims.csv) beside the "
                             "predicted ones")
    parser.add_argument("--peak", choices=("top", "floor"), default="top",
                        help="peak-throughput point: top (default, as InferenceX defines "
                             "it: the top of each chip's concurrency sweep; the GPU's top "
                             "from the InferenceMAX rows) or floor (the most throughput at "
                             "or above 10 tok/s/user)")
    parser.add_argument("--chip-top", type=_chip_top, default="same",
                        help="with --peak top, the compared chip's top concurrency: same "
                             "(default: the GPU's requests per chip, as one InferenceX "
                             "concurrency list runs on every chip), interactivity (the "
                             "requests per chip matching the GPU's tok/s/user at its top) or "
                             "a number of requests per chip")
    parser.add_argument("--gpu-recipe", choices=("on", "off"), default="on",
                        help="on (default): the GPU baselines of DeepSeek-V3-architecture "
                             "models also search the InferenceMAX Dynamo + TensorRT-LLM "
                             "configurations (disaggregated, wide EP with DP attention, MTP, "
                             "FP8 attention, fitted dynamo-trt runtime); off: the aggregated "
                             "sweep alone")
    parser.add_argument("--wide", type=int, default=128,
                        help="the compared chip's sweep covers up to this many chips of its "
                             "scale-up domain (default 128: Jalapeno's local network), so "
                             "tp/ep up to that width are considered")
    add_long_context_arg(parser)
    add_format_arg(parser)
    parser.set_defaults(func=run)
    return parser


def run(args) -> int:
    from ..presets import find_model
    from ..studies.claims import PAIRS
    from ..studies.jalapeno import compare

    check_lengths(args.isl, args.osl)
    models = _names(args.model) if args.model else [p[0] for p in PAIRS]
    for name in models:
        check_lengths(args.isl, args.osl, find_model(name), args.allow_long_context)
    chip, baselines = "jalapeno", None
    if args.chips:
        names = _names(args.chips)
        if len(names) < 2:
            raise ValueError(f"--chips {args.chips!r}: give the chip and at least one "
                             "baseline, e.g. jalapeno,gb200")
        chip, baselines = names[0], names[1:]
    modes = ("predicted", "inferred") if args.mode == "both" else (args.mode,)
    rows = compare(models, chip=chip, baselines=baselines, isl=args.isl, osl=args.osl,
                   reported=args.reported, modes=modes, progress=progress(args),
                   peak=args.peak, chip_top=args.chip_top, recipe=args.gpu_recipe == "on",
                   wide=args.wide)
    has_reported = args.reported and all(k in r for r in rows for k, _, _ in REPORTED)
    columns = COLUMNS + (REPORTED if has_reported else ())
    if args.format == "table":
        shown = [{k: row[k] for k, _, _ in columns} for row in rows]
        print(f"# {chip} vs baselines, ISL {args.isl} OSL {args.osl}; throughput per kW of "
              "rated TDP; ratios chip/baseline (E2E: baseline/chip)")
        print(render(shown, "table", columns))
        thresholds = ", ".join(f"{r['model']} {r['high_interactivity_threshold']:.0f}"
                               for r in rows if r["mode"] == rows[0]["mode"])
        if args.peak == "floor":
            peak = ("peak (--peak floor): the most tokens/s per chip at or above 10 "
                    "tokens/s/user")
        else:
            tops = "; ".join(f"{r['model']} {r['baseline']} "
                             f"{r['baseline_top_requests_per_chip']:.1f} "
                             f"({r['baseline_top_source']})"
                             for r in rows if r["mode"] == rows[0]["mode"])
            peak = ("peak (--peak top, InferenceX): the most tokens/s per chip at or below "
                    "each chip's top concurrency. GPU top, requests per GPU: " + tops +
                    f". {chip} top: {rows[0]['chip_top_rule']}"
                    + (f" ({rows[0]['chip_top_requests_per_chip']:.1f}/chip where it fits)"
                       if args.chip_top != "interactivity" else ""))
        print("\n".join(textwrap.wrap(
            f"# {peak}; low: the point of highest interactivity (one request per "
            "replica); hi-int: the most tok/s per kW of TDP at or above an interactivity "
            f"threshold, half the lower best of the two chips (tok/s/user: {thresholds})",
            100, subsequent_indent="#   ")))
        print("\n".join(_checks(rows)))
        print("# configurations at peak:")
        for r in rows:
            print(f"#   {r['model']} ({r['mode']}): {chip} {r['layout_at_peak']} on "
                  f"{r['chips']} chips; {r['baseline']} {r['baseline_layout_at_peak']} on "
                  f"{r['baseline_chips_at_peak']} chips")
        inferred = [r for r in rows if r["mode"] == "inferred"]
        if inferred:
            print("\n".join(_inferred(chip, inferred[0])))
        if args.reported:
            print("\n".join(_claims(rows)))
    else:
        inputs = provenance(command="compare", models=models, chip=chip,
                            baselines=baselines or sorted({r["baseline"] for r in rows}),
                            isl=args.isl, osl=args.osl, modes=list(modes),
                            reported=bool(args.reported), peak=args.peak,
                            chip_top=args.chip_top, gpu_recipe=args.gpu_recipe,
                            wide=args.wide)
        print(render(rows, args.format, columns, inputs=inputs))
    return 0
