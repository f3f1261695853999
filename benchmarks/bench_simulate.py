"""Speed of the serving simulator (`perfmodel.simulate`) on the CPU.

H100 + Llama-3.1-8B with vLLM's fitted runtime, Poisson arrivals of 1K-input, 128-output
requests at 20 requests/s: `--requests` requests through one policy (the window chosen by
`window="auto"`), and `--policies` policies (max_num_seqs 32 to 256) x `--batch-requests`
requests in one vmapped call (a fixed window of 256; every policy checked for overflow).

    python benchmarks/bench_simulate.py [--requests 10000] [--policies 64] [--batch-requests 1000]

Prints compile time, the best of `--repeats` wall times after compilation (the machine may
be shared: the minimum is the least disturbed run), CPU time of that run, engine steps and
requests simulated per second.
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


def timed(fn, repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    compile_and_run = time.perf_counter() - start
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(fn())
        best = min(best, (time.perf_counter() - start, time.process_time() - cpu))
    return out, compile_and_run, best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--policies", type=int, default=64)
    parser.add_argument("--batch-requests", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    design = pm.Design(concurrency=1.0, layout=pm.Layout(tp=1),
                       precision=pm.precision(chip, model), runtime=runtime_for("vllm"))
    requests = sim.poisson(jax.random.PRNGKey(0), 20.0, args.requests, 1024, 128)

    def one():
        return sim.simulate_jit(model, chip, design, sim.Policy(), requests,
                                max_steps=1_000_000)

    result, first, (wall, cpu) = timed(one, args.repeats)
    steps = int(result.steps)
    print(f"{args.requests} requests, one policy, window auto: compile+run {first:.2f} s, "
          f"run {wall:.2f} s (CPU {cpu:.2f} s), {steps} steps "
          f"({1e6 * wall / steps:.0f} us/step), {args.requests / wall:,.0f} requests/s")

    m = args.batch_requests
    small = sim.poisson(jax.random.PRNGKey(1), 20.0, m, 1024, 128)
    seqs = jnp.geomspace(32.0, 256.0, args.policies).round()
    policies = jax.vmap(lambda s: sim.Policy(max_num_seqs=s))(seqs)
    batched = jax.jit(jax.vmap(lambda p: sim.simulate(
        model, chip, design, p, small, max_steps=1_000_000, window=min(256, m))))
    out, first, (wall, cpu) = timed(lambda: batched(policies), args.repeats)
    overflow = int(jnp.sum(out.window_overflow))
    unfinished = int(jnp.sum(out.valid & ~out.finished))
    print(f"{args.policies} policies x {m} requests, one vmapped call: compile+run "
          f"{first:.2f} s, run {wall:.2f} s (CPU {cpu:.2f} s), {int(out.steps.max())} steps "
          f"at most, {args.policies * m / wall:,.0f} requests/s; windows overflowed: "
          f"{overflow}, unfinished: {unfinished}")


if __name__ == "__main__":
    main()
