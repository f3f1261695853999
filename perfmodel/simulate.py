"""Serving under arrivals: an iteration-level simulator of continuous batching.

The engine runs one step after another. Each step it schedules as vLLM v1's scheduler does
(`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`), then costs the step with the
core step-time model (`roofline.step_cost` under the power cap, as `serving` does) for
the mix it actually carries:

1. Running requests, oldest admission first, take tokens from the step's budget
   (`max_num_batched_tokens`): a decode one token, a prefill what is left of its prompt,
   capped per request by `long_prefill_token_threshold`, until the budget is spent.
2. Their KV cache grows to the blocks (`block_size` tokens each) those tokens need. When
   the engine's `kv_blocks` run out, the newest running requests are preempted by
   recompute (their KV freed, their progress dropped; they return to the front of the
   queue) and nothing new is admitted that step. The survivors are the longest prefix,
   in admission order, whose blocks fit: the end state of vLLM's preempt-from-the-tail loop.
3. Otherwise waiting requests are admitted first come first served (preempted ones first)
   while the budget lasts, up to `max_num_seqs` running, stopping at the first whose
   blocks (its whole prompt's with `reserve_full_prompt`, vLLM's
   `scheduler_reserve_full_isl`) do not fit. The last one admitted may take a partial chunk.
4. The step costs `step_cost(decode sequences, their mean context, prefill tokens, the mean
   context those tokens attend to, prefill sequences)`, which includes the runtime's
   host `step_overhead` and per-sequence overhead; a request whose prompt (or recomputed
   prompt and output) completes emits a token at the end of the step, a decode one token.
   With nothing to run, the clock jumps to the next arrival.

The same scheduler runs SGLang's and TensorRT-LLM's policies (`Policy.sglang`,
`Policy.trtllm`, `engine_defaults`), as options rather than copies:

- Admission may hold KV for what a request will still need (`output_reserve`): all of it
  for TensorRT-LLM's GUARANTEED_NO_EVICT (admitted only if its prompt and output fit next
  to what running requests will still need: it never preempts), the new-token ratio share
  of it for SGLang (`schedule_conservativeness` x 0.7; SGLang lets it decay between
  retractions, here it is fixed), none for vLLM.
- Without `mixed_prefill` (SGLang without `enable_mixed_chunk`) a step that can prefill
  (a running prompt's next chunk, or new requests) carries prefills only, under
  `chunked_prefill_size`; otherwise the decodes run alone (`Result.mixed_steps` counts the
  steps that carried both).
- Without `chunked_prefill` (TensorRT-LLM's default) a request is admitted only when its
  whole prompt fits in what is left of the step's `max_num_tokens`.
- A batch wait (`batch_wait`, TensorRT-LLM's `batch_wait_timeout_ms`, and
  `batch_wait_tokens`, its `batch_wait_max_tokens_ratio`) holds admission until the
  oldest waiting request has waited that long or the step would carry that share of
  the budget; it is also the admission-delay knob of policy tuning. TensorRT-LLM counts
  the wait in iterations or ms since it began; here it runs from the oldest arrival.

Approximations: the survivors of a KV shortage are found in one pass (vLLM preempts the
tail one by one while it walks the running list; the end state is the same prefix); prefix
caching keeps a preempted request's freed blocks in one first-in-first-out free queue whose
front is consumed by every new allocation (vLLM's LRU free-block queue without the holes
that cache hits leave), and prefixes shared between requests are not modelled; vLLM's
asynchronous scheduling, `watermark`, speculative lookahead slots and partial-prefill limits
are not modelled; a step's host overhead is the runtime's fitted `step_overhead` (plus
`seq_overhead` per decoding sequence), never hidden behind the GPU.

Requests arriving during a step are seen at the next one. Latencies are the engine's: from
arrival in its queue (vLLM `queued_ts`), without HTTP or tokenization. Every step is one
iteration of a `jax.lax.while_loop` over fixed-size request arrays (padded; `Requests.valid`),
so a simulation is one compiled call, `vmap`-able over policies and loads; it stops when
every request finished, when what waits can never be admitted, or after `max_steps`.

Example:
    >>> import jax, perfmodel as pm
    >>> from perfmodel import simulate as sim
    >>> chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    >>> design = pm.Design(concurrency=1, layout=pm.Layout(tp=1),
    ...                    precision=pm.precision(chip, model))
    >>> requests = sim.poisson(jax.random.PRNGKey(0), rate=2.0, num=32, input_len=512,
    ...                        output_len=64)
    >>> result = sim.simulate(model, chip, design, sim.Policy(), requests, max_steps=4000)
    >>> s = sim.summarize(result)
    >>> int(s.unfinished), 0.005 < float(s.ttft.p50) < 0.2
    (0, True)
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .architecture import Model
from .checks import NON_NEGATIVE, Range, arguments, as_number, check
from .design import Design, Disaggregated, Layout
from .hardware import Chip
from .kvcache import max_batch
from .serving import _capped_step, check_layout

# ---------------------------------------------------------------------------------------
# Specs.


class Policy(eqx.Module):
    """The scheduler's settings (vLLM v1 names; `Policy.sglang` and `Policy.trtllm` map
    those engines' settings onto them); every number an array leaf, so a stack of policies
    is one `vmap`. The defaults are vLLM's.

    Example:
        >>> Policy(max_num_seqs=0)
        Traceback (most recent call last):
        ...
        ValueError: Policy.max_num_seqs must be an integer >= 1, got 0
    """

    max_num_seqs: jnp.ndarray = eqx.field(converter=as_number, default=256.0)
    """Most requests running at once (requests)."""
    max_num_batched_tokens: jnp.ndarray = eqx.field(converter=as_number, default=2048.0)
    """Token budget of one step, decodes and prefill chunks together (tokens)."""
    long_prefill_token_threshold: jnp.ndarray = eqx.field(converter=as_number,
                                                          default=jnp.inf)
    """Most prompt tokens one request takes in one step; inf for no cap (vLLM's 0)
    (tokens)."""
    kv_blocks: jnp.ndarray = eqx.field(converter=as_number, default=jnp.inf)
    """KV-cache blocks of the engine (vLLM `num_gpu_blocks`, one of which is vLLM's null
    block, never used); inf: what fits in memory next to the weights (`engine_kv_blocks`)
    (blocks)."""
    block_size: jnp.ndarray = eqx.field(converter=as_number, default=16.0)
    """Tokens per KV block (tokens)."""
    reserve_full_prompt: bool = eqx.field(static=True, default=True)
    """Admit a request only when the blocks of its whole prompt are free (vLLM
    `scheduler_reserve_full_isl`); else only those of its first chunk."""
    prefix_caching: bool = eqx.field(static=True, default=True)
    """Freed KV blocks stay cached until reused (vLLM `enable_prefix_caching`, its v1
    default): a preempted request readmitted recomputes only what was evicted meanwhile.
    Prefixes shared between requests are not modelled."""
    output_reserve: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Share of each request's tokens still to come (prompt left and output) whose KV
    blocks admission holds for it, against its own and later admissions: 0 holds only
    what is in use (vLLM, TensorRT-LLM MAX_UTILIZATION: preempt when it runs out), 1 the
    whole prompt and output (TensorRT-LLM GUARANTEED_NO_EVICT: never preempts), SGLang
    its new-token ratio (a share of the output). The output length is the request's
    `output_len` (benchmarks set max_tokens to it) (fraction)."""
    batch_wait: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Admission delay: waiting requests are held until the oldest has waited this long
    or the step would carry `batch_wait_tokens` x `max_num_batched_tokens` tokens
    (TensorRT-LLM `batch_wait_timeout_ms`); 0: none (s)."""
    batch_wait_tokens: jnp.ndarray = eqx.field(converter=as_number, default=1.0)
    """Tokens of a step, as a share of the budget, that end a `batch_wait` early
    (TensorRT-LLM `batch_wait_max_tokens_ratio`, where 0 switches the wait off; here
    `batch_wait` 0 does) (fraction)."""
    mixed_prefill: bool = eqx.field(static=True, default=True)
    """Prefill chunks and decodes share a step (vLLM, TensorRT-LLM; SGLang with
    `enable_mixed_chunk`); else a step that can prefill prefills only, and decodes run in
    steps of their own (SGLang's default)."""
    chunked_prefill: bool = eqx.field(static=True, default=True)
    """A prompt may be split over steps; else a request is admitted only when its whole
    prompt fits in what is left of the step's budget (TensorRT-LLM without
    `enable_chunked_prefill`)."""
    engine: str = eqx.field(static=True, default="vllm")
    """Which engine these settings describe (a label for reports)."""

    def __check_init__(self):
        count = Range(low=1.0, integer=True)
        check(self, {"max_num_seqs": count, "max_num_batched_tokens": count,
                     "long_prefill_token_threshold": Range(low=1.0, infinite=True),
                     "kv_blocks": Range(low=2.0, infinite=True), "block_size": count,
                     "output_reserve": Range(low=0.0, high=1.0),
                     "batch_wait": NON_NEGATIVE, "batch_wait_tokens": NON_NEGATIVE})
        if self.engine not in ENGINES:
            raise ValueError(f"Policy.engine must be one of {', '.join(ENGINES)}, got "
                             f"{self.engine!r}")

    @staticmethod
    def vllm(**settings) -> Policy:
        """vLLM v1's scheduler with its defaults (the `Policy` defaults: `max_num_seqs`
        256, `max_num_batched_tokens` 2048 as `vllm serve` sets them on a GPU,
        `vllm/engine/arg_utils.py`; 16-token blocks; prefix caching on); `settings`
        override fields."""
        return Policy(**settings)

    @staticmethod
    def sglang(hbm_capacity=80e9, *, chunked_prefill_size=None, max_running_requests=2048,
               schedule_conservativeness=1.0, enable_mixed_chunk=False, page_size=1,
               **settings) -> Policy:
        """SGLang's scheduler (`sglang/srt/managers/scheduler.py`, `schedule_policy.py`)
        with its `ServerArgs` defaults, as fields of the same scheduler:

        - `chunked_prefill_size` (tokens per prefill step): None takes SGLang's rule on
          the GPU's memory (`ServerArgs._handle_chunked_prefill_size`: 2048 under 35 GiB,
          8192 under 160 GiB, else 16384); it is the step budget, no per-request cap.
        - `max_running_requests` (requests): SGLang derives it from the KV pool when not
          given; here 2048 unless given (KV admission binds first on most deployments).
        - `schedule_conservativeness`: scales the new-token ratio, the share of each
          request's future output whose KV admission reserves (SGLang's initial ratio 0.7,
          `SGLANG_INIT_NEW_TOKEN_RATIO`, times it, at most 1; SGLang then lets it decay
          while nothing is retracted, held fixed here); retraction when KV runs out is
          the preemption by recompute of the other engines.
        - `enable_mixed_chunk` (default False): without it a step that can prefill runs
          prefills alone; decodes run in steps of their own.
        - `page_size` (tokens per KV page, default 1).

        Args:
            hbm_capacity: one GPU's memory for the chunk-size rule (bytes).
            **settings: `Policy` fields to set.
        """
        if chunked_prefill_size is None:
            gib = float(hbm_capacity) / 2**30
            chunked_prefill_size = 2048 if gib < 35 else 8192 if gib < 160 else 16384
        ratio = min(0.7 * float(schedule_conservativeness), 1.0)
        return Policy(**{"max_num_seqs": max_running_requests,
                         "max_num_batched_tokens": chunked_prefill_size,
                         "block_size": page_size, "output_reserve": ratio,
                         "mixed_prefill": bool(enable_mixed_chunk), "engine": "sglang",
                         **settings})

    @staticmethod
    def trtllm(*, max_batch_size=2048, max_num_tokens=8192, tokens_per_block=32,
               capacity_scheduler_policy="GUARANTEED_NO_EVICT", enable_chunked_prefill=False,
               batch_wait_timeout_ms=0.0, batch_wait_max_tokens_ratio=0.0,
               **settings) -> Policy:
        """TensorRT-LLM's in-flight batching scheduler (PyTorch backend, LLM API
        `TorchLlmArgs`) with its defaults, as fields of the same scheduler:

        - `max_batch_size` 2048 requests and `max_num_tokens` 8192 tokens per step
          (`BaseLlmArgs`; older releases used other defaults).
        - `capacity_scheduler_policy`: GUARANTEED_NO_EVICT (the default, "Useful Runtime
          Options" of the performance tuning guide) admits a request only when the KV of
          its whole prompt and output fits next to what running requests will still
          need, and never pauses one; MAX_UTILIZATION packs as many as fit now and
          pauses (here preempts) when KV runs out.
        - `enable_chunked_prefill` (default False): without it a context request is
          scheduled only when its whole prompt fits in the step's budget.
        - `tokens_per_block` 32 (`KvCacheConfig`).
        - `batch_wait_timeout_ms` and `batch_wait_max_tokens_ratio` (both 0: off): hold
          context requests until the step carries that share of `max_num_tokens` or the
          wait times out (`PyExecutor._waiting_requests`; here measured from the oldest
          waiting request's arrival).

        Args:
            **settings: `Policy` fields to set.
        """
        policies = {"GUARANTEED_NO_EVICT": 1.0, "MAX_UTILIZATION": 0.0}
        if capacity_scheduler_policy not in policies:
            raise ValueError(f"capacity_scheduler_policy must be one of "
                             f"{', '.join(policies)}, got {capacity_scheduler_policy!r}")
        ratio = float(batch_wait_max_tokens_ratio)
        wait = float(batch_wait_timeout_ms) / 1e3 if ratio > 0 else 0.0
        return Policy(**{"max_num_seqs": max_batch_size,
                         "max_num_batched_tokens": max_num_tokens,
                         "block_size": tokens_per_block,
                         "output_reserve": policies[capacity_scheduler_policy],
                         "batch_wait": wait, "batch_wait_tokens": ratio,
                         "chunked_prefill": bool(enable_chunked_prefill), "engine": "trtllm",
                         **settings})


#: Engines whose schedulers `Policy` describes.
ENGINES = ("vllm", "sglang", "trtllm")


def engine_defaults(name: str, chip: Chip | None = None, **settings) -> Policy:
    """The `Policy` of engine `name` ("vllm", "sglang", "trtllm") with its defaults
    (`chip`: the GPU whose memory sets SGLang's chunk size; default an 80 GB one);
    `settings` are that constructor's arguments.

    Example:
        >>> p = engine_defaults("trtllm")
        >>> float(p.max_num_batched_tokens), float(p.output_reserve), p.chunked_prefill
        (8192.0, 1.0, False)
    """
    if name == "vllm":
        return Policy.vllm(**settings)
    if name == "sglang":
        if chip is not None:
            settings.setdefault("hbm_capacity", float(chip.hbm_capacity))
        return Policy.sglang(**settings)
    if name == "trtllm":
        return Policy.trtllm(**settings)
    raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}")


class Requests(eqx.Module):
    """Requests offered to the engine, as fixed-size arrays (shape (N,)).

    Open loop: `arrival` gives each request's time. Closed loop (`clients` > 0): request
    `i + clients` is sent `think_time` after request `i` finishes (its `arrival` is inf
    until then), so `clients` requests are in flight, as a benchmark's concurrent clients.

    Example:
        >>> Requests(arrival=[0.0, 1.0], input_len=[10, 0], output_len=[5, 5])
        Traceback (most recent call last):
        ...
        ValueError: Requests.input_len must be an integer >= 1, got 0
    """

    arrival: jnp.ndarray = eqx.field(converter=as_number)
    """Arrival time in the engine's queue (s); inf: not yet sent (closed loop)."""
    input_len: jnp.ndarray = eqx.field(converter=as_number)
    """Prompt tokens (tokens)."""
    output_len: jnp.ndarray = eqx.field(converter=as_number)
    """Output tokens, the first included (tokens)."""
    valid: jnp.ndarray = eqx.field(converter=lambda x: jnp.asarray(x, dtype=bool),
                                   default=None)
    """False for padding (default: all valid)."""
    think_time: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Closed loop: time between a request's end and its client's next request (s)."""
    cached_len: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Prompt tokens whose KV is already in the engine's prefix cache when the request
    is first admitted (a hit: an agent's previous turns, a shared system prompt), a
    scalar or shape (N,), below `input_len` (vLLM recomputes at least the last prompt
    token): they cost no prefill compute but hold KV blocks and are attended context.
    The cached prefix is assumed resident whenever the request is admitted (no eviction
    of it is modelled); an engine without `Policy.prefix_caching` ignores it (tokens)."""
    clients: int = eqx.field(static=True, default=0)
    """Closed-loop clients; 0 for an open loop."""

    def __post_init__(self):
        # Runs before the converters: `arrival` may still be a list.
        if self.valid is None:
            self.valid = np.ones(np.shape(self.arrival), dtype=bool)

    def __check_init__(self):
        if isinstance(self.arrival, jax.Array) and not isinstance(self.arrival,
                                                                  jax.core.Tracer):
            shapes = {k: jnp.shape(getattr(self, k)) for k in
                      ("arrival", "input_len", "output_len", "valid")}
            if len(set(shapes.values())) > 1 or len(shapes["arrival"]) != 1:
                raise ValueError(f"Requests fields must be 1-D arrays of one length, got "
                                 f"shapes {shapes}")
            if isinstance(self.cached_len, jax.Array) and jnp.ndim(self.cached_len) \
                    and jnp.shape(self.cached_len) != shapes["arrival"]:
                raise ValueError(f"Requests.cached_len must be a scalar or of shape "
                                 f"{shapes['arrival']}, got {jnp.shape(self.cached_len)}")
        check(self, {"arrival": Range(low=0.0, infinite=True),
                     "input_len": Range(low=1.0, integer=True),
                     "output_len": Range(low=1.0, integer=True),
                     "think_time": NON_NEGATIVE,
                     "cached_len": Range(low=0.0, integer=True)})
        if not any(isinstance(x, jax.core.Tracer) for x in (self.cached_len, self.input_len)) \
                and isinstance(self.cached_len, jax.Array) \
                and bool(jnp.any(self.cached_len >= self.input_len)):
            raise ValueError("Requests.cached_len must be below input_len (at least one "
                             "prompt token is computed)")
        if self.clients < 0:
            raise ValueError(f"Requests.clients must be >= 0, got {self.clients}")

    @property
    def size(self) -> int:
        return int(jnp.shape(self.arrival)[0])


def _lengths(value, num):
    return jnp.broadcast_to(jnp.asarray(value, dtype=float), (num,))


def poisson(key, rate, num: int, input_len, output_len) -> Requests:
    """`num` requests arriving as a Poisson process of `rate` (requests/s), the first at 0.

    Args:
        key: a `jax.random` key.
        rate: arrivals per second (1/s).
        num: number of requests (static).
        input_len, output_len: tokens, scalars or arrays of shape (num,).
    """
    return gamma(key, rate, 1.0, num, input_len, output_len)


def gamma(key, rate, cv, num: int, input_len, output_len) -> Requests:
    """`num` requests with gamma inter-arrival times of mean 1 / `rate` (s) and coefficient
    of variation `cv` (1: Poisson; above 1: bursty), the first at 0.

    Raises:
        ValueError: a non-positive `rate` or `cv`.
    """
    for name, value in (("rate", rate), ("cv", cv)):
        if not isinstance(value, jax.core.Tracer) and not float(value) > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    shape = 1.0 / jnp.square(jnp.asarray(cv, dtype=float))
    gaps = jax.random.gamma(key, shape, (num - 1,)) / (shape * rate)
    arrival = jnp.concatenate([jnp.zeros(1), jnp.cumsum(gaps)])
    return Requests(arrival=arrival, input_len=_lengths(input_len, num),
                    output_len=_lengths(output_len, num))


def closed_loop(clients: int, num: int, input_len, output_len, think_time=0.0) -> Requests:
    """`num` requests from `clients` clients that each send the next when the last ends
    (after `think_time` s); the first `clients` at time 0."""
    if not 1 <= clients <= num:
        raise ValueError(f"clients must lie in [1, num={num}], got {clients}")
    arrival = jnp.where(jnp.arange(num) < clients, 0.0, jnp.inf)
    return Requests(arrival=arrival, input_len=_lengths(input_len, num),
                    output_len=_lengths(output_len, num), think_time=think_time,
                    clients=clients)


def agent_sessions(sessions: int, calls: int, system_prompt, user_turn, tool_result,
                   output_len, tool_latency=0.0, prefix_cache: bool = True,
                   block_size=16.0) -> Requests:
    """Agent sessions: `sessions` chains of `calls` serial requests each, all sessions
    starting at 0. A session's call k + 1 is sent `tool_latency` after its call k
    finishes (a closed loop with `clients = sessions`, the requests ordered call-major:
    request k x sessions + j is session j's call k). Call 0's prompt is the system prompt
    and the user's turn; each later call's prompt is the previous call's prompt, its
    output and the tool's result, so the history grows by `output_len + tool_result` a
    call.

    With `prefix_cache`, the full blocks (`block_size` tokens) of the previous call's
    prompt and output are a prefix-cache hit (`Requests.cached_len`), and call 0 hits the
    system prompt (a warm server); without it every call recomputes its whole prompt.
    Memory pressure between turns is not modelled: a session's prefix stays cached while
    its tool runs, however full the KV cache (an upper bound on the cache's benefit when
    KV is short); the engine's `Policy.prefix_caching` must be on for the hits to count.

    Args:
        sessions, calls: static counts (>= 1).
        system_prompt, user_turn, tool_result, output_len: tokens (scalars; the user's
            turn and each tool result at least 1, so every call computes a token).
        tool_latency: time a tool call takes between two calls of a session (s).
        prefix_cache: static; whether earlier turns are cache hits.
        block_size: the engine's KV block, the granularity of a hit (tokens).

    Example:
        >>> r = agent_sessions(2, 3, system_prompt=100, user_turn=20, tool_result=30,
        ...                    output_len=10, tool_latency=0.5, block_size=1)
        >>> [int(x) for x in r.input_len], [int(x) for x in r.cached_len]
        ([120, 120, 160, 160, 200, 200], [100, 100, 130, 130, 170, 170])
    """
    for name, value in (("sessions", sessions), ("calls", calls)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for name, value, low in (("system_prompt", system_prompt, 0.0),
                             ("user_turn", user_turn, 1.0), ("tool_result", tool_result, 1.0),
                             ("output_len", output_len, 1.0), ("block_size", block_size, 1.0),
                             ("tool_latency", tool_latency, 0.0)):
        if not isinstance(value, jax.core.Tracer) and not float(value) >= low:
            raise ValueError(f"{name} must be >= {low:g}, got {value}")
    k = jnp.repeat(jnp.arange(calls, dtype=float), sessions)
    growth = jnp.asarray(output_len, dtype=float) + tool_result
    prompt = system_prompt + user_turn + k * growth
    previous = jnp.where(k > 0, prompt - tool_result, system_prompt)
    cached = jnp.floor(previous / block_size) * block_size if prefix_cache else 0.0 * k
    n = sessions * calls
    return Requests(arrival=jnp.where(jnp.arange(n) < sessions, 0.0, jnp.inf),
                    input_len=prompt, output_len=_lengths(output_len, n),
                    think_time=tool_latency, cached_len=cached, clients=sessions)


def session_times(result: Result, sessions: int):
    """Each agent session's task completion time, from its first call's arrival to its
    last call's finish (shape (..., sessions); inf where unfinished), for requests built
    call-major as `agent_sessions` builds them (s)."""
    n = result.finish.shape[-1]
    if n % sessions:
        raise ValueError(f"sessions ({sessions}) must divide the {n} requests")
    shape = result.finish.shape[:-1] + (n // sessions, sessions)
    first = result.arrival.reshape(shape)[..., 0, :]
    last = result.finish.reshape(shape)[..., -1, :]
    done = jnp.all(result.finished.reshape(shape), axis=-2)
    return jnp.where(done, last - first, jnp.inf)


def session_stats(result: Result, sessions: int) -> Stats:
    """Mean and percentiles over finished sessions of `session_times` (s)."""
    times = session_times(result, sessions)
    return _stats(times, jnp.isfinite(times))


def trace(arrival, input_len, output_len, size: int | None = None) -> Requests:
    """Requests from a trace: times (any origin, s; shifted to start at 0), lengths; padded
    to `size` requests when given (padding is not simulated)."""
    arrival = jnp.asarray(arrival, dtype=float)
    num = arrival.shape[0]
    size = num if size is None else size
    if size < num:
        raise ValueError(f"size {size} is smaller than the trace's {num} requests")
    pad = size - num
    arrival = arrival - jnp.min(arrival)

    def padded(x, fill):
        return jnp.concatenate([jnp.asarray(x, dtype=float), jnp.full(pad, fill)])

    return Requests(arrival=padded(arrival, 0.0), input_len=padded(input_len, 1.0),
                    output_len=padded(output_len, 1.0),
                    valid=jnp.arange(size) < num)


def engine_kv_blocks(model: Model, chip: Chip, design: Design, block_size=16.0):
    """KV blocks that fit per instance next to the weights and the activation reserve in
    `memory_fraction` of memory (`kvcache.max_batch` at one block's context) (blocks)."""
    rt = design.runtime
    return jnp.floor(max_batch(model, design.layout, design.precision, chip.hbm_capacity,
                               jnp.asarray(block_size, dtype=float), rt.memory_fraction,
                               rt.activation_reserve, design.mapping, chip.num_slices))


# ---------------------------------------------------------------------------------------
# Simulation.


class Result(eqx.Module):
    """Per-request outcomes (shape (..., N)) and engine totals of one simulation."""

    arrival: jnp.ndarray
    """Arrival time (s; inf if never sent)."""
    scheduled: jnp.ndarray
    """First time scheduled (s; inf if never)."""
    first_token: jnp.ndarray
    """Time of the first output token (s; inf if none)."""
    finish: jnp.ndarray
    """Time of the last output token (s; inf if unfinished)."""
    input_len: jnp.ndarray
    output_len: jnp.ndarray
    valid: jnp.ndarray
    finished: jnp.ndarray
    """True when every output token was emitted."""
    preemptions: jnp.ndarray
    """Times each request was preempted."""
    end_time: jnp.ndarray
    """Clock when the simulation stopped (s)."""
    busy_time: jnp.ndarray
    """Time spent in engine steps (s)."""
    dynamic_energy: jnp.ndarray
    """Energy above idle per chip over all steps (J)."""
    in_system_area: jnp.ndarray
    """Integral over time of requests arrived and unfinished (request s), from the steps'
    own clock: Little's law checks it against the per-request records."""
    steps: jnp.ndarray
    """Engine steps run."""
    idle_power: jnp.ndarray
    """The chip's idle power (W)."""
    chips: jnp.ndarray
    """Chips of all instances."""
    window_overflow: jnp.ndarray
    """True when a `window` may have hidden a request the engine would have admitted."""
    mixed_steps: jnp.ndarray
    """Steps that carried both prefill tokens and decodes."""

    @property
    def queue_delay(self):
        """Arrival to first scheduled (s)."""
        return self.scheduled - self.arrival

    @property
    def ttft(self):
        """Arrival to first token (s)."""
        return self.first_token - self.arrival

    @property
    def tpot(self):
        """Mean time per output token after the first (s; NaN for one-token outputs)."""
        return jnp.where(self.output_len > 1, (self.finish - self.first_token)
                         / jnp.maximum(self.output_len - 1.0, 1.0), jnp.nan)

    @property
    def e2e(self):
        """Arrival to last token (s)."""
        return self.finish - self.arrival

    @property
    def arrived(self):
        return self.valid & (self.arrival <= self.end_time)


class _State(eqx.Module):
    t: jnp.ndarray
    step: jnp.ndarray
    arrival: jnp.ndarray
    computed: jnp.ndarray
    generated: jnp.ndarray
    running: jnp.ndarray
    finished: jnp.ndarray
    admitted_at: jnp.ndarray
    queue_key: jnp.ndarray
    counter: jnp.ndarray
    scheduled: jnp.ndarray
    first_token: jnp.ndarray
    finish: jnp.ndarray
    preemptions: jnp.ndarray
    busy: jnp.ndarray
    energy: jnp.ndarray
    area: jnp.ndarray
    stuck: jnp.ndarray
    cached_at: jnp.ndarray
    cached_blocks: jnp.ndarray
    evicted: jnp.ndarray
    queue_end: jnp.ndarray
    lo: jnp.ndarray
    overflow: jnp.ndarray
    remaining: jnp.ndarray
    mixed: jnp.ndarray


#: `_State` fields with one entry per request (the window slices them).
_PER_REQUEST = ("arrival", "computed", "generated", "running", "finished", "admitted_at",
                "queue_key", "scheduled", "first_token", "finish", "preemptions", "cached_at",
                "cached_blocks")


def _in_order(mask, key):
    """Whether each row's `mask` entries are in ascending `key` order already (ties by
    index), and a function giving permutations that put them so (shape (K, W) for K rows)
    and their inverses. The entries outside `mask` may lie anywhere: every use masks them
    out.

    The scheduler runs in index order unless a preemption or a closed loop reordered the
    requests: the sort and the gathers are most of a step's time on CPU, so they run only
    when needed (under a `vmap` over policies the branches become a select and they
    always run).
    """
    masked = jnp.where(mask, key, -jnp.inf)
    previous = jnp.concatenate([jnp.full(mask.shape[:-1] + (1,), -jnp.inf),
                                jax.lax.cummax(masked, axis=mask.ndim - 1)[..., :-1]], axis=-1)
    ordered = jnp.all(~mask | (key >= previous))

    def sort():
        index = jnp.broadcast_to(jnp.arange(mask.shape[-1]), mask.shape)
        order = jnp.argsort(jnp.where(mask, key, jnp.inf), axis=-1, stable=True)
        return order, jnp.put_along_axis(jnp.zeros_like(order), order, index, axis=-1,
                                         inplace=False)

    return ordered, sort


def _validate(model, chip, design, policy, requests):
    arguments(model=(model, Model), chip=(chip, Chip), design=(design, Design),
              policy=(policy, Policy), requests=(requests, Requests))
    if isinstance(design.layout, Disaggregated):
        raise ValueError("design.layout: the simulator runs one aggregated instance; "
                         "a Disaggregated layout is not simulated yet")
    if isinstance(design.layout, Layout):
        check_layout(model, design.layout)
        replicas = design.layout.replicas
        if requests.clients and requests.clients % replicas:
            raise ValueError(f"requests.clients ({requests.clients}) must be a multiple of "
                             f"design.layout.replicas ({replicas}): each replica serves "
                             "whole clients")


#: Run-time checks of traced policy values (a vmapped stack is checked here, not when built).
_POLICY_CHECKS = (
    ("max_num_seqs", lambda x: x >= 1, "policy.max_num_seqs must be >= 1"),
    ("max_num_batched_tokens", lambda x: x >= 1, "policy.max_num_batched_tokens must be >= 1"),
    ("long_prefill_token_threshold", lambda x: x >= 1,
     "policy.long_prefill_token_threshold must be >= 1 (inf for no cap)"),
    ("kv_blocks", lambda x: x >= 2, "policy.kv_blocks must be >= 2 (inf: from memory)"),
    ("block_size", lambda x: x >= 1, "policy.block_size must be >= 1"),
    ("output_reserve", lambda x: (x >= 0) & (x <= 1), "policy.output_reserve must be in [0, 1]"),
    ("batch_wait", lambda x: x >= 0, "policy.batch_wait must be >= 0"),
    ("batch_wait_tokens", lambda x: x >= 0, "policy.batch_wait_tokens must be >= 0"),
)


def _checked(policy: Policy) -> Policy:
    for name, test, message in _POLICY_CHECKS:
        value = getattr(policy, name)
        value = eqx.error_if(value, ~test(value) | jnp.isnan(value), message)
        policy = eqx.tree_at(lambda p, n=name: getattr(p, n), policy, value)
    return policy


def simulate(model: Model, chip: Chip, design: Design, policy: Policy, requests: Requests,
             *, max_steps: int = 100_000, hard: bool = True,
             vectorize: bool = True, window: int | str | None = None) -> Result:
    """Simulate engine instances serving `requests` under `policy`: one, or
    `design.layout.replicas` behind a round-robin router (`_replicated`).

    Args:
        model: architecture (static).
        chip: accelerator spec.
        design: layout (aggregated; its replicas are data-parallel engines), precisions,
            runtime (its
            `step_overhead` and `seq_overhead` are paid every step); `design.concurrency`
            is not read (the load is `requests`).
        policy: scheduler settings.
        requests: arrivals and lengths (N requests; the loop's arrays have that size).
        max_steps: static; the most engine steps simulated (unfinished requests are
            reported as such).
        hard: static; exact max in the step-time roofline (default), else the smooth one.
        vectorize: static; evaluate each step's operators as one stack
            (`roofline.step_cost`): the same numbers in fewer, larger operations, faster on
            CPU inside the loop (XLA:CPU pays per operation).
        window: static; each step looks at this many requests from the first unfinished
            one (in index order: sort open-loop requests by arrival, as the builders do)
            instead of all N, which makes a step's time independent of N. Exact while
            the running requests and the head of the queue lie within it; when they may
            not, `Result.window_overflow` is True. None: all requests. "auto": the
            smallest of `AUTO_WINDOW` x 2^k that does not overflow (each compiled once,
            an overflowing run stopped at its first overflow), found when the policy and
            requests are concrete values; traced (under `jit` or `vmap`), all requests.

    Returns:
        `Result` (see `summarize`).

    Raises:
        ValueError: a spec of the wrong kind, a disaggregated layout, a layout that cannot
            hold the model, closed-loop clients that replicas cannot share evenly.
        equinox.EquinoxRuntimeError: a traced policy value out of range (`Policy`'s rules).

    Queue order uses float keys of size steps x requests: run with `jax_enable_x64` (as the
    package's tests and command line do) for long simulations.
    """
    kw = dict(max_steps=max_steps, hard=hard, vectorize=vectorize)
    if isinstance(window, str):
        return _auto_window(_simulate_compiled, model, chip, design, policy, requests, window,
                            **kw)
    return _simulate(model, chip, design, policy, requests, window=window, **kw)


#: First window `window="auto"` tries (requests).
AUTO_WINDOW = 256


def _auto_window(run, model, chip, design, policy, requests, window, **kw):
    if window != "auto":
        raise ValueError(f"window must be an int, None or 'auto', got {window!r}")
    _validate(model, chip, design, policy, requests)
    n = requests.size
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(
            (chip, design, policy, requests))):
        return _simulate(model, chip, design, policy, requests, window=None, **kw)
    width = min(n, AUTO_WINDOW)
    while True:
        result = run(model, chip, design, policy, requests, window=width,
                     stop_on_overflow=width < n, **kw)
        if width >= n or not bool(result.window_overflow):
            return result
        width = min(2 * width, n)


def _simulate(model, chip, design, policy, requests, *, max_steps, hard, vectorize, window,
              stop_on_overflow=False):
    _validate(model, chip, design, policy, requests)
    policy = _checked(policy)
    layout = design.layout
    args = (max_steps, hard, vectorize, window, stop_on_overflow)
    if isinstance(layout, Layout) and layout.replicas > 1:
        return _replicated(model, chip, design, policy, requests, *args)
    return _instance(model, chip, design, policy, requests, *args)


_simulate_compiled = eqx.filter_jit(_simulate)


def _replicated(model, chip, design, policy, requests, max_steps, hard, vectorize, window,
                stop_on_overflow):
    """R = `design.layout.replicas` engine instances behind a round-robin router: request i
    goes to instance i mod R (in arrival order; closed-loop clients stay on one instance),
    each instance simulated alone (one `vmap` over them), the per-request records put
    back in request order and the totals combined: the clock of the last instance to stop,
    busy time and energy per chip averaged over instances (so `summarize` gives the mean
    utilization and the average power per chip), time-in-system summed, chips counted over
    all instances.

    Round robin ignores load: vLLM's data-parallel front end sends each request to the
    engine with the fewest waiting and running requests, which evens out bursts that round
    robin leaves; with equal lengths the two agree.
    """
    import dataclasses

    r = design.layout.replicas
    one = eqx.tree_at(lambda d: d.layout, design, dataclasses.replace(design.layout,
                                                                      replicas=1))
    n = requests.size
    m = -(-n // r)
    pad = m * r - n

    def split(x, fill):
        x = jnp.concatenate([jnp.asarray(x), jnp.full((pad,), fill, dtype=jnp.asarray(x).dtype)])
        return x.reshape(m, r).T   # (r, m): instance k holds requests k, k + r, ...

    cached = jnp.broadcast_to(requests.cached_len, (n,))
    arrays = (split(requests.arrival, jnp.inf), split(requests.input_len, 1.0),
              split(requests.output_len, 1.0), split(requests.valid, False),
              split(cached, 0.0))
    clients = requests.clients // r

    def serve(arrival, input_len, output_len, valid, cached_len):
        part = Requests(arrival=arrival, input_len=input_len, output_len=output_len,
                        valid=valid, think_time=requests.think_time, cached_len=cached_len,
                        clients=clients)
        return _instance(model, chip, one, policy, part, max_steps, hard, vectorize, window,
                         stop_on_overflow)

    out = jax.vmap(serve)(*arrays)

    def merge(x):
        return x.T.reshape(-1)[:n]

    per_request = ("arrival", "scheduled", "first_token", "finish", "input_len",
                   "output_len", "valid", "finished", "preemptions")
    fields = {k: merge(getattr(out, k)) for k in per_request}
    return Result(**fields, end_time=jnp.max(out.end_time), busy_time=jnp.mean(out.busy_time),
                  dynamic_energy=jnp.mean(out.dynamic_energy),
                  in_system_area=jnp.sum(out.in_system_area), steps=jnp.max(out.steps),
                  idle_power=out.idle_power[0], chips=jnp.sum(out.chips),
                  window_overflow=jnp.any(out.window_overflow),
                  mixed_steps=jnp.sum(out.mixed_steps))


def _instance(model, chip, design, policy, requests, max_steps, hard, vectorize, window,
              stop_on_overflow):
    """`simulate` of one engine instance (the loop)."""
    n = requests.size
    bs = policy.block_size
    # vLLM's block pool keeps one null block out of use (`BlockPool.null_block`).
    kv_blocks = jnp.where(jnp.isinf(policy.kv_blocks),
                          engine_kv_blocks(model, chip, design, bs), policy.kv_blocks) - 1.0
    max_tokens = policy.max_num_batched_tokens
    cap = policy.long_prefill_token_threshold
    inputs, outputs, valid = requests.input_len, requests.output_len, requests.valid
    cached = jnp.broadcast_to(requests.cached_len, (n,))
    follower = jnp.arange(n) + requests.clients if requests.clients else None
    layout = design.layout
    zeros = jnp.zeros(n)
    inf = jnp.full(n, jnp.inf)
    init = _State(t=jnp.asarray(0.0), step=jnp.asarray(0), arrival=requests.arrival,
                  computed=zeros, generated=zeros, running=jnp.zeros(n, bool),
                  finished=~valid, admitted_at=inf, queue_key=requests.arrival,
                  counter=jnp.asarray(0.0), scheduled=inf, first_token=inf, finish=inf,
                  preemptions=zeros, busy=jnp.asarray(0.0), energy=jnp.asarray(0.0),
                  area=jnp.asarray(0.0), stuck=jnp.asarray(False), cached_at=zeros,
                  cached_blocks=zeros, evicted=jnp.asarray(0.0), queue_end=kv_blocks,
                  lo=jnp.asarray(0), overflow=jnp.asarray(False),
                  remaining=jnp.sum(valid), mixed=jnp.asarray(0))
    width = n if window is None else min(window, n)
    index = jnp.arange(n)
    index_w = jnp.arange(width)
    # Open loop, the requests past the window are untouched: their arrivals (inf for
    # padding) sorted, a search and prefix sums replace a pass over all N every step.
    arrival_valid = jnp.where(valid, requests.arrival, jnp.inf)
    arrival_sorted = jnp.all(arrival_valid[1:] >= arrival_valid[:-1])
    arrival_sums = jnp.concatenate([jnp.zeros(1), jnp.cumsum(jnp.where(
        valid, requests.arrival, 0.0))])

    def blocks(tokens):
        return jnp.ceil(tokens / bs)

    def step(s: _State, offset, inputs_w, outputs_w, cached_w, full) -> _State:
        """One engine step on the window state `s` (its requests from `offset`); `full`:
        the arrivals and finished flags of all N (closed loop), else None."""
        t = s.t
        s = eqx.tree_at(lambda st: st.queue_key, s, jnp.where(
            jnp.isinf(s.queue_key) & (s.arrival <= t), s.arrival, s.queue_key))
        target = inputs_w + s.generated            # tokens whose KV precede the next sample
        waiting = ~s.finished & ~s.running & (s.arrival <= t)
        # Prefix caching: freed blocks form a queue reused from its front (vLLM's free block
        # queue, an LRU); a preempted request's blocks, freed last block first, sit at
        # `cached_at` onwards, and the `evicted` front has eaten those before it. Its
        # surviving full blocks are a cached prefix (at least one token is recomputed).
        hit = jnp.clip(s.cached_at + s.cached_blocks - s.evicted, 0.0, s.cached_blocks) \
            if policy.prefix_caching else jnp.zeros(width)
        # A prefix already cached at arrival (`Requests.cached_len`) is a hit too.
        found = jnp.maximum(hit * bs, cached_w) if policy.prefix_caching else hit * bs
        start = jnp.where(waiting, jnp.minimum(found, target - 1.0), s.computed)
        hit = jnp.where(waiting, jnp.floor(start / bs), 0.0)
        demand = jnp.minimum(target - start, cap)
        ordered, sort = _in_order(jnp.stack([s.running, waiting]),
                                  jnp.stack([s.admitted_at, s.queue_key]))

        total = inputs_w + outputs_w
        reserve = policy.output_reserve

        def claim(tokens):
            # Blocks held for a request with `tokens` in KV: those and `reserve` of the rest.
            return blocks(tokens + reserve * jnp.maximum(total - tokens, 0.0))

        oldest = jnp.min(jnp.where(waiting, s.arrival, jnp.inf))
        waited = t - oldest >= policy.batch_wait

        def schedule(orders, demand, budget, admit):
            """Steps 1-3 with the running and waiting requests in the order `orders`
            gives (permutations and inverses; None: index order), under a token `budget`,
            admitting waiting requests when `admit` (static)."""
            def take(x, perm):
                return x if perm is None else x[perm]

            (order, worder), (back, wback) = orders if orders is not None else \
                ((None, None), (None, None))
            # 1. Running requests, oldest admission first, share the token budget.
            run_sorted = take(s.running, order)
            want = jnp.where(run_sorted, take(demand, order), 0.0)
            before = jnp.cumsum(want) - want
            alloc_sorted = jnp.clip(budget - before, 0.0, want)
            # 2. KV: the longest prefix whose blocks fit survives; the rest is preempted.
            need = jnp.where(run_sorted, blocks(take(s.computed, order) + alloc_sorted), 0.0)
            keep_sorted = run_sorted & (jnp.cumsum(need) <= kv_blocks)
            keep = take(keep_sorted, back)
            preempted = s.running & ~keep
            alloc = take(jnp.where(keep_sorted, alloc_sorted, 0.0), back)
            used = jnp.sum(jnp.where(keep, claim(s.computed + alloc), 0.0))
            # 3. Waiting requests, first come first served, while budget, seats and KV last.
            wait_sorted = take(waiting, worder)
            left = budget - jnp.sum(alloc)
            wwant = jnp.where(wait_sorted, take(demand, worder), 0.0)
            # One prefix sum of three rows (XLA:CPU pays per operation).
            if policy.reserve_full_prompt:
                wsums = jnp.cumsum(jnp.stack([wwant, wait_sorted.astype(float), jnp.where(
                    wait_sorted, claim(take(target, worder)), 0.0)]), axis=1)
                wbefore = wsums[0] - wwant
                walloc = jnp.clip(left - wbefore, 0.0, wwant)
            else:
                wsums = jnp.cumsum(jnp.stack([wwant, wait_sorted.astype(float)]), axis=1)
                wbefore = wsums[0] - wwant
                walloc = jnp.clip(left - wbefore, 0.0, wwant)
                wsums = jnp.concatenate([wsums, jnp.cumsum(jnp.where(
                    wait_sorted, claim(take(start, worder) + walloc), 0.0))[None]])
            rank = wsums[1] - 1.0
            room = wbefore < left if policy.chunked_prefill else wbefore + wwant <= left
            fits = (wait_sorted & (rank < policy.max_num_seqs - jnp.sum(keep))
                    & room & (wsums[2] <= kv_blocks - used) & ~jnp.any(preempted))
            admit_sorted = (jnp.cumprod(fits | ~wait_sorted) > 0) & wait_sorted
            # The batch wait: admit once the oldest waited `batch_wait` or the step would
            # carry enough tokens (TensorRT-LLM `PyExecutor._waiting_requests`).
            tokens = jnp.sum(alloc) + jnp.sum(jnp.where(admit_sorted, walloc, 0.0))
            gate = waited | (tokens >= policy.batch_wait_tokens * budget)
            admit_sorted = admit_sorted & gate & admit
            admitted = take(admit_sorted, wback)
            alloc = alloc + take(jnp.where(admit_sorted, walloc, 0.0), wback)
            position = index_w if back is None else back
            return (keep, preempted, alloc, used, left, walloc, admitted,
                    take(rank, wback), position.astype(float), ~gate)

        def plan(orders):
            if policy.mixed_prefill:
                return schedule(orders, demand, max_tokens, True)
            # SGLang: a step that can prefill (chunks of running prompts, new requests)
            # prefills only; else the decodes run alone, with no token budget.
            decoding = s.running & (target - s.computed == 1.0) & (s.generated > 0)
            prefill = schedule(orders, jnp.where(decoding, 0.0, demand), max_tokens, True)
            decode = schedule(orders, jnp.where(s.running & ~decoding, 0.0, demand),
                              jnp.inf, False)
            use = jnp.any(prefill[2] > 0)
            return jax.tree_util.tree_map(lambda a, b: jnp.where(use, a, b), prefill, decode)

        keep, preempted, alloc, used, left, walloc, admitted, rank, position, held = \
            jax.lax.cond(ordered, lambda: plan(None), lambda: plan(sort()))
        # 4. Cost the step's mix with the core model.
        computed = jnp.where(preempted, 0.0, jnp.where(admitted, start, s.computed))
        decode = (alloc > 0) & (target - computed == 1.0) & (s.generated > 0)
        prefill = (alloc > 0) & ~decode
        num_decode = jnp.sum(decode)
        prefill_tokens = jnp.sum(jnp.where(prefill, alloc, 0.0))
        kw = dict(
            decode_seqs=num_decode,
            decode_context=jnp.sum(jnp.where(decode, computed, 0.0))
            / jnp.maximum(num_decode, 1.0),
            prefill_tokens=prefill_tokens,
            prefill_context=jnp.sum(jnp.where(prefill, alloc * (computed + alloc / 2.0), 0.0))
            / jnp.maximum(prefill_tokens, 1.0),
            prefill_seqs=jnp.sum(prefill).astype(float))
        _, cost = _capped_step(model, chip, design, layout, kw, 24.0, hard, vectorize)
        work = jnp.any(alloc > 0)
        dt = jnp.where(work, cost.time, 0.0)
        beyond_start = offset + width
        if follower is None:
            # Past the window (sorted arrivals): [beyond_start, arrived) have arrived by t.
            arrived = jnp.maximum(jnp.searchsorted(arrival_valid, t, side="right",
                                                   method="scan_unrolled"), beyond_start)
            next_beyond = jnp.where(arrived < n, arrival_valid[jnp.minimum(arrived, n - 1)],
                                    jnp.inf)
            # Unsorted, all N are scanned (from the constant arrivals: reading the state's
            # arrays beside updating them in place would copy them every step).
            next_beyond = jax.lax.cond(arrival_sorted, lambda: next_beyond, lambda: jnp.min(
                jnp.where((index >= beyond_start) & (arrival_valid > t), arrival_valid,
                          jnp.inf)))
            next_arrival = jnp.minimum(next_beyond, jnp.min(jnp.where(
                ~s.finished & (s.arrival > t), s.arrival, jnp.inf)))
        else:
            arrival_all, finished_all = full
            pending = ~finished_all & (arrival_all > t)
            next_arrival = jnp.min(jnp.where(pending, arrival_all, jnp.inf))
        # Held by the batch wait, an idle engine wakes when the oldest has waited enough.
        next_arrival = jnp.minimum(next_arrival, jnp.where(
            held & jnp.any(waiting), oldest + policy.batch_wait, jnp.inf))
        end = jnp.where(work, t + dt, jnp.where(jnp.isinf(next_arrival), t,
                                                jnp.maximum(next_arrival, t)))
        stuck = ~work & jnp.isinf(next_arrival)
        # Outcomes at the end of the step.
        computed = computed + alloc
        running = keep | admitted
        sampled = running & (alloc > 0) & (computed >= target)
        generated = s.generated + sampled
        done = running & (generated >= outputs_w)
        present = ~s.finished & (s.arrival < end)
        area = s.area + jnp.sum(jnp.where(present, end - jnp.maximum(s.arrival, t), 0.0))
        if follower is None:
            def area_beyond():
                # [beyond_start, arrived) wait the whole step, [arrived, until) arrive in it.
                until = jnp.maximum(jnp.searchsorted(arrival_valid, end, side="left",
                                                     method="scan_unrolled"), arrived)
                return ((arrived - beyond_start) * (end - t) + (until - arrived) * end
                        - (arrival_sums[until] - arrival_sums[arrived]))

            def scan_beyond():
                late = index >= beyond_start
                return (jnp.sum(jnp.where(late & (arrival_valid < end),
                                          end - jnp.maximum(arrival_valid, t), 0.0)),
                        jnp.any(late & (arrival_valid <= t)))

            extra, waits_beyond = jax.lax.cond(
                arrival_sorted, lambda: (area_beyond(), arrived > beyond_start), scan_beyond)
            area = area + extra
        else:
            beyond = (index >= beyond_start) & ~finished_all
            area = area + jnp.sum(jnp.where(beyond & (arrival_all < end),
                                            end - jnp.maximum(arrival_all, t), 0.0))
            waits_beyond = jnp.any(beyond & (arrival_all <= t))
        # A window too narrow: requests past it wait while it admitted all it saw and had
        # budget and seats to spare (the full simulation would have looked further).
        overflow = s.overflow | (waits_beyond & ~jnp.any(waiting & ~admitted)
                                 & (left - jnp.sum(walloc) > 0) & ~jnp.any(preempted)
                                 & (jnp.sum(keep | admitted) < policy.max_num_seqs))
        num_admitted = jnp.sum(admitted)
        # The free queue: blocks taken from its front (growth and new requests, cache hits
        # excepted), blocks freed onto its back (preempted now, finished at the step's end).
        taken = jnp.sum(jnp.where(keep | admitted, blocks(computed) - jnp.where(
            admitted, hit, blocks(computed - alloc)), 0.0))
        freed = jnp.where(preempted, blocks(s.computed), 0.0)
        cached_at = jnp.where(preempted, s.queue_end + jnp.cumsum(freed) - freed, s.cached_at)
        cached_at = cached_at + jnp.where(preempted, freed - jnp.floor(s.computed / bs), 0.0)
        cached_blocks = jnp.where(preempted, jnp.floor(s.computed / bs),
                                  jnp.where(admitted, 0.0, s.cached_blocks))
        queue_end = s.queue_end + jnp.sum(freed) + jnp.sum(jnp.where(done, blocks(computed),
                                                                     0.0))
        # Preempted requests go to the front of the queue, the latest preemption first and,
        # within one step, the oldest admission first (vLLM: popped from the tail of the
        # running list and pushed to the front of the waiting queue one by one).
        front = -(s.step + 1.0) * (n + 1.0) + position
        new = _State(
            t=end, step=s.step + 1, arrival=s.arrival, computed=computed,
            generated=generated, running=running & ~done, finished=s.finished | done,
            admitted_at=jnp.where(admitted, s.counter + rank, s.admitted_at),
            queue_key=jnp.where(preempted, front, s.queue_key),
            counter=s.counter + num_admitted,
            scheduled=jnp.where(admitted & jnp.isinf(s.scheduled), t, s.scheduled),
            first_token=jnp.where(sampled & jnp.isinf(s.first_token), end, s.first_token),
            finish=jnp.where(done, end, s.finish), preemptions=s.preemptions + preempted,
            busy=s.busy + dt, energy=s.energy + jnp.where(work, cost.dynamic_energy, 0.0),
            area=area, stuck=stuck, cached_at=cached_at, cached_blocks=cached_blocks,
            evicted=s.evicted + taken, queue_end=queue_end, overflow=overflow,
            remaining=s.remaining - jnp.sum(done),
            mixed=s.mixed + ((num_decode > 0) & (prefill_tokens > 0)),
            # The first unfinished request (finished ones never return; past the window
            # none has finished, padding aside).
            lo=jnp.where(jnp.all(s.finished | done), beyond_start,
                         offset + jnp.argmin(s.finished | done)))
        return new

    def cond(s: _State):
        more = (s.step < max_steps) & (s.remaining > 0) & ~s.stuck
        return more & ~s.overflow if stop_on_overflow else more

    # Steps run on the window's arrays (an inner loop, O(width) a step); the window moves,
    # its arrays written back into the N-long records, once its first unfinished request
    # is `slack` in (or, closed loop, after every step, to send the clients' next requests).
    slack = max(1, width // 8)

    def body(g: _State) -> _State:
        offset = jnp.minimum(g.lo, n - width)

        def cut(x):
            return jax.lax.dynamic_slice_in_dim(x, offset, width)

        w = eqx.tree_at(lambda st: [getattr(st, f) for f in _PER_REQUEST], g,
                        [cut(getattr(g, f)) for f in _PER_REQUEST])
        inputs_w, outputs_w, cached_w = cut(inputs), cut(outputs), cut(cached)
        full = None if follower is None else (g.arrival, g.finished)
        movable = offset < n - width

        def inner_cond(s):
            more = cond(s) & ((s.lo - offset < slack) | ~movable)
            return more if follower is None else more & (s.step == g.step)

        w = jax.lax.while_loop(inner_cond,
                               lambda s: step(s, offset, inputs_w, outputs_w, cached_w, full),
                               w)
        # Open loop, arrivals never change: not written back.
        updated = _PER_REQUEST if follower is not None else _PER_REQUEST[1:]
        new = eqx.tree_at(lambda st: [getattr(st, f) for f in _PER_REQUEST], w,
                          [jax.lax.dynamic_update_slice_in_dim(getattr(g, f), getattr(w, f),
                                                               offset, 0)
                           if f in updated else getattr(g, f) for f in _PER_REQUEST])
        if follower is not None:
            ended = new.finished & ~g.finished
            new = eqx.tree_at(lambda st: st.arrival, new, new.arrival.at[follower].min(
                jnp.where(ended, new.t + requests.think_time, jnp.inf), mode="drop"))
        return new

    s = jax.lax.while_loop(cond, body, init)
    return Result(arrival=s.arrival, scheduled=s.scheduled, first_token=s.first_token,
                  finish=s.finish, input_len=inputs, output_len=outputs, valid=valid,
                  finished=valid & jnp.isfinite(s.finish), preemptions=s.preemptions,
                  end_time=s.t, busy_time=s.busy, dynamic_energy=s.energy,
                  in_system_area=s.area, steps=s.step, idle_power=chip.idle_power,
                  chips=jnp.asarray(design.chips, dtype=float), window_overflow=s.overflow,
                  mixed_steps=s.mixed)


def simulate_jit(model: Model, chip: Chip, design: Design, policy: Policy,
                 requests: Requests, *, max_steps: int = 100_000, hard: bool = True,
                 vectorize: bool = True, window: int | str | None = "auto") -> Result:
    """`simulate`, compiled (`eqx.filter_jit`), with the window chosen by default
    (`window="auto"`: the same result as all requests, faster)."""
    kw = dict(max_steps=max_steps, hard=hard, vectorize=vectorize)
    if isinstance(window, str):
        return _auto_window(_simulate_compiled, model, chip, design, policy, requests, window,
                            **kw)
    return _simulate_compiled(model, chip, design, policy, requests, window=window, **kw)


# ---------------------------------------------------------------------------------------
# Summaries.


class Stats(eqx.Module):
    """Mean and percentiles of one latency over finished requests (s)."""

    mean: jnp.ndarray
    p50: jnp.ndarray
    p90: jnp.ndarray
    p95: jnp.ndarray
    p99: jnp.ndarray


class Summary(eqx.Module):
    """What a simulation says about the service."""

    ttft: Stats
    tpot: Stats
    e2e: Stats
    queue_delay: Stats
    requests: jnp.ndarray
    """Requests arrived."""
    finished: jnp.ndarray
    unfinished: jnp.ndarray
    """Arrived requests not finished when the simulation stopped."""
    preemptions: jnp.ndarray
    duration: jnp.ndarray
    """First arrival to end of the simulation (s)."""
    throughput: jnp.ndarray
    """Finished requests per second (1/s)."""
    goodput: jnp.ndarray
    """Finished requests per second meeting both SLOs (1/s)."""
    goodput_per_chip: jnp.ndarray
    utilization: jnp.ndarray
    """Fraction of the duration spent in engine steps."""
    power: jnp.ndarray
    """Average power per chip, idle gaps included (W)."""
    mean_in_system: jnp.ndarray
    """Time-average of requests arrived and unfinished, from the step clock."""


def _stats(x, mask):
    x = jnp.where(mask & jnp.isfinite(x), x, jnp.nan)
    q = jnp.nanpercentile(x, jnp.asarray([50.0, 90.0, 95.0, 99.0]), axis=-1)
    return Stats(mean=jnp.nanmean(x, axis=-1), p50=q[0], p90=q[1], p95=q[2], p99=q[3])


def summarize(result: Result, max_ttft=jnp.inf, max_tpot=jnp.inf) -> Summary:
    """Summaries of one simulation (vmap it over a batch of results).

    Args:
        result: from `simulate`.
        max_ttft, max_tpot: SLOs of goodput (s); inf: none.
    """
    done = result.finished
    arrived = result.arrived
    start = jnp.min(jnp.where(arrived, result.arrival, jnp.inf), axis=-1)
    duration = jnp.maximum(result.end_time - start, 1e-12)
    tpot_ok = jnp.where(result.output_len > 1, result.tpot <= max_tpot, True)
    good = done & (result.ttft <= max_ttft) & tpot_ok
    goodput = jnp.sum(good, axis=-1) / duration
    return Summary(
        ttft=_stats(result.ttft, done), tpot=_stats(result.tpot, done),
        e2e=_stats(result.e2e, done), queue_delay=_stats(result.queue_delay, done),
        requests=jnp.sum(arrived, axis=-1), finished=jnp.sum(done, axis=-1),
        unfinished=jnp.sum(arrived & ~done, axis=-1),
        preemptions=jnp.sum(result.preemptions, axis=-1), duration=duration,
        throughput=jnp.sum(done, axis=-1) / duration, goodput=goodput,
        goodput_per_chip=goodput / result.chips, utilization=result.busy_time / duration,
        power=result.idle_power + result.dynamic_energy / duration,
        mean_in_system=result.in_system_area / duration)
