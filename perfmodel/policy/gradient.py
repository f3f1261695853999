"""Batch-policy tuning by gradient on the serving surrogate, verified in the simulator.

For each discrete `Option` (layout, format) the three continuous settings x = (token
budget, sequence cap, prefill chunk cap) are solved for by the design search's augmented
Lagrangian (`search.AugmentedLagrangian`: Adam on Rockafellar's Lagrangian, in optimistix's
init/step/terminate shape):

    maximise  log objective(x) - w (p99 TTFT / SLO + p99 TPOT / SLO)
    subject to  p99 TTFT(x) <= m SLO_TTFT,   p99 TPOT(x) <= m SLO_TPOT,

with every number from `surrogate.estimate` (its goodput already counts only the requests
meeting both SLOs). Each setting lives in log space inside its box (`problem.bounds`) as
log x = log lo + (log hi - log lo) sigmoid(y), so Adam cannot walk out of the engine's
range. The margin m (0.9) is the surrogate's typical error against the simulator (median
11 % on p99 TPOT, 17 % on p99 TTFT, `calibration/surrogate_check.py`); the small weight w
breaks the ties of a flat goodput (below capacity every policy serves the whole rate)
toward shorter tails, which is the slack the rounding and the surrogate's error need.

The discrete choices are enumerated, one gradient solve per option, not relaxed with
softmax logits: a 4-chip pool has at most three layouts and a model one or two formats, a
relaxed mixture would evaluate the surrogate at every option anyway (so it costs as much),
and a softmax blend of two layouts' queueing delays describes no engine. Enumeration
gives the exact best over the discrete part.

The best option by the surrogate (SLOs met first, then objective) is rounded to
engine-valid integers (`problem.rounded`) and simulated. When the simulator finds an SLO
missed, the policy backs off along the surrogate's own gradient: a Newton step on the log
of the missed p99 in log-settings space, sized to bring it to 95 % of its SLO, at most
`backoffs` times. The surrogate ranks layouts within its own error (it preferred two TP2
replicas where the simulator favours one TP4 engine by 3 %), so the best `tries` options
are each verified this way and the best simulated one is kept. When no policy
tried meets the SLOs (a load past what they allow), the best option is solved once more
for the surrogate's goodput alone, without the p99 constraints (goodput still counts only
the requests meeting both SLOs), and the better of the simulated policies is returned.

Example (skipped by the doctests: compiling the solve takes a minute on a CPU;
`tests/test_policy.py` runs the same case):
    >>> import perfmodel as pm
    >>> from perfmodel import policy, surrogate
    >>> chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    >>> p = policy.problem(model, chip, 1, surrogate.Load(rate=4.0, input_len=512,
    ...                    output_len=64), max_ttft=0.5, max_tpot=0.03, num_requests=200)
    >>> t = policy.tune(p, max_steps=60)  # doctest: +SKIP
    >>> t.slo_met  # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import surrogate
from ..power import average_power
from ..progress import bar
from ..search.lagrangian import AugmentedLagrangian, run
from ..serving import _capped_steps
from ..simulate import Policy, Summary
from ..solvers import RESULTS
from .problem import (
    Option,
    Problem,
    bounds,
    objective_of,
    relaxed_policy,
    rounded,
    simulated,
    slo_met,
)

#: Surrogate p99s are held to this fraction of their SLOs (its typical error).
MARGIN = 0.9
#: Weight of the tail-latency tie-breaker in the score.
SLACK_WEIGHT = 0.02
#: A back-off aims the missed p99 at this fraction of its SLO.
BACKOFF_TARGET = 0.95
#: Constraints (TTFT, TPOT) kept by the solves past what the SLOs allow, in order.
FALLBACKS = ((False, True), (True, False), (False, False))
#: Past what the SLOs allow, a kept p99 is aimed at its SLO itself: goodput counts each
#: request against the SLO, and no margin can make both SLOs hold any more.
FALLBACK_MARGIN = 1.0


class Candidate(eqx.Module):
    """One option's gradient solve: the relaxed optimum, its rounding and the surrogate's
    view of the rounded policy."""

    option: Option
    relaxed: jnp.ndarray
    """x at the solution (tokens, requests, tokens)."""
    policy: Policy
    """x rounded (`problem.rounded`)."""
    estimate: surrogate.Estimate
    """The surrogate at `policy` (one instance at rate / replicas)."""
    objective: jnp.ndarray
    """The surrogate's objective at `policy` (whole pool)."""
    goodput_per_chip: jnp.ndarray
    """The surrogate's goodput per chip at `policy` (1/s)."""
    feasible: bool = eqx.field(static=True)
    """The surrogate's p99s meet the SLOs at `policy`."""
    result: RESULTS
    steps: jnp.ndarray


class Tuned(eqx.Module):
    """The tuned policy, verified."""

    option: Option
    policy: Policy
    summary: Summary
    """The simulator's summary of the problem's requests under `policy`."""
    candidate: Candidate
    """The gradient solve of `option` (the surrogate at the unrounded and rounded x)."""
    estimate: surrogate.Estimate
    """The surrogate at the final policy (after back-offs)."""
    objective: float = eqx.field(static=True)
    """The simulator's objective (goodput per chip, 1/s, or per kW)."""
    slo_met: bool = eqx.field(static=True)
    backoffs: int = eqx.field(static=True)
    """Back-off steps taken."""
    simulations: int = eqx.field(static=True)
    wall_s: float = eqx.field(static=True)
    candidates: tuple
    """Every option's `Candidate`, best first."""


def instance_load(p: Problem, option: Option) -> surrogate.Load:
    """The load one of `option.replicas` engines sees behind a round-robin router: rate /
    R, and the gaps of every R-th arrival of a renewal process (cv / sqrt(R))."""
    r = option.replicas
    return surrogate.Load(rate=p.load.rate / r, input_len=p.load.input_len,
                          output_len=p.load.output_len, cv=p.load.cv / math.sqrt(r))


def _pool(model, chip, design, x, load, replicas, chips, max_ttft, max_tpot, per_kw):
    """The surrogate's estimate of one instance and the pool's objective."""
    e = surrogate.estimate(model, chip, design, relaxed_policy(x), load, max_ttft=max_ttft,
                           max_tpot=max_tpot)
    goodput = replicas * e.goodput / chips
    if not per_kw:
        return e, goodput, goodput
    return e, goodput, goodput / (instance_power(model, chip, design, e, load) / 1e3)


def instance_power(model, chip, design, e: surrogate.Estimate, load: surrogate.Load):
    """Average power per chip of one instance under `load` with the surrogate's estimate
    `e` (W), as the simulator reports it (`power.average_power`): idle, plus the busy share
    (`e.utilization`) of the mean step's dynamic power, that step (its decodes and the
    prompt tokens arriving per step) costed by the core model under the power cap as the
    simulator costs its steps (`serving._capped_step`)."""
    tokens = load.rate * load.input_len * e.step
    (mix,) = _capped_steps(model, chip, design, design.layout, [dict(
        decode_seqs=e.running, decode_context=load.input_len + load.output_len / 2.0,
        prefill_tokens=tokens, prefill_context=load.input_len / 2.0,
        prefill_seqs=tokens / load.input_len)], 24.0, True, True)
    return average_power(chip.idle_power, mix.dynamic_energy, mix.time, e.utilization)


def _ratio(value, slo):
    finite = jnp.isfinite(slo)
    return jnp.where(finite, value / jnp.where(finite, slo, 1.0), 0.0)


@eqx.filter_jit
def _solve(model, chip, design, load, args, replicas, chips, per_kw, solver):
    lo, hi, max_ttft, max_tpot, enforce, margin = args
    span = jnp.log(hi) - jnp.log(lo)

    def settings(y):
        return jnp.exp(jnp.log(lo) + span * jax.nn.sigmoid(y))

    def fn(y, args, temperature):
        del args, temperature
        e, _, value = _pool(model, chip, design, settings(y), load, replicas, chips,
                            max_ttft, max_tpot, per_kw)
        ttft, tpot = _ratio(e.ttft.p99, max_ttft), _ratio(e.tpot.p99, max_tpot)
        score = jnp.log(value + 1e-9) - SLACK_WEIGHT * (ttft + tpot)
        g = jnp.stack([jnp.where(jnp.isfinite(max_ttft) & enforce[0], ttft / margin - 1.0,
                                 -1.0),
                       jnp.where(jnp.isfinite(max_tpot) & enforce[1], tpot / margin - 1.0,
                                 -1.0)])
        return (score, g), None

    # Start from vLLM's defaults (2048 tokens, 256 sequences, no chunk cap), inside the box.
    start = jnp.clip(jnp.asarray([2048.0, 256.0, 1e12]), lo * 1.02, hi / 1.02)
    y0 = jax.scipy.special.logit((jnp.log(start) - jnp.log(lo)) / span)
    y, state = run(solver, fn, y0, None)
    return settings(y), solver.result(state), state.step


@eqx.filter_jit
def _estimate(model, chip, design, x, load, replicas, chips, max_ttft, max_tpot, per_kw):
    return _pool(model, chip, design, x, load, replicas, chips, max_ttft, max_tpot, per_kw)


@eqx.filter_jit
def _log_tails(model, chip, design, log_x, load):
    """Jacobian of (log p99 TTFT, log p99 TPOT) in log settings (forward mode, 3 inputs)."""
    def tails(log_x):
        e = surrogate.estimate(model, chip, design, relaxed_policy(jnp.exp(log_x)), load)
        return jnp.log(jnp.stack([e.ttft.p99, e.tpot.p99]))
    return jax.jacfwd(tails)(log_x)


def _x(policy: Policy, load) -> jnp.ndarray:
    chunk = jnp.minimum(policy.long_prefill_token_threshold, load.input_len)
    return jnp.stack([policy.max_num_batched_tokens, policy.max_num_seqs, chunk])


def _candidate(p: Problem, option: Option, solver, enforce=(True, True),
               margin: float = MARGIN) -> Candidate:
    """`option`'s gradient solve, rounded; `enforce` says which p99 constraint (TTFT, TPOT)
    holds, each at `margin` x its SLO."""
    load = instance_load(p, option)
    lo, hi = bounds(p.load)
    slos = (jnp.asarray(p.max_ttft), jnp.asarray(p.max_tpot))
    per_kw = p.objective == "goodput_per_kw"
    args = (lo, hi, *slos, jnp.asarray(enforce), jnp.asarray(margin, float))
    x, result, steps = _solve(p.model, p.chip, option.design, load, args, option.replicas,
                              p.chips, per_kw, solver)
    policy = rounded(x, p.load)
    e, goodput, value = _estimate(p.model, p.chip, option.design, _x(policy, p.load), load,
                                  option.replicas, p.chips, *slos, per_kw)
    feasible = bool(e.ttft.p99 <= p.max_ttft) and bool(e.tpot.p99 <= p.max_tpot)
    return Candidate(option=option, relaxed=x, policy=policy, estimate=e, objective=value,
                     goodput_per_chip=goodput, feasible=feasible, result=result, steps=steps)


def _backoff(p: Problem, option: Option, policy: Policy, summary: Summary) -> Policy:
    """One Newton step on the log of the missed p99 (the worse one, relative to its SLO)
    along the surrogate's gradient in log settings, aimed at `BACKOFF_TARGET` x SLO."""
    load = instance_load(p, option)
    lo, hi = bounds(p.load)
    log_x = jnp.log(_x(policy, p.load))
    misses = [float(summary.ttft.p99) / p.max_ttft, float(summary.tpot.p99) / p.max_tpot]
    which = int(np.nanargmax(misses))
    gradient = _log_tails(p.model, p.chip, option.design, log_x, load)[which]
    drop = math.log(BACKOFF_TARGET / misses[which])   # < 0
    norm = float(jnp.sum(jnp.square(gradient)))
    if norm > 1e-6:
        step = gradient * drop / norm
    else:
        # The surrogate sees no lever: fewer sequences (shorter decode steps) for TPOT, a
        # larger budget (prompts through in fewer steps) for TTFT.
        step = jnp.asarray([0.0, drop, 0.0]) if which else jnp.asarray([-drop, 0.0, 0.0])
    step = jnp.clip(step, -1.0, 1.0)   # at most a factor e per setting per back-off
    return rounded(jnp.clip(jnp.exp(log_x + step), lo, hi), p.load)


def tune(p: Problem, *, max_steps: int = 150, backoffs: int = 3, tries: int = 2,
         progress: bool | None = None) -> Tuned:
    """The policy with the best objective under the SLOs, by gradient on the surrogate,
    rounded and verified in the simulator (module docstring).

    Args:
        p: the problem (`policy.problem`).
        max_steps: Adam steps of each option's solve at most.
        backoffs: back-off steps per option when the simulator finds an SLO missed.
        tries: options verified in the simulator (best by the surrogate first).
        progress: a progress bar over the options and simulations (None: on a terminal).

    Returns:
        `Tuned`: of the verified policies, the best simulated one meeting the SLOs, else
        the best simulated one.
    """
    start = time.perf_counter()
    solver = AugmentedLagrangian(max_steps=max_steps, steps_per_block=15,
                                 learning_rate=0.1, mu=10.0, rtol=1e-3, atol=1e-3)
    tries = max(1, min(tries, len(p.options)))
    steps_total = len(p.options) + tries * (backoffs + 1) + len(FALLBACKS)
    with bar(steps_total, "tuning", progress) as tick:
        candidates = []
        for option in p.options:
            candidates.append(_candidate(p, option, solver))
            tick.update(1)
        candidates.sort(key=lambda c: (c.feasible, float(c.objective)), reverse=True)
        tried, simulations = [], 0
        for candidate in candidates[:tries]:
            policy, steps = candidate.policy, 0
            while True:
                summary = simulated(p, candidate.option, policy)
                simulations += 1
                tick.update(1)
                met = slo_met(p, summary)
                tried.append((met, float(objective_of(p, summary)), candidate, policy,
                              summary, steps))
                if met or steps >= backoffs:
                    break
                new = _backoff(p, candidate.option, policy, summary)
                if eqx.tree_equal(new, policy) is True:
                    break
                policy, steps = new, steps + 1
        if not any(t[0] for t in tried):
            # No policy tried meets both SLOs (a load past what they allow). Goodput still
            # counts the requests meeting both, and one of the two SLOs may still be within
            # reach: the best option is solved again keeping only the TPOT constraint, only
            # the TTFT one, and neither, each simulated, and the best simulated one is kept.
            best, slos = candidates[0], (p.max_ttft, p.max_tpot)
            for enforce in FALLBACKS:
                kept = [math.isfinite(s) for s, e in zip(slos, enforce, strict=True) if e]
                if kept and not any(kept):
                    continue   # the SLO kept is infinite: the same solve as keeping neither
                loose = _candidate(p, best.option, solver, enforce=enforce,
                                   margin=FALLBACK_MARGIN)
                summary = simulated(p, best.option, loose.policy)
                simulations += 1
                tick.update(1)
                tried.append((slo_met(p, summary), float(objective_of(p, summary)), loose,
                              loose.policy, summary, 0))
    met, value, candidate, policy, summary, steps = max(tried, key=lambda t: t[:2])
    option = candidate.option
    per_kw = p.objective == "goodput_per_kw"
    estimate, _, _ = _estimate(p.model, p.chip, option.design, _x(policy, p.load),
                               instance_load(p, option), option.replicas, p.chips,
                               jnp.asarray(p.max_ttft), jnp.asarray(p.max_tpot), per_kw)
    return Tuned(option=option, policy=policy, summary=summary, candidate=candidate,
                 estimate=estimate, objective=value, slo_met=met, backoffs=steps,
                 simulations=simulations, wall_s=time.perf_counter() - start,
                 candidates=tuple(candidates))
