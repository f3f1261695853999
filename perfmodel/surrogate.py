"""Serving under arrivals in closed form: a smooth surrogate of the simulator's summaries.

`simulate` runs vLLM v1's scheduler step by step; this module approximates what it reports
(mean and p50/p90/p95/p99 of TTFT and TPOT, goodput, utilization) for an open loop of
requests arriving at rate lambda with inter-arrival coefficient of variation c_a (1:
Poisson, above 1: bursty gamma), every prompt I tokens and every output O tokens, in a few
dozen array operations that `jit`, `vmap` and `grad` go through. Every step time is the
core model's, called as the simulator calls it (`serving._capped_step`: `roofline.step_cost`
under the power cap) for the mix a step carries: T(b, p) with b decoding sequences at
context I + O/2 and p prompt tokens attending on average I/2 of context.

Derivation (no validated closed form exists for chunked-prefill continuous batching; this
one is built from textbook pieces and measured against the simulator in
`calibration/surrogate_check.py`):

1. **Steps.** With b requests decoding, n = lambda T prompts arrive during a step of mean
   length T; their D = I n tokens ride the next step(s). A request takes at most
   c = min(I, long_prefill_token_threshold, A) prompt tokens per step, where A = M - b is
   what the budget M (`max_num_batched_tokens`) leaves after the decodes (served first).
   Counting chunks as Poisson arrivals (n_c = D / c per step), a step carries prompt tokens
   with probability 1 - exp(-n_c), and then P = min(D / (1 - exp(-n_c)), A) of them on
   average; the fraction of steps carrying prompt tokens is f = D / P. So

       T = T(b, 0) + f (T(b, P) - T(b, 0)),    b = min(lambda (O - 1) T, S),

   a fixed point in (b, T) (Little's law: each request decodes O - 1 steps), solved by
   damped iteration (`optimistix.fixed_point`; gradients by the implicit function theorem).
   S = min(`max_num_seqs`, kv_blocks x block_size / (I + (1 + r) O/2 + block_size/2)) is
   the seats the engine can hold (a running request holds on average the blocks of
   I + O/2 tokens plus half a block of rounding, and the share r = `Policy.output_reserve`
   of its remaining O/2 that admission reserved: SGLang's ratio, 1 for TensorRT-LLM's
   GUARANTEED_NO_EVICT); caps are `smooth_min`.
2. **Own prefill.** A request's prompt takes k = I / c steps (>= 1, as c <= I); each
   carries its chunk c and the chunks that arrived with it, Poisson with mean n_c
   (variance c_a^2 n_c for a renewal process), beside b' decodes, b' = b +- sqrt(c_a^2 b)
   (the number in an infinite-server system is Poisson; c_a^2 scales a renewal count's
   variance). Its mean is k T(b, min(c (1 + n_c), A)); its variance, from one standard
   deviation of each count costed by the step model, k^2 (dT_b)^2 + k (dT_n)^2 (the batch
   is shared by the k steps, the co-arrivals are not). At low load (n_c, b -> 0) it is
   exactly the single request's prefill, k T(0, c).
3. **Residual step.** A request arriving during a step is seen at its end: the engine is
   busy with probability u = 1 - exp(-lambda E2E) (the M/G/inf system is empty with
   probability exp(-L), L = lambda E2E), and the residual of a step is length-biased:
   uniform on [0, T_r], T_r = E[T^2] / E[T], when busy: mean u T_r / 2, variance
   u T_r^2 / 3 - (u T_r / 2)^2. u is the reported utilization.
4. **Queues.** Two resources can make requests wait. Seats: a G/G/S queue of S servers
   whose service is a request's life E_s = k T_own + (O - 1) T evaluated with every seat
   taken (b = S: a request waits only then, and the seats then turn over at that pace),
   load rho_s = lambda E_s / S (rho_s = 1: the closed-loop throughput at S clients);
   by Sakasegawa's approximation (1977; Allen-Cunneen's (c_a^2 + c_s^2)/2 for bursts)
   P(wait) = rho_s^(sqrt(2 (S + 1)) - 1) and the wait of those who wait is exponential with
   mean E_s / (S (1 - rho_s)) (c_a^2 + c_s^2) / 2. Prompt tokens: a single server working
   at A / T(b, A) tokens/s when backlogged, load rho_t = lambda I T(b, A) / A, an M/D/1
   with Kingman's correction: P(wait) = rho_t, mean wait of those who wait
   s_t / (1 - rho_t) (c_a^2 + c_s^2) / 2 with s_t = I T(b, A) / A. Lengths are fixed, so
   c_s = 0. An exponential tail gives the q-quantile of a wait as
   m log(P(wait) / (1 - q)) when positive (the p99 is m x ln(100 P(wait))), m the
   mean of waiters for the seats (heavy traffic) and, for the prompt tokens, 1 / theta,
   theta the exact decay rate of a single server with fixed service under gamma renewal
   arrivals (Cramer-Lundberg, `_decay`): Kingman's heavy-traffic rate 2 (1 - rho) / c_a^2
   s_t is its limit at rho -> 1 and makes the tail too heavy below it (by 6-20 % at p99
   for rho = 0.9-0.5 under Poisson arrivals).
5. **TTFT** = own prefill + residual + waits: mean the sum of means; the q-quantile
   own + residual mean + sqrt((z_q sd)^2 + wait_q^2), where sd is the standard deviation
   of own prefill and residual together (normal; the residual is uniform on [0, T_r] with
   probability u) and wait_q the wait's quantile: independent parts' excesses over the
   mean add in quadrature (exact for normals, the larger one when the other is nil).
6. **TPOT.** Mean T. A request's O - 1 decode steps carry the prompt tokens that arrive in
   (O - 1) T, whose count has variance c_a^2 n (O - 1) (prompts) and cost
   beta = (T(b, P) - T(b, 0)) / P per token; and they run beside a batch whose average
   over the request's life has variance (2/3) c_a^2 b (a window count of length D averaged
   over a window of length D: (1/D^2) integral of lambda (D - |s - t|) = 2/3 lambda D),
   costing dT/db each. A longer step keeps every request longer, so more decode beside:
   the fixed point's slope s = d(lambda (O - 1) T)/db amplifies a disturbance by
   1 / (1 - s). So TPOT_q = T + z_q sqrt(beta^2 I^2 c_a^2 n / (O - 1) +
   (dT/db)^2 (2/3) c_a^2 b) / (1 - s): the binomial spread of chunk-carrying steps of
   `serving`'s steady state, with the arrival process's counts and the batch's feedback.
7. **Stability.** rho = max(rho_s, rho_t) is the load of the binding resource; at rho >= 1
   `unstable` is True and the waits use 1 - rho floored (smoothly) at `MIN_GAP`, finite and
   large, with finite gradients. `capacity` is the rate at which rho = 1 (bisection).
   Goodput = min(lambda, capacity) P(TTFT <= SLO) P(TPOT <= SLO), with the wait's
   exponential tail, a normal own-prefill spread and a normal TPOT.

Not modelled: preemption (KV exhaustion is only a cap on seats), length distributions
(fixed I and O), prefix caching, the partial-chunk detail of the last admitted request, and
the discreteness of a chunk count (k is I / c, not its ceiling).

Example:
    >>> import jax, perfmodel as pm
    >>> from perfmodel import simulate as sim, surrogate
    >>> chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    >>> design = pm.Design(concurrency=1, layout=pm.Layout(tp=1),
    ...                    precision=pm.precision(chip, model))
    >>> load = surrogate.Load(rate=2.0, input_len=512, output_len=64)
    >>> # estimate_jit: estimate compiled as one program (eager, it runs op by op: 5x slower)
    >>> e = surrogate.estimate_jit(model, chip, design, sim.Policy(), load)
    >>> bool(e.unstable), 0.005 < float(e.ttft.p50) < 0.2
    (False, True)
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optimistix as optx

from .architecture import Model
from .checks import POSITIVE, Range, arguments, as_number, check
from .design import Design, Disaggregated, Layout
from .hardware import Chip
from .serving import _capped_steps, check_layout
from .simulate import Policy, Stats, engine_kv_blocks
from .simulate.validate import _checked
from .smooth import safe_sqrt, smooth_max, smooth_min, soft_penalty

#: Normal quantiles of p50, p90, p95, p99.
QUANTILES = (0.5, 0.9, 0.95, 0.99)
_Z = tuple(float(x) for x in (0.0, 1.2815515655446004, 1.6448536269514722,
                              2.3263478740408408))
#: Smallest 1 - rho a wait divides by (past capacity the waits are held there, finite).
MIN_GAP = 1e-3
#: Step-time sharpness, as the simulator costs its steps.
_STEP_SHARPNESS = 24.0
FIXED_POINT_RTOL, FIXED_POINT_ATOL, FIXED_POINT_MAX_STEPS = 1e-12, 1e-15, 400


class Load(eqx.Module):
    """An open loop of requests: renewal arrivals and fixed lengths.

    Example:
        >>> Load(rate=0.0, input_len=512, output_len=64)
        Traceback (most recent call last):
        ...
        ValueError: Load.rate must be > 0, got 0
    """

    rate: jnp.ndarray = eqx.field(converter=as_number)
    """Arrivals per second (1/s)."""
    input_len: jnp.ndarray = eqx.field(converter=as_number)
    """Prompt tokens of every request (tokens)."""
    output_len: jnp.ndarray = eqx.field(converter=as_number)
    """Output tokens of every request, the first included (tokens)."""
    cv: jnp.ndarray = eqx.field(converter=as_number, default=1.0)
    """Coefficient of variation of inter-arrival times (1: Poisson; >1: bursty gamma)."""

    def __check_init__(self):
        check(self, {"rate": POSITIVE, "input_len": Range(low=1.0),
                     "output_len": Range(low=1.0), "cv": POSITIVE})


class Estimate(eqx.Module):
    """The surrogate's summaries of serving `Load` under a `Policy` (see the module
    docstring for each formula)."""

    ttft: Stats
    """Time to first token (s): mean, p50, p90, p95, p99."""
    tpot: Stats
    """Time per output token after the first (s)."""
    e2e_mean: jnp.ndarray
    """Mean arrival to last token (s)."""
    goodput: jnp.ndarray
    """Requests per second meeting both SLOs (1/s)."""
    throughput: jnp.ndarray
    """Requests served per second, min(rate, capacity) smoothly (1/s)."""
    utilization: jnp.ndarray
    """Fraction of time the engine runs steps, 1 - exp(-rate E2E)."""
    load: jnp.ndarray
    """Load of the binding resource, max(seat_load, token_load); >= 1 is unstable."""
    seat_load: jnp.ndarray
    """rate x a request's time in a seat with every seat taken / seats."""
    token_load: jnp.ndarray
    """Prompt tokens arriving / prompt tokens a backlogged engine processes."""
    running: jnp.ndarray
    """Requests decoding in a step (the fixed point b)."""
    seats: jnp.ndarray
    """Running requests the engine holds: max_num_seqs or KV capacity (requests)."""
    step: jnp.ndarray
    """Mean step time (s)."""
    prefill_fraction: jnp.ndarray
    """Fraction of steps carrying prompt tokens."""
    unstable: jnp.ndarray
    """True at or past capacity (load >= 1): waits are held finite, not steady."""
    converged: jnp.ndarray
    """True when the step fixed point converged."""


def _validate(model, chip, design, policy, load):
    arguments(model=(model, Model), chip=(chip, Chip), design=(design, Design),
              policy=(policy, Policy), load=(load, Load))
    if isinstance(design.layout, Disaggregated):
        raise ValueError("design.layout: the surrogate serves one aggregated instance; "
                         "a Disaggregated layout is not modelled")
    if isinstance(design.layout, Layout) and design.layout.replicas != 1:
        raise ValueError(f"design.layout.replicas must be 1 (one engine instance), got "
                         f"{design.layout.replicas}")
    if isinstance(design.layout, Layout):
        check_layout(model, design.layout)


def _positive_part(x, sharpness):
    # Smooth max(0, x) of a dimensionless x (softplus; log(2) / sharpness at 0).
    return soft_penalty(x, sharpness)


def _decay(rho, ca2, iterations: int = 12):
    """theta s: the decay rate of a single-server queue's wait tail, P(W > t) ~ exp(-theta
    t), times the (fixed) service time s, for renewal arrivals with gamma inter-arrival
    times of squared coefficient of variation `ca2` (shape k = 1 / ca2; Poisson at 1) and
    load `rho` < 1 (dimensionless).

    theta is the positive root of E[exp(theta S)] E[exp(-theta A)] = 1 (Cramer-Lundberg;
    Kingman, "On queues in heavy traffic", J. R. Stat. Soc. B 24, 1962; Asmussen, "Applied
    Probability and Queues", 2003, XIII.5), here x = k log(1 + x / (k rho)) with x = theta s.
    Newton from the heavy-traffic value 2 (1 - rho) / ca2 (the rate of Kingman's
    exponential, which the root approaches as rho -> 1): the function is concave and that
    start lies past its maximum, so the iterates approach the root from above after the
    first step. At rho = 0.5, 0.7 and 0.9 under Poisson arrivals the root is 1.26, 0.68
    and 0.21 against 1.0, 0.6 and 0.2: the heavy-traffic tail is too heavy below capacity.

    Example:
        >>> round(float(_decay(jnp.asarray(0.7), 1.0)), 3)
        0.675
    """
    k = 1.0 / jnp.maximum(ca2, 1e-6)     # regular arrivals: no tail to speak of
    rho = jnp.maximum(rho, 1e-12)         # an idle server: a steep, finite decay (not NaN)
    x = 2.0 * (1.0 - rho) * k
    for _ in range(iterations):
        g = k * jnp.log1p(x / (k * rho)) - x
        slope = 1.0 / (rho + x / k) - 1.0
        x = x - g / slope
    return x


def _normal_cdf(x):
    return 0.5 * (1.0 + jax.scipy.special.erf(x / math.sqrt(2.0)))


def _step_times(model, chip, design, context, input_len, hard, vectorize):
    """Times (s) of steps given as (decode sequences, prompt tokens) pairs, costed as the
    simulator costs a step."""
    def times(mixes):
        kws = [dict(decode_seqs=b, decode_context=context, prefill_tokens=p,
                    prefill_context=input_len / 2.0, prefill_seqs=p / input_len)
               for b, p in mixes]
        results = _capped_steps(model, chip, design, design.layout, kws, _STEP_SHARPNESS,
                                hard, vectorize)
        return [r.time for r in results]
    return times


def _chunks(demand, chunk, available, sharpness):
    """Mean prompt tokens of a step that carries some, and the fraction that do."""
    arrivals = demand / chunk
    # -expm1(-n) / n -> 1 as n -> 0: tokens per carrying step -> one chunk.
    small = arrivals < 1e-8
    safe = jnp.where(small, 1.0, arrivals)
    carry = jnp.where(small, 1.0 - arrivals / 2.0, -jnp.expm1(-safe) / safe)
    tokens = smooth_min(chunk / carry, available, sharpness=sharpness)
    return tokens, jnp.minimum(demand / tokens, 1.0)


def estimate(model: Model, chip: Chip, design: Design, policy: Policy, load: Load, *,
             max_ttft=jnp.inf, max_tpot=jnp.inf, sharpness=24.0, hard: bool = True,
             vectorize: bool = True) -> Estimate:
    """The surrogate's summaries of one engine instance serving `load` under `policy`.

    Args:
        model: architecture (static).
        chip: accelerator spec.
        design: layout (aggregated, one replica), precisions, runtime (its step and
            per-sequence overheads are part of every step, as in `simulate`).
        policy: scheduler settings (`simulate.Policy`); `reserve_full_prompt` and
            `prefix_caching` are not modelled.
        load: arrival rate, burstiness and lengths.
        max_ttft, max_tpot: SLOs of goodput (s); inf: none.
        sharpness: p of the smooth caps and positive parts of the queueing formulas
            (traced); the step times use the simulator's.
        hard: static; exact max in the step-time roofline (the simulator's default).
        vectorize: static; cost the steps as one stack (`roofline.step_cost`).

    Returns:
        `Estimate`, elementwise in the inputs.

    Raises:
        ValueError: a spec of the wrong kind, a disaggregated or replicated layout.
        equinox.EquinoxRuntimeError: a traced policy value out of range.
    """
    _validate(model, chip, design, policy, load)
    policy = _checked(policy)
    lam, ca2 = load.rate, jnp.square(load.cv)
    I, O = load.input_len, load.output_len
    bs = policy.block_size
    kv_blocks = jnp.where(jnp.isinf(policy.kv_blocks),
                          engine_kv_blocks(model, chip, design, bs), policy.kv_blocks) - 1.0
    held = I + (1.0 + policy.output_reserve) * O / 2.0 + bs / 2.0
    seats = smooth_min(policy.max_num_seqs, kv_blocks * bs / held,
                       sharpness=sharpness)
    budget = policy.max_num_batched_tokens
    steps = _step_times(model, chip, design, I + O / 2.0, I, hard, vectorize)
    # Decodes are served first; at least one prompt token per step is left (the budget
    # exceeds the seats in any useful policy).
    decode_cap = smooth_min(seats, jnp.maximum(budget - 1.0, 1.0), sharpness=sharpness)

    def chunk_of(b):
        available = jnp.maximum(budget - b, 1.0)
        chunk = smooth_min(I, policy.long_prefill_token_threshold, available,
                           sharpness=sharpness)
        return chunk, available

    def mean_step(b, step):
        chunk, available = chunk_of(b)
        tokens, frequency = _chunks(lam * I * step, chunk, available, sharpness)
        plain, mixed = steps([(b, 0.0), (b, tokens)])
        return plain + frequency * (mixed - plain), plain, mixed, tokens, frequency

    def update(y, _):
        b, step = y
        new_step = mean_step(b, step)[0]
        new_b = smooth_min(lam * (O - 1.0) * new_step, decode_cap, sharpness=sharpness)
        return (0.5 * b + 0.5 * new_b, 0.5 * step + 0.5 * new_step)

    start = steps([(jnp.zeros_like(lam), 0.0)])[0]
    y0 = (jnp.zeros_like(lam * start), jnp.broadcast_to(start, jnp.shape(lam * start)))
    solver = optx.FixedPointIteration(rtol=FIXED_POINT_RTOL, atol=FIXED_POINT_ATOL)
    sol = optx.fixed_point(update, solver, y0, max_steps=FIXED_POINT_MAX_STEPS, throw=False)
    b, _ = sol.value
    step, plain, mixed, tokens, frequency = mean_step(b, sol.value[1])
    converged = sol.result == optx.RESULTS.successful

    chunk, available = chunk_of(b)
    arrivals = lam * I * step / chunk               # chunks arriving per step
    num_chunks = I / chunk                          # >= 1: chunk <= I
    # Own prefill: k steps, each with the chunks that arrived with it and the batch beside;
    # one standard deviation of each count, costed by the step model.
    spread_b = safe_sqrt(ca2 * b)
    spread_n = chunk * safe_sqrt(ca2 * arrivals)
    own_tokens = smooth_min(chunk * (1.0 + arrivals), available, sharpness=sharpness)
    full, own_step, more_b, more_n = steps([
        (b, available), (b, own_tokens),
        (smooth_min(b + spread_b, decode_cap, sharpness=sharpness), own_tokens),
        (b, smooth_min(own_tokens + spread_n, available, sharpness=sharpness))])
    own_mean = num_chunks * own_step
    # The batch is shared by the k steps, the co-arrivals are not.
    own_var = (jnp.square(num_chunks * (more_b - own_step))
               + num_chunks * jnp.square(more_n - own_step))
    # Residual of the step in progress at arrival (length-biased), when busy.
    second = (1.0 - frequency) * plain ** 2 + frequency * mixed ** 2
    residual_len = second / step
    life = own_mean + (O - 1.0) * step
    busy = -jnp.expm1(-lam * life)
    residual_mean = busy * residual_len / 2.0
    residual_var = busy * jnp.square(residual_len) / 3.0 - jnp.square(residual_mean)
    base_sd = safe_sqrt(own_var + jnp.maximum(residual_var, 0.0))
    # Queues: seats (G/G/S, Sakasegawa) and prompt tokens (G/D/1, Kingman); c_s = 0.
    burst = ca2 / 2.0
    # Requests wait for a seat only when every seat is taken; the seats then turn over at
    # the full batch's pace, so that life sets the queue (and the stability bound: the
    # closed-loop throughput at max_num_seqs).
    full_step = mean_step(decode_cap, mean_step(decode_cap, step)[0])[0]
    own_full = num_chunks * steps([(decode_cap, smooth_min(
        own_tokens, jnp.maximum(budget - decode_cap, 1.0), sharpness=sharpness))])[0]
    life_full = own_full + (O - 1.0) * full_step
    seat_load = lam * life_full / seats
    token_service = I * full / available     # one prompt's tokens at the full step's pace
    token_load = lam * token_service
    rho = smooth_max(seat_load, token_load, sharpness=sharpness)

    def gap(x):
        return smooth_max(1.0 - x, MIN_GAP, sharpness=sharpness)

    seat_wait_p = jnp.minimum(seat_load, 1.0) ** (jnp.sqrt(2.0 * (seats + 1.0)) - 1.0)
    seat_wait_m = life_full / (seats * gap(seat_load)) * burst
    token_wait_p = jnp.minimum(token_load, 1.0)
    token_wait_m = token_service / gap(token_load) * burst
    wait_mean = seat_wait_p * seat_wait_m + token_wait_p * token_wait_m

    def tail(p, m, q):
        return m * _positive_part(jnp.log(jnp.maximum(p, 1e-300) / (1.0 - q)), sharpness)

    # The prompt-token queue's tail decays at the exact rate of a single server with fixed
    # service (`_decay`) rather than Kingman's heavy-traffic one (the mean stays Kingman's,
    # exact for M/D/1); past capacity the gap is floored as above.
    token_tail_m = token_service / _decay(1.0 - gap(token_load), ca2)
    base = own_mean + residual_mean
    ttft_q = []
    for q, z in zip(QUANTILES, _Z, strict=True):
        wait_q = tail(seat_wait_p, seat_wait_m, q) + tail(token_wait_p, token_tail_m, q)
        # Independent parts: their excesses over the mean add in quadrature (exact for
        # normals; the larger one when the other is nil), with no smooth-max tie bias.
        ttft_q.append(base + safe_sqrt(jnp.square(z * base_sd) + jnp.square(wait_q)))
    ttft_mean = own_mean + residual_mean + wait_mean
    # TPOT: chunk-carrying steps met and the batch beside, over O - 1 steps.
    per_token = (mixed - plain) / tokens
    slope = jax.jvp(lambda x: steps([(x, 0.0)])[0], (b,), (jnp.ones_like(b),))[1]
    prompts = lam * step
    variance = (jnp.square(per_token * I) * ca2 * prompts / jnp.maximum(O - 1.0, 1.0)
                + jnp.square(slope) * (2.0 / 3.0) * ca2 * b)
    # Feedback: a longer step keeps requests longer, so more decode beside (the fixed
    # point's slope s = d b'/d b); a disturbance of the step grows by 1 / (1 - s).
    feedback = jax.jvp(lambda x: smooth_min(lam * (O - 1.0) * mean_step(x, step)[0],
                                            decode_cap, sharpness=sharpness),
                       (b,), (jnp.ones_like(b),))[1]
    spread = safe_sqrt(variance) / smooth_max(1.0 - feedback, MIN_GAP, sharpness=sharpness)
    tpot_q = [step + z * spread for z in _Z]
    # Goodput: exponential wait tail past the own prefill's normal spread, normal TPOT.
    capacity_rate = lam / rho
    throughput = smooth_min(lam, capacity_rate, sharpness=sharpness)
    own_sd = jnp.maximum(base_sd, 1e-12 * own_mean)
    slack = max_ttft - own_mean - residual_mean
    slack_pos = jnp.where(jnp.isfinite(slack), slack, 0.0)
    late = (seat_wait_p * jnp.exp(-jnp.maximum(slack_pos, 0.0) / seat_wait_m)
            + token_wait_p * jnp.exp(-jnp.maximum(slack_pos, 0.0)
                                     / jnp.maximum(token_tail_m, 1e-300)))
    ttft_ok = jnp.where(jnp.isinf(max_ttft), 1.0,
                        jnp.clip(1.0 - late, 0.0, 1.0) * _normal_cdf(slack_pos / own_sd))
    tpot_ok = jnp.where(jnp.isinf(max_tpot), 1.0, _normal_cdf(
        (jnp.where(jnp.isinf(max_tpot), 0.0, max_tpot) - step)
        / jnp.maximum(spread, 1e-9 * step)))
    goodput = throughput * ttft_ok * tpot_ok

    def stats(mean, qs):
        return Stats(mean=mean, p50=qs[0], p90=qs[1], p95=qs[2], p99=qs[3])

    return Estimate(ttft=stats(ttft_mean, ttft_q), tpot=stats(step, tpot_q),
                    e2e_mean=ttft_mean + (O - 1.0) * step, goodput=goodput,
                    throughput=throughput, utilization=busy, load=rho, seat_load=seat_load,
                    token_load=token_load, running=b, seats=seats, step=step,
                    prefill_fraction=frequency, unstable=rho >= 1.0, converged=converged)


estimate_jit = eqx.filter_jit(estimate)


def capacity(model: Model, chip: Chip, design: Design, policy: Policy, load: Load, *,
             hard: bool = True, vectorize: bool = True, rtol=1e-6):
    """The arrival rate at which the surrogate's load reaches 1 (1/s): the most requests
    per second the engine sustains under `policy` with `load`'s lengths and burstiness
    (`load.rate` is not read). Bisection on log rate (`optimistix.Bisection`), compiled.

    Raises:
        ValueError: as `estimate`.
    """
    _validate(model, chip, design, policy, load)
    return _capacity(model, chip, design, policy, load, hard, vectorize, rtol)


@eqx.filter_jit
def _capacity(model, chip, design, policy, load, hard, vectorize, rtol):
    def excess(log_rate, _):
        at = eqx.tree_at(lambda x: x.rate, load, jnp.exp(log_rate))
        e = estimate(model, chip, design, policy, at, hard=hard, vectorize=vectorize)
        return jnp.log(jnp.maximum(jnp.maximum(e.seat_load, e.token_load), 1e-300))

    # Loads at 1e-6 and 1e6 requests/s bracket any engine's capacity.
    solver = optx.Bisection(rtol=0.0, atol=rtol, flip="detect", expand_if_necessary=False)
    sol = optx.root_find(excess, solver, jnp.zeros(()), options=dict(
        lower=jnp.log(1e-6), upper=jnp.log(1e6)), max_steps=256, throw=False)
    return jnp.exp(sol.value)
