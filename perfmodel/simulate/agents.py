"""Agent sessions: chains of serial calls whose prompts grow by each call's output and tool
result, with earlier turns as prefix-cache hits (`agent_sessions`), and the task
completion time of each session (`session_times`, `session_stats`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .arrivals import Requests, _lengths
from .results import Result, Stats, _stats


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

