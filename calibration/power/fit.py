"""Refit the power model: `python calibration/power/fit.py` (about 3-6 minutes on 2 cores).

Writes perfmodel/data/fitted_power.json, calibration/power/report.json and report.md:
the fit on all rows, held-out errors on a random 20% split (seed 0), on whole models held
out (5 folds over the models, seed 0) and leave-one-chip-out (A100, H100, B200; each also
solved from the all-rows fit), and the host-overhead bounds from the MLPerf wall-power rows.
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
from perfmodel.calibration_power import intervals  # noqa: E402
from perfmodel.presets import get_chip  # noqa: E402
from perfmodel.solvers import message, succeeded  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SEED = 0
#: Folds of the whole-model hold-out (each model held out once).
FOLDS = 5
REFERENCE = {"ampere": "a100", "hopper": "h100", "blackwell": "b200"}
#: Level of the prediction intervals whose coverage the report gives.
LEVEL = 0.9


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


def _log_residuals(problem, predictions, indices) -> dict:
    """log(measured / predicted) of the rows `indices` (`RowSpec.index`, in that order),
    per interval metric (`intervals.COLUMNS`); NaN where not measured."""
    where = {int(i): j for j, i in enumerate(problem.index)}
    rows = np.asarray([where[int(i)] for i in indices], dtype=int)
    out = {}
    for key, predicted, measured in cp.metric_pairs(problem, predictions):
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.log(measured[rows] / predicted[rows])
        out[key] = np.where(np.isfinite(e), e, np.nan).tolist()
    return out


def _result(fit):
    return "successful" if succeeded(fit.result) else message(fit.result)


def main(argv=None):
    rows = cp.read_rows(HERE / "power_measurements.csv")
    specs, skipped = cp.specs_of(rows)
    problem = cp.build_problem(specs)
    chips = {fam: get_chip(name, calibrated=False) for fam, name in REFERENCE.items()}
    # Every evaluation is `cp.evaluate` on all rows: one compiled program.
    usable = cp.usable(problem, cp.evaluate(cp.PowerParams.prior(), problem))
    report = {"rows": len(rows), "evaluated": len(specs), "usable": len(usable),
              "skipped": {}, "seed": SEED, "assumed_isl": cp.ASSUMED_ISL}
    for _, why in skipped:
        report["skipped"][why] = report["skipped"].get(why, 0) + 1

    def solve(train, holdout=None, start=None):
        fit = cp.fit_power(problem, problem.weights(train), holdout, start=start)
        return fit, {"result": _result(fit), "steps": int(fit.steps),
                     "loss": float(fit.loss), "train": len(train)}

    # Fit on all usable rows.
    full, report["fit_all"] = solve(usable)
    report["fit_all"]["in_sample"] = cp.errors(problem, cp.evaluate(full.params, problem),
                                               usable)
    fitted = cp.to_fitted(full.params, chips)
    fitted.update(result=_result(full), loss=float(full.loss), steps=int(full.steps),
                  rows=len(usable),
                  data="calibration/power/power_measurements.csv (ML.ENERGY v2/v3, "
                       "InferenceX power runs)", refit="python calibration/power/fit.py")

    # Random 20% hold-out.
    rng = np.random.default_rng(SEED)
    order = rng.permutation(usable)
    cut = len(order) // 5
    test, train = sorted(order[:cut].tolist()), sorted(order[cut:].tolist())
    split, report["heldout_random"] = solve(train)
    report["heldout_random"]["test"] = cp.errors(problem, cp.evaluate(split.params, problem),
                                                 test)

    # Whole models held out: the models in FOLDS folds (a seeded permutation, dealt round
    # robin), each fold's rows predicted by the fit without its models (their chips and
    # engines still seen): what the power terms carry to a model never measured. Every
    # usable row is predicted once; the pooled errors are over all of them.
    model_of = {s.index: s.model.name for s in specs}
    models = np.random.default_rng(SEED).permutation(sorted({model_of[i] for i in usable}))
    pooled = {key: np.full(len(problem.index), np.nan) for key in ("power", "joules",
                                                                    "tok_s")}
    report["heldout_models"] = {"folds": FOLDS, "seed": SEED, "per_fold": []}
    fold_of = {}
    for k in range(FOLDS):
        names = sorted(models[k::FOLDS].tolist())
        held = [i for i in usable if model_of[i] in names]
        fold_of.update(dict.fromkeys(held, k))
        fold, entry = solve([i for i in usable if model_of[i] not in names])
        predicted = cp.evaluate(fold.params, problem)
        entry.update(models=names, test=cp.errors(problem, predicted, held))
        report["heldout_models"]["per_fold"].append(entry)
        chosen = np.isin(np.asarray(problem.index), held)
        for key in pooled:
            pooled[key] = np.where(chosen, np.asarray(getattr(predicted, key)), pooled[key])
    out_of_model = cp.RowPredictions(power=pooled["power"], joules=pooled["joules"],
                                     tok_s=pooled["tok_s"],
                                     fits=np.ones(len(pooled["power"]), bool))
    report["heldout_models"]["test"] = cp.errors(problem, out_of_model, usable)

    # Leave one chip out: the held-out chip takes the generic set. Also solved from the
    # all-rows fit (which has seen the held-out rows): which optimum the data without one
    # chip lead to, and what the other one would predict (calibration/power/README.md).
    report["leave_one_chip_out"] = {}
    chip_of = {s.index: s.chip_name for s in specs}
    unmeasured = {key: [] for key in intervals.COLUMNS}
    unmeasured_chips = []
    for family, name in REFERENCE.items():
        rest = [i for i in usable if chip_of[i] != name]
        held = [i for i in usable if chip_of[i] == name]
        loco, entry = solve(rest, family)
        predicted = cp.evaluate(loco.params, problem, family)
        entry["test"] = cp.errors(problem, predicted, held)
        for key, residual in _log_residuals(problem, predicted, held).items():
            unmeasured[key].extend(residual)
        unmeasured_chips.extend([name] * len(held))
        warm, entry["from_all_rows_fit"] = solve(rest, family, start=full.params)
        entry["from_all_rows_fit"]["test"] = cp.errors(
            problem, cp.evaluate(warm.params, problem, family), held)
        report["leave_one_chip_out"][name] = entry
    # Prediction intervals from the whole-model folds' residuals (every usable row,
    # predicted by the fit without its model) and the leave-one-chip-out ones
    # (`perfmodel.calibration_power.intervals`), with their nested cross-validated coverage.
    residual = _log_residuals(problem, out_of_model, usable)
    spec_of = {s.index: s for s in specs}
    groups = [intervals.group_key(spec_of[i].framework,
                                  get_chip(spec_of[i].chip_name, calibrated=False).family,
                                  cp.FAMILIES) for i in usable]
    fitted["intervals"] = intervals.estimate(residual, groups, unmeasured)
    report["intervals"] = intervals.coverage(residual, groups, [fold_of[i] for i in usable],
                                             unmeasured, unmeasured_chips, LEVEL)
    report["intervals"]["level"] = LEVEL
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


def _interval_lines(cov, table):
    level = cov["level"]
    names = {"power": "power/GPU", "j_per_token": "J per output token",
             "output_tok_s": "output tok/s per GPU"}
    lines = ["", f"Prediction intervals ({level:.0%}, `perfmodel/calibration_power/"
             "intervals.py`): share of rows inside, by nested cross-validation (each "
             "whole-model fold against intervals sized on the other folds' residuals; each "
             "left-out chip against the other chips' leave-one-out residuals):", "",
             "| metric | whole models held out | median hi/lo | per group | per fold | "
             "left-out chips (generic set) |", "| --- | ---: | ---: | --- | --- | --- |"]
    for key, c in cov.items():
        if key == "level":
            continue
        groups = ", ".join(f"{g} {v['inside']:.0%} (n={v['n']})"
                           for g, v in c["groups"].items())
        folds = " / ".join(f"{x:.0%}" for x in c["folds"])
        chips = ", ".join(f"{chip} {v['inside']:.0%} (n={v['n']})"
                          for chip, v in c["unmeasured"].items())
        lines.append(f"| {names[key]} | {c['inside']:.1%} (n={c['n']}) | "
                     f"{c['median_width']:.2f}x | {groups} | {folds} | {chips} |")
    lines += ["", "Shipped scales (robust sd of log residuals per group; `unmeasured`: a "
              "family the power fit did not measure): " + "; ".join(
                  f"{names[k]}: " + ", ".join(f"{g} {s:.3f}" for g, s in v["scales"].items())
                  for k, v in table["metrics"].items()) + "."]
    return lines


def markdown(r):
    lines = ["# Power calibration report", "",
             f"Rows: {r['rows']}; evaluated: {r['evaluated']}; with power, J/token and a "
             f"configuration that fits: {r['usable']}. Seed {r['seed']}.", "",
             "Median absolute error, power per GPU / J per output token:", "",
             "| evaluation | power / J per token |", "| --- | --- |",
             f"| in-sample (all rows) | {_err(r['fit_all']['in_sample'])} |"]
    full = r["heldout_random"]["test"]
    lines.append(f"| held-out random 20% | {_err(full)}; output tok/s "
                 f"{full['output_tok_s']['median_abs_pct']:.1f}% |")
    models = r["heldout_models"]
    lines.append(f"| whole models held out ({models['folds']} folds over "
                 f"{sum(len(f['models']) for f in models['per_fold'])} models, seed "
                 f"{models['seed']}; each row predicted by the fit without its model) | "
                 f"{_err(models['test'])}; output tok/s "
                 f"{models['test']['output_tok_s']['median_abs_pct']:.1f}% |")
    for chip, e in r["leave_one_chip_out"].items():
        lines.append(f"| leave {chip} out (generic set) | {_err(e['test'])} |")
    for chip, e in r["leave_one_chip_out"].items():
        lines.append(f"| leave {chip} out, solved from the all-rows fit (has seen {chip}) | "
                     f"{_err(e['from_all_rows_fit']['test'])} |")
    fits = {"all rows": r["fit_all"], "random 80%": r["heldout_random"],
            **{f"models fold {k + 1}": f for k, f in enumerate(models["per_fold"])},
            **{f"without {c}": e for c, e in r["leave_one_chip_out"].items()},
            **{f"without {c} from all rows": e["from_all_rows_fit"]
               for c, e in r["leave_one_chip_out"].items()}}
    lines += ["", "Fits (optimistix Levenberg-Marquardt on `serving.predict`): "
              + "; ".join(f"{k} {v['result']} in {v['steps']} steps, loss {v['loss']:.5f}"
                          for k, v in fits.items()) + "."]
    lines += ["", "Whole-model folds (held-out models; power / J per token on their rows):",
              ""] + [f"- fold {k + 1}: {', '.join(f['models'])}: {_err(f['test'])}"
                     for k, f in enumerate(models["per_fold"])]
    if "intervals" in r:
        lines += _interval_lines(r["intervals"], r["fitted"]["intervals"])
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
