"""Serving under arrivals: an iteration-level simulator of continuous batching.

The engine runs one step after another, scheduling as vLLM v1's scheduler does (or SGLang's
and TensorRT-LLM's, as options of the same scheduler) and costing each step with the core
step-time model for the mix it actually carries. Requests arriving during a step are seen
at the next one. Latencies are the engine's: from arrival in its queue (vLLM `queued_ts`),
without HTTP or tokenization. Every step is one iteration of a `jax.lax.while_loop` over
fixed-size request arrays (padded; `Requests.valid`), so a simulation is one compiled call,
`vmap`-able over policies and loads; it stops when every request finished, when what waits
can never be admitted, or after `max_steps`.

Where things live:

- `engines`: the scheduler's settings (`Policy`, `engine_defaults`, `engine_kv_blocks`).
- `arrivals`: the requests offered (`Requests`, `poisson`, `gamma`, `closed_loop`, `trace`).
- `agents`: agent sessions (`agent_sessions`, `session_times`, `session_stats`).
- `scheduler`: the step loop of one engine instance (how a step is scheduled and costed).
- `replicas`: data-parallel instances behind a round-robin router.
- `disaggregated`: prefill and decode pools with the KV moved between them
  (`simulate_disaggregated`).
- `validate`: argument and traced-policy checks.
- `entry`: `simulate` and its compiled form `simulate_jit` (with the `window="auto"`
  search).
- `results`: what a run reports (`Result`) and its summaries (`summarize`).

Example:
    >>> import jax, perfmodel as pm
    >>> from perfmodel import simulate as sim
    >>> chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    >>> design = pm.Design(concurrency=1, layout=pm.Layout(tp=1),
    ...                    precision=pm.precision(chip, model))
    >>> requests = sim.poisson(jax.random.PRNGKey(0), rate=2.0, num=32, input_len=512,
    ...                        output_len=64)
    >>> result = sim.simulate_jit(model, chip, design, sim.Policy(), requests, max_steps=4000)
    >>> s = sim.summarize(result)
    >>> int(s.unfinished), 0.005 < float(s.ttft.p50) < 0.2
    (0, True)
"""

from .agents import agent_sessions, session_stats, session_times
from .arrivals import Requests, closed_loop, gamma, poisson, trace
from .disaggregated import simulate_disaggregated
from .engines import ENGINES, Policy, engine_defaults, engine_kv_blocks
from .entry import AUTO_WINDOW, simulate, simulate_jit
from .results import Result, Stats, Summary, summarize

__all__ = ["AUTO_WINDOW", "ENGINES", "Policy", "Requests", "Result", "Stats", "Summary",
           "agent_sessions", "closed_loop", "engine_defaults", "engine_kv_blocks", "gamma",
           "poisson", "session_stats", "session_times", "simulate", "simulate_disaggregated",
           "simulate_jit", "summarize", "trace"]
