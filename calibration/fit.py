"""Refit the shipped parameters: `python calibration/fit.py` (wall times, cold and with the
compiled solve cached, in calibration/README.md).

Fits per-family efficiency and collective terms and per-framework runtime overheads
(`perfmodel.calibration`) to the GEMM and NCCL tables and to 80 % of the InferenceMAX rows;
the other 20 % (a random split with a fixed seed) are held out and listed in
`calibration/heldout.json`, never fitted. Writes `perfmodel/data/fitted_params.json` and,
from the same fit rows, the prediction intervals' covariance and model-error terms
`perfmodel/data/fitted_intervals.json` (`perfmodel.calibration.intervals`; skip with
`--no-intervals`).
`--devices N` (or `all`) splits the InferenceMAX rows over N local devices
(`perfmodel.calibration.Calibration(devices=...)`; on CPU, fake ones with
`XLA_FLAGS=--xla_force_host_platform_device_count=N`); the default is one device.
`calibration/validate.py` runs this fit, the held-out check and leave-one-chip-out refits in
one process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import time

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)
# The compiled solve is cached on disk: a second run skips XLA compilation (not tracing).
jax.config.update("jax_compilation_cache_dir", os.environ.get(
    "PERFMODEL_JAX_CACHE", str(pathlib.Path.home() / ".cache" / "perfmodel" / "jax")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from perfmodel import calibration as cal  # noqa: E402
from perfmodel import datasets  # noqa: E402
from perfmodel import fitted as fitted_files  # noqa: E402
from perfmodel.commands import number  # noqa: E402
from perfmodel.presets import chip_key  # noqa: E402
from perfmodel.solvers import message, succeeded  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE / "data"
OUTPUT = HERE.parent / "perfmodel" / "data" / "fitted_params.json"
INTERVALS_OUTPUT = HERE.parent / "perfmodel" / "data" / "fitted_intervals.json"
FILES = ("benchmarks_inferencemax.csv", "benchmarks_aic_gemm.csv",
         "benchmarks_nccl_collectives.csv")
SEED = 0
HELDOUT_FRACTION = 0.2
#: Partial pooling of the chip families (`perfmodel.calibration.Prior`): each family's
#: parameters have a Gaussian of this many prior widths around a pooled row.
POOLING = 0.5
#: Basin-hopping moves of the joint solve (`perfmodel.calibration.hop`) and their seed: 0, one
#: solve from the priors; 30 reaches a lower minimum than that solve (calibration/README.md,
#: "Local minima of the fit").
HOPS = 30
HOP_SEED = 0
#: Levenberg-Marquardt steps at most (accepted or rejected) per stage. The leave-one-H200-out
#: refit takes 128 (the shipped fit 55): its last steps creep along a flat valley.
MAX_STEPS = 400


def load_all():
    rows = datasets.load_benchmarks(DATA / FILES[0], require_measured=True)
    gemm = datasets.load_gemm(DATA / FILES[1])
    nccl = datasets.load_nccl(DATA / FILES[2])
    return rows, gemm, nccl


def load_trtllm():
    """TensorRT-LLM's Offline throughput rows as fit rows (`trtllm_check.bench_rows`):
    dense and MoE models in FP8 and FP4 at the engine's full batch (`--trtllm`; not in
    the shipped fit, see calibration/README.md)."""
    import trtllm_check

    return trtllm_check.bench_rows(trtllm_check.load_rows(tables=("~v1.0",)))


def split(rows, seed=SEED, fraction=HELDOUT_FRACTION):
    """(fitted rows, held-out rows): a random `fraction` held out, fixed seed."""
    rng = np.random.default_rng(seed)
    held = set(rng.choice(len(rows), size=int(round(fraction * len(rows))), replace=False)
               .tolist())
    return ([r for k, r in enumerate(rows) if k not in held],
            [r for k, r in enumerate(rows) if k in held])


def write_heldout(held, held_trtllm=()):
    """`calibration/heldout.json`: the held-out InferenceMAX lines and, when the fit takes
    TensorRT-LLM's Offline rows, theirs."""
    data = {"seed": SEED, "fraction": HELDOUT_FRACTION,
            "file": "calibration/data/benchmarks_inferencemax.csv",
            "lines": sorted(r.line for r in held)}
    if held_trtllm:
        data.update(trtllm_file="calibration/data/benchmarks_trtllm.csv",
                    trtllm_lines=sorted(r.line for r in held_trtllm))
    (HERE / "heldout.json").write_text(json.dumps(data, indent=1) + "\n")


def result_text(result) -> str:
    """"successful", else the result code's message (`perfmodel.solvers.message`)."""
    return "successful" if succeeded(result) else message(result)


def shipped_fit(problem: cal.Calibration, fitted, held, gemm, nccl, out=OUTPUT,
                max_steps: int = MAX_STEPS, pooling: float | None = POOLING,
                hops: int = HOPS, seed: int = HOP_SEED) -> dict:
    """Fit `fitted` rows (plus GEMM/NCCL) and write the versioned JSON; returns it.

    Raises:
        RuntimeError: the fit did not succeed (nothing is written).
    """
    start = time.time()
    result, families, frameworks = problem.fit(fitted, max_steps=max_steps, pooling=pooling,
                                               hops=hops, seed=seed)
    fits = problem.fits(result)
    used = [r for r in fitted if fits[problem.position[r.index]]]
    meta = {
        "date": datetime.date.today().isoformat(),
        "fitted_on": [f"calibration/data/{f}" for f in FILES],
        "inferencemax_rows_fitted": len(used),
        "inferencemax_rows_not_fitting_hbm": len(fitted) - len(used),
        "gemm_points": len(gemm), "nccl_points": len(nccl),
        "heldout": f"{len(held)} InferenceMAX rows, seed {SEED}, calibration/heldout.json",
        "seed": SEED,
        "measured_chips": sorted({chip_key(r.hardware) for r in used}),
        "solver": "optimistix Levenberg-Marquardt, Huber delta 0.2 on log residuals, "
                  "Gaussian priors",
        "pooling": pooling, "hops": hops, "hop_seed": seed,
        # The move that found the shipped minimum: a run with this many hops and the same
        # seed returns it again (`hop`), which the slow refit test uses.
        "hop_best": result.hop,
        "result": result_text(result.result), "loss": float(result.loss),
        "steps": int(result.steps),
        "fit_seconds": round(time.time() - start, 1)}
    data = cal.to_json(result.params, meta, families, frameworks)
    fitted_files.write(data, out)
    return data


def fit_intervals(fitted, data: dict, gemm, nccl, out=INTERVALS_OUTPUT,
                  linearized=None) -> tuple:
    """The intervals of the fit `data` (`fitted_params.json` layout) from its `fitted`
    rows, written to `out`; returns (intervals, summary)."""
    from perfmodel.calibration import intervals as iv

    start = time.time()
    params = cal.from_json(data)
    result, summary = iv.estimate(fitted, params, gemm, nccl, data.get("pooling"),
                                  linearized=linearized)
    meta = {"date": datetime.date.today().isoformat(),
            "fit": f"fitted_params.json v{data.get('version')} of {data.get('date')}",
            "fit_loss": data.get("loss"),
            "fitted_on": "the fit rows of fitted_params.json (never calibration/heldout.json)"
                         " and the GEMM/NCCL samples",
            "method": "Gauss-Newton covariance with the priors, propagated by jax.jacfwd; "
                      "per-metric and per-framework robust scale and per-metric quantiles "
                      "of normalized (leave-one-out for the fitted metrics) log residuals",
            "residual_sigma": summary["sigma"], "seconds": round(time.time() - start, 1)}
    fitted_files.write(result.to_json(meta), out)
    return result, summary


def devices_arg(text: str) -> int | str:
    """`--devices`: a positive number of local devices, or "all"."""
    if text == "all":
        return text
    return number(1, integer=True, meaning="local devices, or 'all'")(text)


#: `--hops`: a number of basin-hopping moves, 0 or more.
hops_arg = number(0, integer=True, meaning="basin-hopping moves")


def add_hop_arguments(parser: argparse.ArgumentParser) -> None:
    """`--hops` and `--seed` (basin hopping of the joint solve), shared with validate.py."""
    parser.add_argument("--hops", type=hops_arg, default=HOPS,
                        help="basin-hopping moves after the solve from the priors "
                             f"(perfmodel.calibration.hop; default {HOPS}; 0: that solve alone)")
    parser.add_argument("--seed", type=int, default=HOP_SEED,
                        help=f"seed of the basin-hopping moves (default {HOP_SEED})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS)
    parser.add_argument("--out", default=str(OUTPUT))
    parser.add_argument("--pooling", type=float, default=POOLING)
    parser.add_argument("--trtllm", action="store_true",
                        help="also fit 80 %% of TensorRT-LLM's Offline throughput rows "
                             "(`trtllm_check.bench_rows`; the rest held out)")
    parser.add_argument("--no-intervals", action="store_true",
                        help="do not write fitted_intervals.json")
    parser.add_argument("--devices", type=devices_arg, default=None,
                        help="split the InferenceMAX rows over this many local devices, or "
                             "'all' (default: one device)")
    add_hop_arguments(parser)
    args = parser.parse_args(argv)
    rows, gemm, nccl = load_all()
    fitted, held = split(rows)
    trt = load_trtllm() if args.trtllm else []
    fitted_trt, held_trt = split(trt)
    write_heldout(held, held_trt)
    fitted = fitted + fitted_trt
    start = time.time()
    problem = cal.Calibration(rows + trt, gemm, nccl, devices=args.devices)
    data = shipped_fit(problem, fitted, held, gemm, nccl, args.out, args.max_steps,
                       args.pooling, args.hops, args.seed)
    place = problem.end_to_end.placement
    devices = 1 if place is None else place.count
    print(f"{data['result']} after {data['steps']} steps, loss {data['loss']:.6g}, "
          f"{problem.batches} batches of rows, {devices} device(s), "
          f"{time.time() - start:.0f} s -> {args.out}")
    if not args.no_intervals and args.out == str(OUTPUT):
        fit_intervals(fitted, data, gemm, nccl)
        print(f"intervals -> {INTERVALS_OUTPUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
