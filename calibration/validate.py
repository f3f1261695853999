"""Fit and validate: `python calibration/validate.py [--no-refit] [--skip-loco]`.

In one process (the fit is compiled once and cached on disk, every refit is a weight mask):
(a) the shipped fit on 80 % of the InferenceMAX rows plus GEMM/NCCL (written to
`perfmodel/data/fitted_params.json`, see `fit.py`), its errors on those rows; (b) its errors
on the held-out 20 % (`calibration/heldout.json`, never fitted); (c) leave-one-chip-out:
refit from the priors without every sample of a chip (InferenceMAX, GEMM, NCCL), then predict
all of that chip's rows from its specs with its family's (or the fallback family's)
parameters and the remaining frameworks' parameters.

Reports median and 90th-percentile absolute percentage error (APE) of throughput per GPU,
median TPOT and median TTFT, and median APE of median E2E, per (model, chip, framework) and
overall, and which groups the held-out rows' worst tenth of throughput, TPOT and TTFT
errors come from (by framework, attention DP, disaggregation, input length and MTP).
Writes `calibration/validation.md`, `calibration/validation.json`, the tables into
`calibration/README.md` and `docs/parity.png` (predicted vs measured, log-log).

`--trtllm` is an experiment: every fit also takes 80 % of TensorRT-LLM's Offline
throughput rows (`trtllm_check.bench_rows`, a fixed seed), and the report gains their
errors, (d) fitted and (e) held out. It writes nothing of the shipped files (the fit, the
held-out list, the tables, the plot); it prints the tables and writes them to `--json`
when given.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import tempfile
import time
from collections import defaultdict

import fit as fitting
import numpy as np

from perfmodel import calibration as cal
from perfmodel import fitted as shipped
from perfmodel.presets import chip_key

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
METRICS = ("tput_per_gpu", "median_tpot_s", "median_ttft_s", "median_e2el_s")
LOCO_CHIPS = ("b200", "gb200", "h200", "mi300x", "mi355x")


def model_name(name: str) -> str:
    return "deepseek-r1" if name.lower().startswith("deepseek") else name.lower()


def ape_table(rows, predictions, fits):
    """{(model, chip, framework): {metric: [APE %], "nofit": count}} plus "all"."""
    out = defaultdict(lambda: defaultdict(list))
    for row, k in rows:
        key = (model_name(row.model), chip_key(row.hardware), row.framework)
        for target in (key, ("all", "", "")):
            out[target]["nofit"].append(0 if fits[k] else 1)
            for metric in METRICS:
                if metric in row.measured and np.isfinite(predictions[metric][k]):
                    out[target][metric].append(
                        abs(predictions[metric][k] / row.measured[metric] - 1.0) * 100.0)
    return out


def summarize(table) -> list[dict]:
    lines = []
    for key in sorted(table, key=lambda k: (k[0] == "all", k)):
        errors = table[key]
        tput = np.array(errors.get("tput_per_gpu") or [np.nan])
        entry = {"model": key[0], "chip": key[1], "framework": key[2], "n": len(tput),
                 "nofit": int(sum(errors["nofit"])),
                 "tput_median": float(np.median(tput)),
                 "tput_p90": float(np.percentile(tput, 90))}
        for metric, short in (("median_tpot_s", "tpot"), ("median_ttft_s", "ttft"),
                              ("median_e2el_s", "e2e")):
            values = errors.get(metric, [])
            entry[f"{short}_median"] = float(np.median(values)) if values else float("nan")
            entry[f"{short}_p90"] = float(np.percentile(values, 90)) if values else float("nan")
        lines.append(entry)
    return lines


#: The metrics whose worst tenth of held-out rows `tail` groups: (the predictions' and
#: measurements' key, the report's name, the caption's words).
TAILS = (("tput_per_gpu", "throughput", "throughput per GPU"),
         ("median_tpot_s", "TPOT", "median TPOT"),
         ("median_ttft_s", "TTFT", "median TTFT"))


def tail(rows, predictions, fits, metric: str) -> dict:
    """The rows at or above the 90th percentile of `metric`'s error: count per (model,
    chip, framework, attention DP, aggregated or disaggregated, input length, MTP),
    under- and over-predicted."""
    errors = [(row, predictions[metric][k] / row.measured[metric] - 1.0)
              for row, k in rows if metric in row.measured
              and np.isfinite(predictions[metric][k]) and fits[k]]
    if not errors:
        return {"p90": float("nan"), "n": 0, "groups": []}
    p90 = float(np.percentile([abs(e) for _, e in errors], 90))
    groups = defaultdict(lambda: [0, 0])
    for row, e in errors:
        if abs(e) >= p90:
            pool = row.layout or row.decode
            key = (model_name(row.model), chip_key(row.hardware), row.framework,
                   "DP" if pool is not None and pool.dp_attention else "-",
                   "aggregated" if row.layout is not None else "disaggregated",
                   int(row.isl), "MTP" if row.mtp else "-")
            groups[key][int(e > 0)] += 1
    ordered = sorted(groups.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    return {"p90": p90 * 100.0, "n": sum(sum(v) for v in groups.values()),
            "groups": [{"model": k[0], "chip": k[1], "framework": k[2], "attention": k[3],
                        "serving": k[4], "isl": k[5], "mtp": k[6], "under": v[0],
                        "over": v[1]} for k, v in ordered]}


def tail_markdown(title: str, worst: dict, what: str) -> str:
    text = [f"#### {title}", "",
            f"The {worst['n']} rows at or above the 90th percentile of {what} error "
            f"({worst['p90']:.1f} %), per group (attention `DP`: data-parallel attention in "
            "the row's pool, the decode pool when disaggregated; input length in tokens; "
            "MTP: speculative decoding with the model's MTP layers):", "",
            "| model | chip | framework | attention | serving | input | MTP | "
            "under-predicted | over-predicted |",
            "| --- | --- | --- | --- | --- | ---: | --- | ---: | ---: |"]
    for g in worst["groups"]:
        text.append(f"| {g['model']} | {g['chip']} | {g['framework']} | {g['attention']} | "
                    f"{g['serving']} | {g['isl']:,} | {g['mtp']} | {g['under']} | "
                    f"{g['over']} |")
    return "\n".join(text) + "\n"


def markdown(title: str, lines: list[dict]) -> str:
    text = [f"#### {title}", "",
            "| model | chip | framework | n | no fit | tput/GPU med | tput/GPU p90 | "
            "TPOT med (p90) | TTFT med (p90) | E2E med |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for e in lines:
        name = "**all**" if e["model"] == "all" else e["model"]
        text.append(f"| {name} | {e['chip']} | {e['framework']} | {e['n']} | {e['nofit']} | "
                    f"{e['tput_median']:.1f}% | {e['tput_p90']:.1f}% | "
                    f"{e['tpot_median']:.1f}% ({e['tpot_p90']:.1f}%) | "
                    f"{e['ttft_median']:.1f}% ({e['ttft_p90']:.1f}%) | "
                    f"{e['e2e_median']:.1f}% |")
    return "\n".join(text) + "\n"


def parity_plot(sets, path, fits):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6))
    for ax, (metric, label) in zip(axes, (("tput_per_gpu", "throughput per GPU (tok/s)"),
                                          ("median_tpot_s", "median TPOT (s)"),
                                          ("median_ttft_s", "median TTFT (s)")), strict=True):
        lo, hi = np.inf, 0.0
        for (name, (rows, preds)), color in zip(sets.items(), ("tab:blue", "tab:orange",
                                                                "tab:red"), strict=False):
            pairs = [(r.measured[metric], preds[metric][k]) for r, k in rows
                     if metric in r.measured and np.isfinite(preds[metric][k])
                     and preds[metric][k] > 0 and fits[k]]
            if not pairs:
                continue
            x, y = np.array(pairs).T
            ax.scatter(x, y, s=6, alpha=0.5, label=name, color=color)
            lo, hi = min(lo, x.min(), y.min()), max(hi, x.max(), y.max())
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        for f in (0.75, 1.25):
            ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.legend(fontsize=7)
    fig.suptitle(f"perfmodel vs InferenceMAX (dotted: +-25 %; the {int((~fits).sum())} rows "
                 "that do not fit in HBM in the model are left out)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_section(path: pathlib.Path, text: str, tag: str = "VALIDATION") -> None:
    begin, end = f"<!-- {tag}:BEGIN -->", f"<!-- {tag}:END -->"
    body = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in body:
        body = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, body,
                      flags=re.S)
    else:
        body = body.rstrip() + "\n\n" + block + "\n"
    path.write_text(body)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-refit", action="store_true",
                        help="validate the shipped fitted_params.json instead of refitting")
    parser.add_argument("--skip-loco", action="store_true")
    parser.add_argument("--trtllm", action="store_true",
                        help="also fit 80 %% of TensorRT-LLM's Offline throughput rows in "
                             "every fit (tables (d), (e): fitted and held-out ones)")
    parser.add_argument("--json", help="with --trtllm: write the report to this file")
    parser.add_argument("--max-steps", type=int, default=fitting.MAX_STEPS)
    parser.add_argument("--chips", default=",".join(LOCO_CHIPS))
    parser.add_argument("--pooling", type=float, default=fitting.POOLING,
                        help="partial pooling scale of the families (<= 0: none)")
    parser.add_argument("--devices", type=fitting.devices_arg, default=None,
                        help="split the InferenceMAX rows of every fit and prediction over "
                             "this many local devices, or 'all' (default: one device)")
    fitting.add_hop_arguments(parser)
    args = parser.parse_args(argv)
    pooling = args.pooling if args.pooling > 0 else None
    clock = {}
    start = time.time()
    rows, gemm, nccl = fitting.load_all()
    fitted, held = fitting.split(rows)
    trt = fitting.load_trtllm() if args.trtllm else []
    fitted_trt, held_trt = fitting.split(trt)
    if not args.trtllm:
        fitting.write_heldout(held)
    problem = cal.Calibration(rows + trt, gemm, nccl, devices=args.devices)
    t = time.time()
    out = pathlib.Path(tempfile.mkdtemp()) / "fitted_params.json" if args.trtllm \
        else fitting.OUTPUT
    data = shipped.read(shipped.LATENCY_FILE) if args.no_refit else fitting.shipped_fit(
        problem, fitted + fitted_trt, held, gemm, nccl, out=out, max_steps=args.max_steps,
        pooling=pooling, hops=args.hops, seed=args.seed)
    clock["fit_s"] = round(time.time() - t, 1)
    print(f"{'shipped fit (read)' if args.no_refit else 'fit'}: {data['result']} after "
          f"{data['steps']} steps ({clock['fit_s']} s, compile included)", flush=True)
    t = time.time()
    params = cal.from_json(data)
    preds = problem.predict(params)
    fits = problem.fits()
    clock["predict_s"] = round(time.time() - t, 1)
    position = problem.position
    report, sets = {"fit": {k: data.get(k) for k in ("result", "steps", "loss", "date",
                                                     "pooling")}}, {}
    for name, subset in (("fitted", fitted), ("held-out 20%", held)):
        pairs = [(r, position[r.index]) for r in subset]
        report[name] = summarize(ape_table(pairs, preds, fits))
        for metric, label, _ in TAILS:
            report[f"{name} {label} tail"] = tail(pairs, preds, fits, metric)
        sets[name] = (pairs, preds)
    for name, subset in (("TensorRT-LLM Offline fitted", fitted_trt),
                         ("TensorRT-LLM Offline held-out 20%", held_trt)):
        if subset:
            report[name] = summarize(ape_table([(r, position[r.index]) for r in subset],
                                               preds, fits))
    if not args.skip_loco:
        t = time.time()
        loco_pairs, loco_preds, meta = [], {m: np.full(len(rows), np.nan) for m in METRICS}, {}
        for chip in args.chips.split(","):
            t_chip = time.time()
            result, families, frameworks = problem.fit(fitted + fitted_trt, exclude_chip=chip,
                                                       max_steps=args.max_steps,
                                                       pooling=pooling, hops=args.hops,
                                                       seed=args.seed)
            p = result.params.subset(families, frameworks)
            # A family left without data: the pooled row when pooling, else the sibling.
            fallback = {f: cal.POOLED for f in cal.FAMILY_FALLBACK} if pooling else None
            pred = problem.predict(p, fallback)
            chip_rows = [(r, position[r.index]) for r in rows if chip_key(r.hardware) == chip]
            for _, k in chip_rows:
                for m in METRICS:
                    loco_preds[m][k] = pred[m][k]
            loco_pairs += chip_rows
            meta[chip] = {"result": fitting.result_text(result.result),
                          "steps": int(result.steps),
                          "seconds": round(time.time() - t_chip, 1),
                          "basis": sorted({pred["basis"][k] for _, k in chip_rows}),
                          "frameworks_fitted": list(frameworks)}
            print(chip, meta[chip], flush=True)
        clock["loco_s"] = round(time.time() - t, 1)
        report["leave-one-chip-out"] = summarize(ape_table(loco_pairs, loco_preds, fits))
        report["loco_meta"] = meta
        sets["leave-one-chip-out"] = (loco_pairs, loco_preds)
    clock["total_s"] = round(time.time() - start, 1)
    report["wall_clock"] = clock
    if args.trtllm:
        report["fitted_params"] = data
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    else:
        (HERE / "validation.json").write_text(json.dumps(report, indent=1) + "\n")
        (ROOT / "docs").mkdir(exist_ok=True)
        parity_plot(sets, ROOT / "docs" / "parity.png", fits)
    text = ["Absolute percentage error (APE) per (model, chip, framework); `no fit`: rows "
            "whose weights plus one sequence exceed the usable HBM in the model (their "
            "predictions collapse and are counted as they are). Generated by "
            f"`python calibration/validate.py{' --no-refit' if args.no_refit else ''}"
            f"{f' --hops {args.hops} --seed {args.seed}' if args.hops else ''}` "
            f"({'the shipped fit read, not refitted; ' if args.no_refit else ''}"
            f"wall clock: {', '.join(f'{k} {v}' for k, v in clock.items())}).", ""]
    for letter, name in zip("abcde", ("fitted", "held-out 20%", "leave-one-chip-out",
                                      "TensorRT-LLM Offline fitted",
                                      "TensorRT-LLM Offline held-out 20%"), strict=True):
        if name in report:
            text.append(markdown(f"({letter}) {name}", report[name]))
    for _, label, what in TAILS:
        if f"held-out 20% {label} tail" in report:
            text.append(tail_markdown(f"Held-out 20%: the worst tenth of {label}",
                                      report[f"held-out 20% {label} tail"], what))
    if "loco_meta" in report:
        text.append("Leave-one-chip-out refits: " + "; ".join(
            f"{c}: {m['result']} after {m['steps']} steps, predicted with "
            f"{', '.join(m['basis'])}" for c, m in report["loco_meta"].items()) + "\n")
    body = "\n".join(text)
    if not args.trtllm:
        (HERE / "validation.md").write_text(body)
        replace_section(HERE / "README.md", body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
