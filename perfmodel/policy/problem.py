"""What batch-policy tuning and the grid search share: the problem, its discrete options,
the box of the continuous settings, rounding to engine-valid integers and the simulator's
verdict on a policy.

A policy here is the three continuous scheduler settings x = (`max_num_batched_tokens`,
`max_num_seqs`, `long_prefill_token_threshold`), tokens, requests, tokens, inside a box
(`bounds`), and one discrete `Option`: the layout of the chips (tensor parallel `tp`,
`replicas` = chips / tp data-parallel engines behind the simulator's round-robin router)
and the weight format.

Example:
    >>> import perfmodel as pm
    >>> from perfmodel import policy
    >>> chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    >>> [(o.tp, o.replicas) for o in policy.options(model, chip, 2, 1024, 256)]
    [(1, 2), (2, 1)]
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import simulate as sim
from ..architecture import Model
from ..design import Design, Layout, precision
from ..fitted import runtime_for
from ..hardware import Chip
from ..serving import check_layout
from ..surrogate import Load

#: What tuning maximises: requests per second meeting both SLOs, per chip or per kW of the
#: chips' average power.
OBJECTIVES = ("goodput_per_chip", "goodput_per_kw")
#: Box of the continuous settings: token budget and running-sequence cap (the prefill chunk
#: cap runs from `MIN_CHUNK` to the prompt length, where it stops capping).
BUDGET_RANGE, SEATS_RANGE, MIN_CHUNK = (64.0, 32768.0), (1.0, 1024.0), 16.0
#: Tokens the budget and the chunk cap are rounded to (vLLM's KV block size).
ROUND_TO = 16
#: Requests a step of the simulator looks at (`simulate(window=)`, which makes a step's cost
#: independent of the number of requests): the smallest of these above twice the policy's
#: sequence cap (running requests and the head of the queue), so one of two kernels.
WINDOWS = (512, 2560)


class Option(eqx.Module):
    """One discrete choice: layout and weight format, with the design of one instance."""

    tp: int = eqx.field(static=True)
    replicas: int = eqx.field(static=True)
    fmt: str = eqx.field(static=True)
    """Weight format name (`design.precision`)."""
    design: Design
    """One instance (`Layout(tp)`, replicas 1): what the surrogate serves."""

    @property
    def served(self) -> Design:
        """All `replicas` instances: what the simulator serves."""
        return eqx.tree_at(lambda d: d.layout, self.design,
                           dataclasses.replace(self.design.layout, replicas=self.replicas))

    def describe(self) -> str:
        return f"tp={self.tp} x {self.replicas} replicas, {self.fmt}"


class Problem(eqx.Module):
    """A tuning problem: what runs, the load it serves, its SLOs and objective."""

    model: Model
    chip: Chip
    chips: int = eqx.field(static=True)
    load: Load
    """Rate, mean lengths and arrival burstiness (what the surrogate is told)."""
    requests: sim.Requests
    """The requests the simulator verifies with (one sample of the load, or a trace)."""
    max_ttft: float = eqx.field(static=True)
    """p99 TTFT SLO (s)."""
    max_tpot: float = eqx.field(static=True)
    """p99 TPOT SLO (s)."""
    objective: str = eqx.field(static=True)
    options: tuple
    """The `Option`s searched."""
    max_steps: int = eqx.field(static=True, default=200_000)


def options(model: Model, chip: Chip, chips: int, input_len, output_len,
            formats: tuple | None = None, engine: str = "vllm") -> tuple:
    """The `Option`s of `chips` chips: every tp dividing `chips` whose instance can split the
    model's heads and hold the weights and one request's KV, times `formats` (default:
    the checkpoint's own format, as vLLM serves it without quantization flags).

    Raises:
        ValueError: no layout of `chips` chips holds the model, or an unknown format.
    """
    found = []
    for tp in [d for d in range(1, chips + 1) if chips % d == 0]:
        layout = Layout(tp=tp)
        try:
            check_layout(model, layout)
        except ValueError:
            continue
        for fmt in formats or (None,):
            prec = precision(chip, model, fmt)
            design = Design(concurrency=1.0, layout=layout, precision=prec,
                            runtime=runtime_for(engine, chip.family))
            blocks = float(sim.engine_kv_blocks(model, chip, design)) - 1.0
            if blocks * 16.0 < float(input_len) + float(output_len):
                continue
            name = fmt or prec.names[0]
            found.append(Option(tp=tp, replicas=chips // tp, fmt=name, design=design))
    if not found:
        raise ValueError(f"does not fit: no layout of {chips} x {chip.name} holds "
                         f"{model.name} with a {int(input_len) + int(output_len):,}-token "
                         "request; use more chips or a narrower format")
    return tuple(found)


def problem(model: Model, chip: Chip, chips: int, load: Load, max_ttft, max_tpot, *,
            requests: sim.Requests | None = None, num_requests: int = 1000, seed: int = 0,
            objective: str = "goodput_per_chip", formats: tuple | None = None,
            engine: str = "vllm", max_steps: int = 200_000) -> Problem:
    """A `Problem`; without `requests`, `num_requests` gamma arrivals at `load`'s rate and
    cv (Poisson at cv 1) with its lengths, from `seed`.

    Args:
        max_ttft, max_tpot: p99 SLOs (s); inf for none.

    Raises:
        ValueError: an unknown objective, non-positive SLOs, a model that does not fit.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: valid objectives are "
                         f"{', '.join(OBJECTIVES)}")
    for name, value in (("max_ttft", max_ttft), ("max_tpot", max_tpot)):
        if not float(value) > 0:
            raise ValueError(f"{name} must be > 0 s, got {value}")
    if requests is None:
        requests = sim.gamma(jax.random.PRNGKey(seed), load.rate, load.cv, num_requests,
                             load.input_len, load.output_len)
    longest = float(jnp.max(jnp.where(requests.valid, requests.input_len
                                      + requests.output_len, 0.0)))
    found = options(model, chip, chips, load.input_len, longest - float(load.input_len),
                    formats, engine) if requests.size else ()
    return Problem(model=model, chip=chip, chips=chips, load=load, requests=requests,
                   max_ttft=float(max_ttft), max_tpot=float(max_tpot), objective=objective,
                   options=found, max_steps=max_steps)


def load_of(requests: sim.Requests) -> Load:
    """A trace summarised for the surrogate: rate (arrivals over the span), mean lengths
    and the coefficient of variation of the gaps."""
    valid = np.asarray(requests.valid)
    arrival = np.sort(np.asarray(requests.arrival)[valid])
    if arrival.size < 3 or not arrival[-1] > arrival[0]:
        raise ValueError("the trace needs at least three requests spread over time")
    gaps = np.diff(arrival)
    return Load(rate=(arrival.size - 1) / (arrival[-1] - arrival[0]),
                input_len=float(np.asarray(requests.input_len)[valid].mean()),
                output_len=float(np.asarray(requests.output_len)[valid].mean()),
                cv=max(float(gaps.std() / gaps.mean()), 1e-3))


def bounds(load: Load):
    """Lower and upper bounds of x (arrays of 3: tokens, requests, tokens)."""
    chunk_hi = max(float(load.input_len), MIN_CHUNK * 2.0)
    return (jnp.asarray([BUDGET_RANGE[0], SEATS_RANGE[0], MIN_CHUNK]),
            jnp.asarray([BUDGET_RANGE[1], SEATS_RANGE[1], chunk_hi]))


def relaxed_policy(x) -> sim.Policy:
    """The simulator's `Policy` of continuous settings x (for the surrogate)."""
    return sim.Policy(max_num_batched_tokens=x[0], max_num_seqs=x[1],
                      long_prefill_token_threshold=x[2])


def rounded(x, load: Load) -> sim.Policy:
    """x rounded to what the engine accepts: whole sequences, the budget and the chunk cap
    in whole blocks, the budget at least the sequence cap (vLLM refuses
    `max_num_batched_tokens < max_num_seqs`), and a chunk cap at or above the longest
    prompt dropped (no cap, vLLM's 0)."""
    budget, seats, chunk = (float(v) for v in np.asarray(x))
    seats = max(1.0, round(seats))
    budget = max(seats, ROUND_TO * max(1.0, round(budget / ROUND_TO)))
    chunk = ROUND_TO * max(1.0, round(chunk / ROUND_TO))
    if chunk >= float(load.input_len):
        chunk = math.inf
    return sim.Policy(max_num_batched_tokens=budget, max_num_seqs=seats,
                      long_prefill_token_threshold=chunk)


def as_dict(policy: sim.Policy) -> dict:
    """A policy's settings for JSON (a chunk cap of None: no cap)."""
    chunk = float(policy.long_prefill_token_threshold)
    return {"max_num_batched_tokens": int(policy.max_num_batched_tokens),
            "max_num_seqs": int(policy.max_num_seqs),
            "long_prefill_token_threshold": None if math.isinf(chunk) else int(chunk)}


@eqx.filter_jit
def _simulate(model, chip, design, policy, requests, max_steps, max_ttft, max_tpot, window):
    result = sim.simulate(model, chip, design, policy, requests, max_steps=max_steps,
                          window=window)
    return sim.summarize(result, max_ttft, max_tpot), result.window_overflow


def simulated(p: Problem, option: Option, policy: sim.Policy) -> sim.Summary:
    """The simulator's summary of `p.requests` served by `option` under `policy` (one
    compiled kernel per option structure and window; the policy is traced)."""
    seats = float(policy.max_num_seqs)
    window = next((w for w in WINDOWS if w >= 2.0 * seats), None)
    window = None if window is None or window >= p.requests.size else window
    args = (p.model, p.chip, option.served, policy, p.requests, p.max_steps,
            jnp.asarray(p.max_ttft), jnp.asarray(p.max_tpot))
    summary, overflow = _simulate(*args, window)
    if window is not None and bool(overflow):   # the window hid a request: look at all
        summary, _ = _simulate(*args, None)
    return summary


def objective_of(p: Problem, summary: sim.Summary):
    """The objective of a simulated summary: goodput per chip (1/s) or per kW (1/(s kW))."""
    if p.objective == "goodput_per_chip":
        return summary.goodput_per_chip
    return summary.goodput / (summary.power * p.chips / 1e3)


def slo_met(p: Problem, summary: sim.Summary) -> bool:
    """Whether the simulated p99 TTFT and p99 TPOT meet the SLOs with every request done."""
    tpot = float(summary.tpot.p99)
    return (int(summary.unfinished) == 0 and float(summary.ttft.p99) <= p.max_ttft
            and (math.isnan(tpot) or tpot <= p.max_tpot))
