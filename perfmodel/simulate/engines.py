"""The scheduler's settings: `Policy` (vLLM v1's names) and the defaults of vLLM, SGLang
and TensorRT-LLM mapped onto them (`engine_defaults`), and the KV blocks an engine holds
when its policy does not fix them (`engine_kv_blocks`)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp

from ..architecture import Model
from ..checks import NON_NEGATIVE, Range, as_number, check
from ..design import Design
from ..hardware import Chip
from ..kvcache import max_batch


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
    recv_interval: jnp.ndarray = eqx.field(converter=as_number, default=1.0)
    """Decode steps between the scheduler's looks for new requests (SGLang's
    `--scheduler-recv-interval`, `SchedulerRecvSkipper`, sgl-project/sglang
    python/sglang/srt/managers/scheduler_recv_skipper.py: a decode step counts 1, any other
    step enough to look at once, and an idle engine looks at once); a request that arrives
    meanwhile waits for the next look. 1 (every engine's default) looks every step
    (steps)."""
    engine: str = eqx.field(static=True, default="vllm")
    """Which engine these settings describe (a label for reports)."""

    def __check_init__(self):
        count = Range(low=1.0, integer=True)
        check(self, {"max_num_seqs": count, "max_num_batched_tokens": count,
                     "long_prefill_token_threshold": Range(low=1.0, infinite=True),
                     "kv_blocks": Range(low=2.0, infinite=True), "block_size": count,
                     "output_reserve": Range(low=0.0, high=1.0),
                     "batch_wait": NON_NEGATIVE, "batch_wait_tokens": NON_NEGATIVE,
                     "recv_interval": count})
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
               scheduler_recv_interval=1, **settings) -> Policy:
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
        - `scheduler_recv_interval` (decode steps, default 1): the scheduler looks for new
          requests once every that many decode steps (`Policy.recv_interval`; the
          InferenceX B200 recipes set 10 below 16 requests, 30 from 16).

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
                         "recv_interval": scheduler_recv_interval,
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



def engine_kv_blocks(model: Model, chip: Chip, design: Design, block_size=16.0):
    """KV blocks that fit per instance next to the weights and the activation reserve in
    `memory_fraction` of memory (`kvcache.max_batch` at one block's context) (blocks)."""
    rt = design.runtime
    return jnp.floor(max_batch(model, design.layout, design.precision, chip.hbm_capacity,
                               jnp.asarray(block_size, dtype=float), rt.memory_fraction,
                               rt.activation_reserve, design.mapping, chip.num_slices,
                               rt.fraction_of_free))
