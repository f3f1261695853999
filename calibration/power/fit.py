"""Refit the power model: `python calibration/power/fit.py` (about 3 minutes on 2 cores).

Writes perfmodel/data/fitted_power.json, calibration/power/report.json and report.md:
the fit on all rows, held-out errors on a random 20% split (seed 0) and leave-one-chip-out
(A100, H100, B200), and the host-overhead bounds from the MLPerf wall-power rows.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

from perfmodel import calibration_power as cp  # noqa: E402
from perfmodel import fitted as fitted_params  # noqa: E402
from perfmodel.presets import get_chip  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SEED = 0
REFERENCE = {"ampere": "a100", "hopper": "h100", "blackwell": "b200"}


def heldout_full(rows, test, fitted):
    """Errors of the full serving model (`predict_power_rows`) on held-out rows."""
    preds = cp.predict_power_rows([rows[i] for i in test], fitted)
    out = {}
    for key, meas in (("power", "avg_power_w_per_gpu"),
                      ("j_per_token", "energy_j_per_output_token"),
                      ("output_tok_s", "output_tokens_per_s_per_gpu")):
        pred_key = {"power": "pred_power_w_modelled",
                    "j_per_token": "pred_j_per_output_token",
                    "output_tok_s": "pred_output_tput_per_chip"}[key]
        rel = np.asarray([abs(p[pred_key] / float(p[meas]) - 1.0) for p in preds
                          if p["pred_status"] == "ok"])
        out[key] = {"median_abs_pct": float(np.median(rel) * 100),
                    "p90_abs_pct": float(np.percentile(rel, 90) * 100), "n": int(rel.size)}
    return out


def host_bounds(rows, fitted):
    """Host (non-GPU) wall power of the MLPerf servers: lower bound wall - 8 x GPU cap,
    upper bound wall - 8 x fitted idle power."""
    out = []
    for row in rows:
        if not row["source_family"].startswith("MLPerf") or not row["system_wall_power_w"]:
            continue
        chip = fitted_params.apply(get_chip(row["hardware"], calibrated=False, label=True),
                                   power=fitted)
        n = int(float(row["num_gpus"]))
        wall = float(row["system_wall_power_w"])
        cap = float(row["gpu_power_limit_w"] or chip.tdp)
        lower = wall - n * cap
        upper = wall - n * float(chip.idle_power)
        out.append({"row_id": row["row_id"], "hardware": row["hardware"].split(" (")[0],
                    "model": row["model"].split(" (")[0], "scenario": row["workload"],
                    "wall_w": wall, "gpu_cap_w": cap, "host_w_min": lower,
                    "host_w_max": upper, "host_w_per_gpu_min": lower / n,
                    "host_w_per_gpu_max": upper / n, "source": row["source"]})
    return out


def main(argv=None):
    rows = cp.read_rows(HERE / "power_measurements.csv")
    specs, skipped = cp.specs_of(rows)
    features = cp.features_of(specs)
    usable = cp.usable(features)
    chips = {fam: get_chip(name, calibrated=False) for fam, name in REFERENCE.items()}
    report = {"rows": len(rows), "evaluated": len(specs), "usable": len(usable),
              "skipped": {}, "seed": SEED, "assumed_isl": cp.ASSUMED_ISL}
    for _, why in skipped:
        report["skipped"][why] = report["skipped"].get(why, 0) + 1

    # Fit on all usable rows.
    full = cp.fit_power(cp.make_batch(features, usable), seed=SEED)
    fitted = cp.to_fitted(full.params, chips)
    fitted.update(result=full.result, loss=float(full.loss), rows=len(usable),
                  data="calibration/power/power_measurements.csv (ML.ENERGY v2/v3, "
                       "InferenceX power runs)", refit="python calibration/power/fit.py")
    report["fit_all"] = {"result": full.result,
                         "in_sample": cp.errors(full.params, cp.make_batch(features, usable))}

    # Random 20% hold-out.
    rng = np.random.default_rng(SEED)
    order = rng.permutation(usable)
    cut = len(order) // 5
    test, train = sorted(order[:cut].tolist()), sorted(order[cut:].tolist())
    split = cp.fit_power(cp.make_batch(features, train), seed=SEED)
    report["heldout_random"] = {
        "result": split.result, "train": len(train), "test": len(test),
        "reduced": cp.errors(split.params, cp.make_batch(features, test)),
        "full_model": heldout_full(rows, test, cp.to_fitted(split.params, chips))}

    # Leave one chip out: the held-out chip takes the generic set.
    report["leave_one_chip_out"] = {}
    for family, name in REFERENCE.items():
        fam_rows = [i for i in usable if features[i]["spec"].chip_name == name]
        rest = [i for i in usable if features[i]["spec"].chip_name != name]
        loco = cp.fit_power(cp.make_batch(features, rest, holdout=family), seed=SEED)
        report["leave_one_chip_out"][name] = {
            "result": loco.result, "train": len(rest),
            "test": cp.errors(loco.params, cp.make_batch(features, fam_rows,
                                                         holdout=family))}
    report["host_overhead_mlperf"] = host_bounds(rows, fitted)
    report["fitted"] = fitted
    fitted_params.write(fitted, ROOT / "perfmodel" / "data" / fitted_params.POWER_FILE)
    (HERE / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (HERE / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def _err(e):
    return (f"{e['power']['median_abs_pct']:.1f}% / {e['j_per_token']['median_abs_pct']:.1f}% "
            f"(p90 {e['power']['p90_abs_pct']:.0f}% / {e['j_per_token']['p90_abs_pct']:.0f}%, "
            f"n={e['power']['n']})")


def markdown(r):
    lines = ["# Power calibration report", "",
             f"Rows: {r['rows']}; evaluated: {r['evaluated']}; with power, J/token and a "
             f"configuration that fits: {r['usable']}. Seed {r['seed']}.", "",
             "Median absolute error, power per GPU / J per output token:", "",
             "| evaluation | power / J per token |", "| --- | --- |",
             f"| in-sample (all rows) | {_err(r['fit_all']['in_sample'])} |",
             f"| held-out random 20%, reduced model | "
             f"{_err(r['heldout_random']['reduced'])} |"]
    full = r["heldout_random"]["full_model"]
    lines.append(f"| held-out random 20%, full serving model | {_err(full)}; output tok/s "
                 f"{full['output_tok_s']['median_abs_pct']:.1f}% |")
    for chip, e in r["leave_one_chip_out"].items():
        lines.append(f"| leave {chip} out (generic set) | {_err(e['test'])} |")
    lines += ["", "Host overhead of MLPerf servers (wall minus GPUs; min: GPUs at their cap, "
              "max: GPUs idle):", "", "| row | system | model | scenario | wall W | host W "
              "per GPU (min-max) |", "| --- | --- | --- | --- | --- | --- |"]
    for h in r["host_overhead_mlperf"]:
        lines.append(f"| {h['row_id']} | {h['hardware']} | {h['model']} | {h['scenario']} | "
                     f"{h['wall_w']:.0f} | {h['host_w_per_gpu_min']:.0f}-"
                     f"{h['host_w_per_gpu_max']:.0f} |")
    f = r["fitted"]
    generic = {k: (v[0] if isinstance(v, list) else v) for k, v in f["generic"].items()}
    lines += ["", "Fitted (fractions of TDP drawn by each unit alone at its peak rate):", "",
              f"generic: {json.dumps(generic)}"]
    for fam, v in f["families"].items():
        e = v["energy"]
        lines.append(f"- {fam} ({v['reference_chip']}): "
                     f"{e['per_flop'][0] * 1e12:.3f} pJ/FLOP bf16, "
                     f"{e['per_hbm_byte'] * 1e12:.1f} pJ/HBM byte, "
                     f"{e['per_link_byte'] * 1e12:.1f} pJ/link byte, active "
                     f"{e['active_power']:.0f} W while kernels run, idle "
                     f"{v['idle_fraction']:.3f} x TDP")
    for name, v in f["runtimes"].items():
        lines.append(f"- runtime {name}: {v['step_overhead'] * 1e3:.2f} ms per step + "
                     f"{v['seq_overhead'] * 1e6:.1f} us per running sequence; expert "
                     f"kernels at {v['expert_efficiency']:.2f} of dense speed; pipeline "
                     f"overlap {v['pipeline_overlap']:.2f}; kernels at "
                     + ", ".join(f"{k:.2f} ({fam})"
                                 for fam, k in v.get("kernel_efficiency", {}).items())
                     + " of the latency fit's speed")
    lines += ["", "Skipped rows: " + "; ".join(f"{k} ({v})" for k, v in r["skipped"].items()),
              ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
