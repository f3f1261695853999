"""`perfmodel simulate`: serve requests under arrivals, step by step (`perfmodel.simulate`)."""

from __future__ import annotations

import argparse
import math
import time

from . import (
    add_format_arg,
    add_long_context_arg,
    add_model_chip_args,
    model_and_chip,
    number,
    positive_int,
    provenance,
    render,
    token_count,
)

#: Most requests one command simulates (the loop's arrays have that size).
MAX_REQUESTS = 100_000
#: Default and largest engine steps simulated.
DEFAULT_STEPS, MAX_STEPS = 200_000, 10_000_000

COLUMNS = (("metric", "metric", "s"), ("mean", "mean", "sig"), ("p50", "p50", "sig"),
           ("p90", "p90", "sig"), ("p95", "p95", "sig"), ("p99", "p99", "sig"))
LATENCIES = (("ttft_s", "ttft"), ("tpot_s", "tpot"), ("e2e_s", "e2e"),
             ("queue_s", "queue_delay"))


#: argparse types: a positive finite number (rates, spreads, limits), a finite number >= 0
#: (waits, conservativeness) and a random seed.
_positive = number(0.0, low_open=True)
_non_negative = number(0.0)
_seed = number(0, 2**31, high_open=True, integer=True)


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="serve requests under arrivals, engine step by engine step",
        description="Simulate one engine instance (vLLM v1 scheduling, or SGLang's or "
                    "TensorRT-LLM's with --engine: token budget, "
                    "running requests first, FCFS admission while KV blocks fit, preemption "
                    "by recompute) serving Poisson, gamma or traced arrivals; each step costed "
                    "by the core step-time model. Prints TTFT, TPOT, E2E and queueing delay "
                    "(mean and percentiles, seconds, from arrival in the engine's queue).")
    add_model_chip_args(parser, "llama-3.1-8b", None,
                        "h100, or the device --engine-config names")
    parser.add_argument("--tp", type=lambda t: positive_int(t, 1024), default=1,
                        help="tensor-parallel chips of the instance (default 1)")
    parser.add_argument("--replicas", type=lambda t: positive_int(t, 4096), default=1,
                        help="data-parallel engine instances behind a round-robin router "
                             "(default 1)")
    parser.add_argument("--engine", choices=("vllm", "sglang", "trtllm"), default="vllm",
                        help="scheduler, its defaults and the fitted runtime terms "
                             "(default vllm; see perfmodel.simulate.Policy.sglang/.trtllm)")
    parser.add_argument("--mixed-chunk", action="store_true",
                        help="sglang: prefill chunks share steps with decodes "
                             "(enable_mixed_chunk)")
    parser.add_argument("--schedule-conservativeness", type=_non_negative, default=None,
                        help="sglang: scales the output share admission reserves "
                             "(default 1)")
    parser.add_argument("--recv-interval", type=lambda t: positive_int(t, 10_000),
                        default=None,
                        help="sglang: decode steps between the scheduler's looks for new "
                             "requests (--scheduler-recv-interval; default 1)")
    parser.add_argument("--capacity-policy", default=None,
                        choices=("GUARANTEED_NO_EVICT", "MAX_UTILIZATION"),
                        help="trtllm: capacity scheduler policy (default "
                             "GUARANTEED_NO_EVICT)")
    parser.add_argument("--chunked-prefill", action="store_true",
                        help="trtllm: split prompts over steps (enable_chunked_prefill)")
    parser.add_argument("--batch-wait-ms", type=_non_negative, default=None,
                        help="hold admission until the oldest waiting request waited this "
                             "long (ms) or the step carries --batch-wait-ratio of the "
                             "budget (TensorRT-LLM batch_wait_timeout_ms; default 0: none)")
    parser.add_argument("--batch-wait-ratio", type=_non_negative, default=None,
                        help="share of the token budget that ends a batch wait (default 1; "
                             "TensorRT-LLM batch_wait_max_tokens_ratio)")
    parser.add_argument("--engine-config", metavar="META.json", default=None,
                        help="a vLLM run's meta.json: model, layout, engine limits and KV "
                             "blocks from it (the options below override its limits)")
    parser.add_argument("--max-num-seqs", type=lambda t: positive_int(t, 1_000_000),
                        default=None, help="running requests at most (default 256)")
    parser.add_argument("--max-batched-tokens", type=lambda t: positive_int(t, 100_000_000),
                        default=None, help="token budget per step (default 2048)")
    parser.add_argument("--long-prefill-threshold", type=lambda t: positive_int(t, 100_000_000),
                        default=None, help="prompt tokens per request per step at most "
                                           "(default: no cap)")
    parser.add_argument("--kv-blocks", type=lambda t: positive_int(t, 1_000_000_000),
                        default=None, help="KV blocks of 16 tokens (default: what fits in "
                                           "memory)")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="arrivals and lengths from a trace (vLLM or Mooncake JSONL, "
                             "Azure CSV) instead of --rate")
    parser.add_argument("--rate", type=_positive, default=None,
                        help="arrivals per second (with --isl, --osl, --requests)")
    parser.add_argument("--isl", type=token_count, default=1024,
                        help="input tokens per request (default 1024)")
    parser.add_argument("--osl", type=token_count, default=256,
                        help="output tokens per request (default 256)")
    add_long_context_arg(parser)
    parser.add_argument("--requests", type=lambda t: positive_int(t, MAX_REQUESTS),
                        default=None, help="requests simulated (default 256; with --trace, "
                                           "its first ones, default all)")
    parser.add_argument("--arrivals", choices=("poisson", "gamma"), default="poisson",
                        help="arrival process of --rate (default poisson)")
    parser.add_argument("--cv", type=_positive, default=1.0,
                        help="gamma arrivals: coefficient of variation of the gaps "
                             "(default 1)")
    parser.add_argument("--seed", type=_seed, default=0,
                        help="random seed of the arrivals, >= 0 (default 0)")
    parser.add_argument("--max-ttft-ms", type=_positive, default=math.inf,
                        help="TTFT SLO of goodput, ms (default: none)")
    parser.add_argument("--max-tpot-ms", type=_positive, default=math.inf,
                        help="TPOT SLO of goodput, ms (default: none)")
    parser.add_argument("--max-steps", type=lambda t: positive_int(t, MAX_STEPS),
                        default=DEFAULT_STEPS,
                        help=f"engine steps at most (default {DEFAULT_STEPS:,}); requests "
                             "not done by then are reported unfinished")
    add_format_arg(parser, ("table", "json"))
    parser.set_defaults(func=run)
    return parser


def _specs(args):
    import equinox as eqx
    import jax.numpy as jnp

    from ..design import Design, Layout, precision
    from ..fitted import runtime_for
    from ..traces import vllm_engine

    if args.engine_config is not None:
        if args.engine != "vllm":
            raise ValueError("--engine-config reads a vLLM run's meta.json: use it with "
                             "--engine vllm")
        model, chip, design, policy = vllm_engine(args.engine_config, args.chip)
        if args.replicas != 1:
            raise ValueError("--replicas: the engine config gives data_parallel_size")
    else:
        model, chip = model_and_chip(args, "h100")
        # The checkpoint's own formats, as vLLM serves it without quantization flags.
        design = Design(concurrency=1.0, layout=Layout(tp=args.tp, replicas=args.replicas),
                        precision=precision(chip, model),
                        runtime=runtime_for(_FRAMEWORKS[args.engine], chip.family))
        policy = _engine_policy(args, chip)
    for option, field in (("max_num_seqs", "max_num_seqs"),
                          ("max_batched_tokens", "max_num_batched_tokens"),
                          ("long_prefill_threshold", "long_prefill_token_threshold"),
                          ("kv_blocks", "kv_blocks"), ("batch_wait_ratio", "batch_wait_tokens")):
        value = getattr(args, option)
        if value is not None:
            policy = eqx.tree_at(lambda p, f=field: getattr(p, f), policy,
                                 jnp.asarray(float(value)))
    if args.batch_wait_ms is not None:
        policy = eqx.tree_at(lambda p: p.batch_wait, policy,
                             jnp.asarray(args.batch_wait_ms / 1e3))
    return model, chip, design, policy


#: The fitted runtime terms of each engine (`perfmodel.fitted`).
_FRAMEWORKS = {"vllm": "vllm", "sglang": "sglang", "trtllm": "trt"}


def _engine_policy(args, chip):
    from ..simulate import engine_defaults

    given = {"sglang": (("mixed_chunk", "enable_mixed_chunk"),
                        ("schedule_conservativeness", "schedule_conservativeness"),
                        ("recv_interval", "scheduler_recv_interval")),
             "trtllm": (("capacity_policy", "capacity_scheduler_policy"),
                        ("chunked_prefill", "enable_chunked_prefill"))}
    settings = {}
    for engine, options in given.items():
        for option, name in options:
            value = getattr(args, option)
            if value not in (None, False):
                if args.engine != engine:
                    raise ValueError(f"--{option.replace('_', '-')} is a setting of "
                                     f"--engine {engine}")
                settings[name] = value
    return engine_defaults(args.engine, chip, **settings)


def _requests(args):
    import jax

    from .. import simulate as sim
    from ..traces import load_trace

    if args.trace is not None:
        if args.rate is not None:
            raise ValueError("give --trace or --rate, not both")
        return load_trace(args.trace, limit=args.requests)
    if args.rate is None:
        raise ValueError("give --rate (arrivals per second) or --trace FILE")
    if args.osl < 1:
        raise ValueError(f"--osl must be a positive number of tokens, got {args.osl}")
    if args.isl < 1:
        raise ValueError(f"--isl must be a positive number of tokens, got {args.isl}")
    key = jax.random.PRNGKey(args.seed)
    cv = args.cv if args.arrivals == "gamma" else 1.0
    return sim.gamma(key, args.rate, cv, args.requests or 256, args.isl, args.osl)


def _check_requests(args, model, chip, design, policy, requests) -> None:
    """Refuse, before simulating, requests longer than the model's context (unless
    --allow-long-context) and a deployment whose KV blocks cannot hold the longest one."""
    import numpy as np

    from .. import simulate as sim

    valid = np.asarray(requests.valid)
    lengths = (np.asarray(requests.input_len) + np.asarray(requests.output_len))[valid]
    longest = int(lengths.max())
    limit = model.max_context
    if limit and longest > limit and not args.allow_long_context:
        raise ValueError(f"the longest request, {longest:,} tokens, is longer than "
                         f"{model.name}'s maximum context of {limit:,} "
                         "(max_position_embeddings); pass --allow-long-context to model it "
                         "anyway")
    prompt = int(np.asarray(requests.input_len)[valid].max())
    if not policy.chunked_prefill and prompt > float(policy.max_num_batched_tokens):
        raise ValueError(f"the longest prompt, {prompt:,} tokens, is longer than the "
                         f"{float(policy.max_num_batched_tokens):,.0f}-token step budget and "
                         "prompts are not chunked: raise --max-batched-tokens or pass "
                         "--chunked-prefill")
    blocks = float(policy.kv_blocks)
    if not math.isfinite(blocks):
        blocks = float(sim.engine_kv_blocks(model, chip, design, policy.block_size))
    size = float(policy.block_size)
    usable = blocks - 1.0   # vLLM's null block
    need = math.ceil(float(np.asarray(requests.input_len)[valid].max()) / size)
    if usable < need:
        held = max(usable, 0.0) * size
        raise ValueError(f"does not fit: {model.name} on {int(design.chips)} x {chip.name} "
                         f"leaves {max(usable, 0):,.0f} KV blocks ({held:,.0f} tokens) next to "
                         f"the weights, and the longest prompt needs {need:,}; use more chips "
                         "(--tp), a narrower format or shorter requests")


def run(args) -> int:
    from .. import simulate as sim

    model, chip, design, policy = _specs(args)
    requests = _requests(args)
    _check_requests(args, model, chip, design, policy, requests)
    start = time.perf_counter()
    result = sim.simulate_jit(model, chip, design, policy, requests, max_steps=args.max_steps)
    summary = sim.summarize(result, args.max_ttft_ms / 1e3, args.max_tpot_ms / 1e3)
    wall = time.perf_counter() - start
    stats = {key: getattr(summary, name) for key, name in LATENCIES}
    out = {q: {key: float(getattr(s, q)) for key, s in stats.items()}
           for q in ("mean", "p50", "p90", "p95", "p99")}
    out.update(requests=int(summary.requests), unfinished=int(summary.unfinished),
               preemptions=int(summary.preemptions),
               throughput_rps=float(summary.throughput),
               goodput_per_chip=float(summary.goodput_per_chip),
               utilization=float(summary.utilization), power_w=float(summary.power),
               steps=int(result.steps), wall_s=wall)
    inputs = provenance(command="simulate", model=model.name, chip=chip.name,
                        chips=int(design.chips), engine=str(design.runtime.framework),
                        max_num_seqs=float(policy.max_num_seqs),
                        max_num_batched_tokens=float(policy.max_num_batched_tokens),
                        scheduler=policy.engine,
                        arrivals=args.trace or f"{args.arrivals} {args.rate}/s")
    if int(summary.finished) == 0:
        raise ValueError(f"no request finished in {args.max_steps:,} steps; raise --max-steps")
    if args.format == "json":
        import json

        print(json.dumps({"inputs": inputs, **out}, indent=1, allow_nan=False))
        return 0
    rows = [{"metric": key, **{q: out[q][key] for q in ("mean", "p50", "p90", "p95", "p99")}}
            for key, _ in LATENCIES]
    print(f"# {model.name} on {int(design.chips)} x {chip.name}, {inputs['engine']}, "
          f"{out['requests']} requests ({inputs['arrivals']}): {out['unfinished']} "
          f"unfinished, {out['preemptions']} preemptions, utilization "
          f"{out['utilization']:.2f}, {out['power_w']:.0f} W/chip, goodput/chip "
          f"{out['goodput_per_chip']:.3g} req/s, {out['steps']} steps in {wall:.1f} s")
    print(render(rows, "table", COLUMNS))
    return 0
