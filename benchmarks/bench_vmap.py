"""Evaluate 100,000 serving configurations in one vmapped, jitted `predict` call on the CPU.

Each configuration draws its own concurrency, input and output lengths, HBM bandwidth, peak
compute and scale-up bandwidth around a GB200 running DeepSeek-R1 (tp8-ep8 with DP
attention, FP4 experts). The layout is static, so one compilation serves every draw.

    python benchmarks/bench_vmap.py [--n 100000] [--repeats 5]

Prints the compile time and the median wall time of the evaluation after compilation.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import perfmodel as pm  # noqa: E402


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


def build(model_name: str = "deepseek-r1", chip_name: str = "gb200"):
    model, chip = pm.get_model(model_name), pm.get_chip(chip_name)
    design = pm.Design(concurrency=1.0, layout=pm.Layout(tp=8, ep=8, dp_attention=True),
                       precision=pm.precision(chip, model, "fp4"))

    def one(cfg, chip, design):
        chip = eqx.tree_at(lambda c: (c.hbm_bandwidth, c.peak_flops, c.scale_up.bandwidth), chip,
                           (chip.hbm_bandwidth * cfg["bandwidth_scale"],
                            chip.peak_flops * cfg["compute_scale"],
                            chip.scale_up.bandwidth * cfg["link_scale"]))
        workload = pm.Workload(cfg["input_len"], cfg["output_len"])
        d = eqx.tree_at(lambda x: x.concurrency, design, cfg["concurrency"])
        m = pm.predict(model, chip, workload, d, hard=True, check=False)
        return m.throughput_per_chip, m.interactivity, m.ttft, m.tok_s_per_kw_tdp

    batched = eqx.filter_jit(eqx.filter_vmap(one, in_axes=(0, None, None)))
    return batched, one, chip, design


def spot_check(one, cfg, out, chip, design, picks=(0, 1, 2)) -> float:
    """Largest relative gap between the batched results and unbatched calls."""
    gap = 0.0
    for i in picks:
        single = one({k: v[i] for k, v in cfg.items()}, chip, design)
        for batch_value, value in zip(out, single, strict=True):
            gap = max(gap, abs(float(batch_value[i]) / float(value) - 1.0))
    return gap


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="configurations (default 1e5)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    args = parser.parse_args(argv)
    batched, one, chip, design = build()
    cfg = configurations(args.n)
    start = time.perf_counter()
    jax.block_until_ready(batched(cfg, chip, design))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(batched(cfg, chip, design))
        times.append(time.perf_counter() - start)
    run_s = statistics.median(times)
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in out)
    gap = spot_check(one, cfg, out, chip, design)
    print(f"{args.n} configurations in one vmapped predict on {jax.devices()[0].platform}: "
          f"first call (compile + run) {compile_s:.2f} s; after compilation median "
          f"{run_s * 1e3:.1f} ms over {args.repeats} runs ({run_s / args.n * 1e6:.2f} us per "
          f"configuration); all finite: {finite}; largest gap to unbatched calls {gap:.1e}")
    return dict(n=args.n, compile_s=compile_s, run_s=run_s, finite=finite, gap=gap)


if __name__ == "__main__":
    main()
