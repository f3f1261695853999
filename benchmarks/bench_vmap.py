"""Evaluate 100,000 serving configurations in one vmapped, jitted `predict` call on the CPU.

Each configuration draws its own concurrency, input and output lengths, HBM bandwidth, peak
compute and scale-up bandwidth around a GB200 running DeepSeek-R1 (tp8-ep8 with DP
attention, FP4 experts). The layout is static, so one compilation serves every draw.

    python benchmarks/bench_vmap.py [--n 100000] [--repeats 5] [--dtype float32] [--grads]

Prints the first call's time (compilation, or loading the kernel from perfmodel's persistent
compilation cache; `PERFMODEL_CACHE_DIR=off` always compiles) and the median wall time of
the evaluation after compilation (and, with `--grads`, of the per-configuration gradients);
`--json` prints one JSON object instead.
`benchmarks/run.py` runs it for float64 and, in a fresh process, float32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

# The precision is chosen before any array exists: float32 needs a fresh process
# (PERFMODEL_BENCH_DTYPE=float32, what --dtype float32 re-executes with).
jax.config.update("jax_enable_x64", os.environ.get("PERFMODEL_BENCH_DTYPE", "float64") == "float64")

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import perfmodel as pm  # noqa: E402
from perfmodel.cli import compilation_cache_dir  # noqa: E402

# The command line's persistent compilation cache: a second run loads the kernels (the
# gradient kernel takes about 20 s to compile on 2 cores). PERFMODEL_CACHE_DIR=off compiles.
if (_cache := compilation_cache_dir()) is not None and not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

#: What every configuration shares (bench_vmap and the peers of run.py use the same).
MODEL, CHIP, LAYOUT, FORMAT = "deepseek-r1", "gb200", dict(tp=8, ep=8, dp_attention=True), "fp4"


def configurations(n: int, seed: int = 0) -> dict:
    """n random configurations (log-uniform where a quantity spans decades)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)

    def log_uniform(key, low, high):
        return jnp.exp(jax.random.uniform(key, (n,), minval=jnp.log(low), maxval=jnp.log(high)))

    return dict(concurrency=log_uniform(keys[0], 1.0, 4096.0),
                input_len=jnp.round(log_uniform(keys[1], 128.0, 32768.0)),
                output_len=jnp.round(log_uniform(keys[2], 64.0, 8192.0)),
                bandwidth_scale=log_uniform(keys[3], 0.5, 2.0),
                compute_scale=log_uniform(keys[4], 0.5, 2.0),
                link_scale=log_uniform(keys[5], 0.5, 2.0))


def metrics_fn(model_name: str = MODEL, chip_name: str = CHIP, layout: dict | None = None,
               fmt: str = FORMAT):
    """`one(cfg, chip, design)` -> four serving metrics of one configuration, and its specs."""
    model, chip = pm.get_model(model_name), pm.get_chip(chip_name)
    design = pm.Design(concurrency=1.0, layout=pm.Layout(**(layout or LAYOUT)),
                       precision=pm.precision(chip, model, fmt))

    def one(cfg, chip, design):
        chip = eqx.tree_at(lambda c: (c.hbm_bandwidth, c.peak_flops, c.scale_up.bandwidth), chip,
                           (chip.hbm_bandwidth * cfg["bandwidth_scale"],
                            chip.peak_flops * cfg["compute_scale"],
                            chip.scale_up.bandwidth * cfg["link_scale"]))
        workload = pm.Workload(cfg["input_len"], cfg["output_len"])
        d = eqx.tree_at(lambda x: x.concurrency, design, cfg["concurrency"])
        m = pm.predict(model, chip, workload, d, hard=True, check=False)
        return m.throughput_per_chip, m.interactivity, m.ttft, m.tok_s_per_kw_tdp

    return one, chip, design


def build(model_name: str = MODEL, chip_name: str = CHIP, devices: int = 1,
          specs_as_args: bool = False):
    """(`batched(cfg)`, `one`, chip, design): the jitted, vmapped `one` over a dict of
    configurations.

    The chip and design are constants of the kernel (closed over), as in a user's function
    over fixed specs: XLA folds the formulas that do not depend on a configuration (the
    configurations still scale the chip's bandwidth, compute and links, so those stay
    inputs). `specs_as_args` passes them as arguments instead (`eqx.filter_jit` of the
    vmap called with the chip and design: one kernel for every chip of the same structure,
    about 1.2-1.3x slower per configuration; `perfmodel sweep`'s kernel, `grid.evaluate`,
    also takes its specs as arguments). Over several local devices the configurations are
    split along the grid axis of `perfmodel.grid.shard` (the mesh `perfmodel sweep` runs
    on)."""
    one, chip, design = metrics_fn(model_name, chip_name)
    vmapped = eqx.filter_vmap(one, in_axes=(0, None, None))
    if devices == 1 and specs_as_args:
        jitted = eqx.filter_jit(vmapped)
        return (lambda cfg: jitted(cfg, chip, design)), one, chip, design
    if devices == 1:
        return jax.jit(lambda cfg: vmapped(cfg, chip, design)), one, chip, design
    from perfmodel.grid import shard

    place = shard.placement(devices)
    if specs_as_args:
        @eqx.filter_jit
        def batched(cfg, chip, design):
            return place.map(lambda c, specs: vmapped(c, *specs), cfg, (chip, design))

        return (lambda cfg: batched(cfg, chip, design)), one, chip, design
    return (jax.jit(lambda cfg: place.map(lambda c, _: vmapped(c, chip, design), cfg, ())),
            one, chip, design)


def build_grads(model_name: str = MODEL, chip_name: str = CHIP):
    """Per configuration, the gradient of tokens/s per kW (TDP) with respect to every input
    of the configuration (concurrency, lengths, the three spec scales): one reverse pass each,
    vmapped. Smooth maxima (`hard=False`), as optimizers and fits differentiate them."""
    model, chip = pm.get_model(model_name), pm.get_chip(chip_name)
    design = pm.Design(concurrency=1.0, layout=pm.Layout(**LAYOUT),
                       precision=pm.precision(chip, model, FORMAT))

    def efficiency(cfg, chip, design):
        chip = eqx.tree_at(lambda c: (c.hbm_bandwidth, c.peak_flops, c.scale_up.bandwidth), chip,
                           (chip.hbm_bandwidth * cfg["bandwidth_scale"],
                            chip.peak_flops * cfg["compute_scale"],
                            chip.scale_up.bandwidth * cfg["link_scale"]))
        d = eqx.tree_at(lambda x: x.concurrency, design, cfg["concurrency"])
        m = pm.predict(model, chip, pm.Workload(cfg["input_len"], cfg["output_len"]), d,
                       check=False)
        return m.tok_s_per_kw_tdp

    grads = eqx.filter_jit(eqx.filter_vmap(jax.grad(efficiency), in_axes=(0, None, None)))
    return grads, chip, design


def timed(fn, *args, repeats: int = 5, warmup: int = 10):
    """(first call with compilation, median of `repeats` calls after `warmup` untimed ones,
    last output) in s. The untimed calls keep the first calls after compilation, which can
    run slower, out of the median: it is of the steady state a long sweep runs in."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return compile_s, statistics.median(times), out


def spot_check(one, cfg, out, chip, design, picks=(0, 1, 2)) -> float:
    """Largest relative gap between the batched results and unbatched calls."""
    gap = 0.0
    for i in picks:
        single = one({k: v[i] for k, v in cfg.items()}, chip, design)
        for batch_value, value in zip(out, single, strict=True):
            gap = max(gap, abs(float(batch_value[i]) / float(value) - 1.0))
    return gap


def measure(n: int = 100_000, repeats: int = 30, devices: int = 1, grad_n: int = 0,
            specs_as_args: bool = False) -> dict:
    """The figures of one run in this process's precision (`grad_n` 0: no gradients)."""
    batched, one, chip, design = build(devices=devices, specs_as_args=specs_as_args)
    cfg = configurations(n)
    if devices > 1:
        from perfmodel.grid import shard

        cfg = shard.placement(devices).put(cfg)
    compile_s, run_s, out = timed(batched, cfg, repeats=repeats)
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in out)
    gap = spot_check(one, cfg, out, chip, design)
    result = dict(n=n, dtype=str(out[0].dtype), platform=jax.devices()[0].platform,
                  devices=devices, specs_as_args=specs_as_args, compile_s=compile_s,
                  run_s=run_s, configs_per_s=n / run_s,
                  finite=finite, gap=gap)
    if grad_n:
        grads, chip, design = build_grads()
        gcfg = configurations(grad_n, seed=1)
        gcompile_s, grun_s, gout = timed(grads, gcfg, chip, design, repeats=repeats)
        result.update(grad_n=grad_n, grad_compile_s=gcompile_s, grad_run_s=grun_s,
                      grads_per_s=grad_n / grun_s,
                      grads_finite=all(bool(jnp.all(jnp.isfinite(g))) for g in gout.values()))
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="configurations (default 1e5)")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs (default 30)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--grads", action="store_true", help="also time per-config gradients")
    parser.add_argument("--grad-n", type=int, default=10_000, help="configurations for --grads")
    parser.add_argument("--devices", type=int, default=1,
                        help="local devices to split over (CPU: set XLA_FLAGS="
                             "--xla_force_host_platform_device_count=N)")
    parser.add_argument("--specs-as-args", action="store_true",
                        help="pass the chip and design to the kernel as arguments (default: "
                             "its constants)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.dtype != os.environ.get("PERFMODEL_BENCH_DTYPE", "float64"):
        os.environ["PERFMODEL_BENCH_DTYPE"] = args.dtype
        argv = list(argv) if argv is not None else sys.argv[1:]
        os.execv(sys.executable, [sys.executable, __file__, *argv])
    result = measure(args.n, args.repeats, devices=args.devices,
                     grad_n=args.grad_n if args.grads else 0,
                     specs_as_args=args.specs_as_args)
    compile_s, run_s, finite, gap = (result[k] for k in ("compile_s", "run_s", "finite", "gap"))
    if args.json:
        print(json.dumps(result))
        return result
    specs = "as arguments" if args.specs_as_args else "as constants"
    print(f"{args.n} configurations in one vmapped predict (chip and design {specs}) on "
          f"{args.devices} "
          f"{result['platform']} device(s) "
          f"({result['dtype']}): first call (compile + run) {compile_s:.2f} s; after "
          f"compilation median {run_s * 1e3:.1f} ms over {args.repeats} runs "
          f"({run_s / args.n * 1e6:.3f} us per configuration, {args.n / run_s:,.0f} per s); "
          f"all finite: {finite}; largest gap to unbatched calls {gap:.1e}")
    if args.grads:
        print(f"{args.grad_n} per-configuration gradients: compile {result['grad_compile_s']:.2f}"
              f" s, median {result['grad_run_s'] * 1e3:.1f} ms ({result['grads_per_s']:,.0f}"
              f" per s); all finite: {result['grads_finite']}")
    return result


if __name__ == "__main__":
    main()
