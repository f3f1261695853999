"""Refit the shipped parameters: `python calibration/fit.py` (under a minute on 2 CPU cores
once the compiled group functions are cached; about 8 min the first time).

Fits per-family efficiency and collective terms and per-framework runtime overheads
(`perfmodel.calibrate`) to the GEMM and NCCL tables and to 80 % of the InferenceMAX rows;
the other 20 % (a random split with a fixed seed) are held out and listed in
`calibration/heldout.json`, never fitted. Writes `perfmodel/data/fitted_params.json`.
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
# Compiled group functions are cached on disk: a second run skips XLA compilation.
jax.config.update("jax_compilation_cache_dir", os.environ.get(
    "PERFMODEL_JAX_CACHE", str(pathlib.Path.home() / ".cache" / "perfmodel" / "jax")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from perfmodel import calibrate as cal  # noqa: E402
from perfmodel import datasets  # noqa: E402
from perfmodel import fitted as fitted_files  # noqa: E402
from perfmodel.presets import chip_key  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE / "data"
OUTPUT = HERE.parent / "perfmodel" / "data" / "fitted_params.json"
FILES = ("benchmarks_inferencemax.csv", "benchmarks_aic_gemm.csv",
         "benchmarks_nccl_collectives.csv")
SEED = 0
HELDOUT_FRACTION = 0.2
#: Partial pooling of the chip families (`perfmodel.calibrate.prior_block`): each family's
#: parameters have a Gaussian of this many prior widths around a pooled row.
POOLING = 0.5


def load_all():
    rows = datasets.load_benchmarks(DATA / FILES[0], require_measured=True)
    gemm = datasets.load_gemm(DATA / FILES[1])
    nccl = datasets.load_nccl(DATA / FILES[2])
    return rows, gemm, nccl


def split(rows, seed=SEED, fraction=HELDOUT_FRACTION):
    """(fitted rows, held-out rows): a random `fraction` held out, fixed seed."""
    rng = np.random.default_rng(seed)
    held = set(rng.choice(len(rows), size=int(round(fraction * len(rows))), replace=False)
               .tolist())
    return [r for r in rows if r.index not in held], [r for r in rows if r.index in held]


def write_heldout(held):
    (HERE / "heldout.json").write_text(json.dumps(
        {"seed": SEED, "fraction": HELDOUT_FRACTION,
         "file": "calibration/data/benchmarks_inferencemax.csv",
         "lines": sorted(r.line for r in held)}, indent=1) + "\n")


def shipped_fit(problem: cal.Calibration, fitted, held, gemm, nccl, out=OUTPUT,
                max_steps: int = 40, pooling: float | None = POOLING) -> dict:
    """Fit `fitted` rows (plus GEMM/NCCL) and write the versioned JSON; returns it."""
    start = time.time()

    def checkpoint(step, loss, params):
        meta = {"result": f"checkpoint after step {step} (fit still running)", "loss": loss}
        fitted_files.write(cal.to_json(params, meta), out)

    result, families, frameworks = problem.fit(fitted, max_steps=max_steps,
                                               callback=checkpoint, pooling=pooling)
    used = [r for r in fitted if problem.e2e.fits()[problem.e2e.position[r.index]]]
    meta = {
        "date": datetime.date.today().isoformat(),
        "fitted_on": [f"calibration/data/{f}" for f in FILES],
        "inferencemax_rows_fitted": len(used),
        "inferencemax_rows_not_fitting_hbm": len(fitted) - len(used),
        "gemm_points": len(gemm), "nccl_points": len(nccl),
        "heldout": f"{len(held)} InferenceMAX rows, seed {SEED}, calibration/heldout.json",
        "seed": SEED,
        "measured_chips": sorted({chip_key(r.hardware) for r in used}),
        "solver": "Levenberg-Marquardt, Huber delta 0.2 on log residuals, Gaussian priors",
        "pooling": pooling,
        "result": result.result, "loss": result.loss, "steps": result.steps,
        "fit_seconds": round(time.time() - start, 1)}
    data = cal.to_json(result.params, meta, families, frameworks)
    fitted_files.write(data, out)
    return data


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--out", default=str(OUTPUT))
    parser.add_argument("--pooling", type=float, default=POOLING)
    args = parser.parse_args(argv)
    rows, gemm, nccl = load_all()
    fitted, held = split(rows)
    write_heldout(held)
    start = time.time()
    problem = cal.Calibration(rows, gemm, nccl)
    print(f"compiled {len(problem.e2e.functions)} groups in {time.time() - start:.0f} s")
    data = shipped_fit(problem, fitted, held, gemm, nccl, args.out, args.max_steps,
                       args.pooling)
    print(f"{data['result']} after {data['steps']} steps, loss {data['loss']:.4g}, "
          f"{time.time() - start:.0f} s -> {args.out}")
    return 0 if data["result"] == cal.SUCCESSFUL else 1


if __name__ == "__main__":
    raise SystemExit(main())
