"""The two evaluation orders of a step's roofline (`predict(..., vectorize=...)`), measured.

    python benchmarks/bench_evaluation_order.py [--n 100000] [--repeats 5] [--json]

The model evaluates an engine step's operators (and a phase's engine steps) either one by
one (`vectorize=False`: a few hundred scalar operations, which XLA folds and fuses per
operator) or as one stack along an array axis (`vectorize=True`: one copy of the formulas
under `jax.vmap`). The numbers are the same; what differs is the program XLA gets. For each
order this prints

- `sweep`: 100,000 configurations of `bench_vmap.py` in one vmapped, jitted call (the shape
  of `perfmodel sweep`, `pareto` and the optimizer's enumeration): first call (compilation
  included) and configurations per second after it;
- `gradient`: one design's reverse-mode gradient of tokens/s per kW with respect to the
  concurrency, smooth model (the shape of the optimizer's gradient steps and of the fits'
  Jacobians): first call (compilation included) and time per call after it;
- `optimize` (with `--optimize`): the README's `perfmodel optimize` cold and warm on a fresh
  persistent cache with every evaluation forced into that order (a child process that
  patches the order in before running the command).

Nothing else in the repository reads these figures: they justify why both orders exist
(see README, "Speed").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vmap  # noqa: E402  (float64 before any array exists)
import equinox as eqx  # noqa: E402
import jax  # noqa: E402

import perfmodel as pm  # noqa: E402


def _timed(fn, *args, repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return first, min(times)


def measure(vectorize: bool, n: int, repeats: int) -> dict:
    model = pm.get_model(bench_vmap.MODEL)
    chip = pm.get_chip(bench_vmap.CHIP)
    design = pm.Design(concurrency=1.0, layout=pm.Layout(**bench_vmap.LAYOUT),
                       precision=pm.precision(chip, model, bench_vmap.FORMAT))

    def one(cfg, chip, design):
        chip = eqx.tree_at(lambda c: (c.hbm_bandwidth, c.peak_flops, c.scale_up.bandwidth),
                           chip, (chip.hbm_bandwidth * cfg["bandwidth_scale"],
                                  chip.peak_flops * cfg["compute_scale"],
                                  chip.scale_up.bandwidth * cfg["link_scale"]))
        d = eqx.tree_at(lambda x: x.concurrency, design, cfg["concurrency"])
        m = pm.predict(model, chip, pm.Workload(cfg["input_len"], cfg["output_len"]), d,
                       hard=True, check=False, vectorize=vectorize)
        return m.throughput_per_chip, m.interactivity, m.ttft, m.tok_s_per_kw_tdp

    sweep = eqx.filter_jit(eqx.filter_vmap(one, in_axes=(0, None, None)))
    first, run = _timed(sweep, bench_vmap.configurations(n), chip, design, repeats=repeats)

    def efficiency(concurrency, chip, design):
        d = eqx.tree_at(lambda x: x.concurrency, design, concurrency)
        return pm.predict(model, chip, pm.Workload(8192.0, 1024.0), d, check=False,
                          vectorize=vectorize).tok_s_per_kw_tdp

    grad = eqx.filter_jit(jax.grad(efficiency))
    grad_first, grad_run = _timed(grad, jax.numpy.asarray(64.0), chip, design,
                                  repeats=10 * repeats)
    return dict(vectorize=vectorize,
                sweep=dict(n=n, first_s=first, run_s=run, configs_per_s=n / run),
                gradient=dict(first_s=grad_first, run_us=grad_run * 1e6))


_PATCH = """
import sys, runpy
from perfmodel import roofline, serving
from perfmodel.search import evaluate
order = sys.argv.pop(1) == "stacked"
step_cost = roofline.step_cost
serving.step_cost = lambda *a, vectorize=False, **k: step_cost(*a, vectorize=order, **k)
capped = serving._capped_steps
serving._capped_steps = lambda *a: capped(*a[:-1], order)
materialize = evaluate.materialize
evaluate.materialize = lambda *a, vectorize=True: materialize(*a[:4], order)
sys.argv[0] = "perfmodel"
from perfmodel.cli import main
sys.exit(main())
"""


def optimize(order: str) -> dict:
    """`perfmodel optimize` (the README example) cold and warm on a fresh cache, every
    evaluation in `order` ("stacked" or "unrolled")."""
    import tempfile
    walls = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PERFMODEL_CACHE_DIR": cache}
        for _ in range(2):
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", _PATCH, order, "optimize", "--quiet"],
                                  capture_output=True, text=True, env=env, timeout=900)
            walls.append(time.perf_counter() - start)
            if done.returncode not in (0, 1):
                return dict(error=done.stderr.strip()[-300:])
    return dict(cold_s=walls[0], warm_s=walls[1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--optimize", action="store_true",
                        help="also time perfmodel optimize cold and warm in each order")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = {"unrolled": measure(False, args.n, args.repeats),
           "stacked": measure(True, args.n, args.repeats)}
    if args.optimize:
        for order in ("unrolled", "stacked"):
            out[order]["optimize"] = optimize(order)
    out["statistics"] = dict(
        sweep_speedup_unrolled=out["unrolled"]["sweep"]["configs_per_s"]
        / out["stacked"]["sweep"]["configs_per_s"],
        gradient_compile_ratio_unrolled=out["unrolled"]["gradient"]["first_s"]
        / out["stacked"]["gradient"]["first_s"])
    if args.json:
        print(json.dumps(out, indent=1))
        return out
    for order in ("unrolled", "stacked"):
        o = out[order]
        line = (f"{order:9s} sweep: first {o['sweep']['first_s']:.2f} s, "
                f"{o['sweep']['configs_per_s'] / 1e6:.2f} M configs/s; gradient: first "
                f"{o['gradient']['first_s']:.2f} s, {o['gradient']['run_us']:.0f} us/call")
        if "optimize" in o:
            line += f"; optimize: {o['optimize']}"
        print(line)
    return out


if __name__ == "__main__":
    main()
