"""Grid search of the batch-policy space, every point evaluated in the simulator: the
reference the gradient tuning (`policy.tune`) is judged against.

The grid is the product of every `Option` (layout, format) with token budgets, sequence
caps and prefill chunk caps (`BUDGETS`, `SEATS`, `default_chunks`), less the points vLLM refuses
(a budget below the sequence cap). Each point is simulated on the problem's own requests,
so the grid and the tuned policy are judged on one sample. The best point meets both p99
SLOs in the simulator with the highest objective; when none does, the highest objective.

Points of one option are simulated `batch` at a time in one vmapped call. On a CPU one
compiled single-policy kernel called point by point is faster (the vmapped loop runs every
lane until the slowest lane's last step, and XLA:CPU gains little from the wider arrays:
8 policies x 1,000 requests took 21 s vmapped, 5 s one by one, on 2 cores), so `batch` is
1 by default; on an accelerator a larger batch pays.

Example:
    >>> import perfmodel as pm
    >>> from perfmodel import policy, surrogate
    >>> chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    >>> p = policy.problem(model, chip, 1, surrogate.Load(rate=4.0, input_len=512,
    ...                    output_len=64), max_ttft=0.5, max_tpot=0.03, num_requests=100)
    >>> g = policy.grid_search(p, budgets=(512, 2048), seats=(16, 64), chunks=(None,))
    >>> g.points, g.slo_met
    (4, True)
"""

from __future__ import annotations

import itertools
import math
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import simulate as sim
from ..progress import bar
from .problem import Option, Problem, objective_of, simulated, slo_met

#: Token budgets (tokens) and sequence caps (requests) of the default grid.
BUDGETS = (512, 1024, 2048, 4096, 8192)
SEATS = (16, 32, 64, 128, 256)


def default_chunks(input_len) -> tuple:
    """Default prefill chunk caps: none, and a quarter of the prompt when that is at least
    256 tokens (tokens; None: no cap)."""
    quarter = 16 * round(float(input_len) / 64.0)
    return (None, quarter) if quarter >= 256 else (None,)


class GridResult(eqx.Module):
    """The grid's best point."""

    option: Option
    policy: sim.Policy
    summary: sim.Summary
    objective: float = eqx.field(static=True)
    """The simulator's objective at the best point (goodput per chip, 1/s, or per kW)."""
    slo_met: bool = eqx.field(static=True)
    points: int = eqx.field(static=True)
    """Policies simulated."""
    wall_s: float = eqx.field(static=True)


def grid_points(budgets, seats, chunk_caps) -> list[sim.Policy]:
    """The policies of a grid, without those vLLM refuses (budget < sequence cap)."""
    return [sim.Policy(max_num_batched_tokens=float(b), max_num_seqs=float(s),
                       long_prefill_token_threshold=math.inf if c is None else float(c))
            for b, s, c in itertools.product(budgets, seats, chunk_caps) if b >= s]


@eqx.filter_jit
def _batched(model, chip, design, policies, requests, max_steps, max_ttft, max_tpot):
    def one(policy):
        result = sim.simulate(model, chip, design, policy, requests, max_steps=max_steps)
        return sim.summarize(result, max_ttft, max_tpot)
    return jax.vmap(one)(policies)


def _summaries(p: Problem, option: Option, policies, batch: int, tick) -> list:
    if batch <= 1:
        out = []
        for policy in policies:
            out.append(simulated(p, option, policy))
            tick.update(1)
        return out
    out = []
    for i in range(0, len(policies), batch):
        part = policies[i:i + batch]
        part = part + [part[-1]] * (batch - len(part))   # one shape, one compilation
        stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *part)
        summary = _batched(p.model, p.chip, option.served, stacked, p.requests, p.max_steps,
                           jnp.asarray(p.max_ttft), jnp.asarray(p.max_tpot))
        count = min(batch, len(policies) - i)
        out += [jax.tree_util.tree_map(lambda x, k=k: x[k], summary) for k in range(count)]
        tick.update(count)
    return out


def grid_search(p: Problem, *, budgets=BUDGETS, seats=SEATS, chunks=None, batch: int = 1,
                progress: bool | None = None) -> GridResult:
    """The best policy of a grid (module docstring), each point simulated.

    Args:
        p: the problem (`policy.problem`).
        budgets, seats: token budgets (tokens) and sequence caps (requests).
        chunks: prefill chunk caps (tokens; None in it: no cap); default `default_chunks(isl)`.
        batch: policies per vmapped simulator call (1: one by one).
        progress: a progress bar (None: on a terminal).
    """
    start = time.perf_counter()
    caps = default_chunks(p.load.input_len) if chunks is None else tuple(chunks)
    policies = grid_points(budgets, seats, caps)
    if not policies:
        raise ValueError("the grid is empty: every budget is below every sequence cap")
    best, points = None, 0
    with bar(len(policies) * len(p.options), "grid", progress, unit="policy") as tick:
        for option in p.options:
            for policy, summary in zip(policies, _summaries(p, option, policies, batch, tick),
                                       strict=True):
                points += 1
                key = (slo_met(p, summary), float(objective_of(p, summary)))
                if best is None or key > best[0]:
                    best = (key, option, policy, summary)
    (met, value), option, policy, summary = best
    return GridResult(option=option, policy=policy, summary=summary, objective=value,
                      slo_met=met, points=points, wall_s=time.perf_counter() - start)
