"""Speed of the serving simulator (`perfmodel.simulate`) on the CPU.

Three cases on H100 + Llama-3.1-8B with vLLM's fitted runtime: `--requests` Poisson
requests (1K input, 128 output tokens at 20 requests/s) through one policy, looking at all
requests each step and through a window of 512, and `--policies` policies (max_num_seqs 8
to 256) x 256 requests in one vmapped call.

    python benchmarks/bench_simulate.py [--requests 1000] [--policies 16]

Prints compile time, wall time after compilation, engine steps and requests per second.
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

import perfmodel as pm  # noqa: E402
from perfmodel import simulate as sim  # noqa: E402
from perfmodel.fitted import runtime_for  # noqa: E402


def timed(fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--policies", type=int, default=16)
    args = parser.parse_args()
    chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    design = pm.Design(concurrency=1.0, layout=pm.Layout(tp=1),
                       precision=pm.precision(chip, model), runtime=runtime_for("vllm"))
    requests = sim.poisson(jax.random.PRNGKey(0), 20.0, args.requests, 1024, 128)

    for window in (None, 512):
        def one(window=window):
            return sim.simulate_jit(model, chip, design, sim.Policy(), requests,
                                    max_steps=1_000_000, window=window)

        result, first = timed(one)
        result, wall = timed(one)
        steps = int(result.steps)
        print(f"{args.requests} requests, one policy, window {window}: compile+run "
              f"{first:.2f} s, run {wall:.2f} s, {steps} steps ({1e6 * wall / steps:.0f} "
              f"us/step), {args.requests / wall:,.0f} requests/s"
              + (" (window overflowed)" if bool(result.window_overflow) else ""))

    small = sim.poisson(jax.random.PRNGKey(1), 20.0, 256, 1024, 128)
    seqs = jnp.geomspace(8.0, 256.0, args.policies).round()
    policies = jax.vmap(lambda s: sim.Policy(max_num_seqs=s))(seqs)
    batched = jax.jit(jax.vmap(lambda p: sim.simulate(model, chip, design, p, small,
                                                      max_steps=1_000_000).steps))
    steps, first = timed(lambda: batched(policies))
    steps, wall = timed(lambda: batched(policies))
    print(f"{args.policies} policies x 256 requests, one vmapped call: compile+run "
          f"{first:.2f} s, run {wall:.2f} s, {int(steps.max())} steps at most, "
          f"{args.policies * 256 / wall:,.0f} requests/s")


if __name__ == "__main__":
    main()
