"""Disaggregated serving under load: a prefill pool and a decode pool, each its own engine
instances with its own policy, the KV cache moved between them (`simulate_disaggregated`).

A request is prefilled in the prefill pool (`Disaggregated.prefill`, its replicas behind a
round-robin router) as a one-token request: its first token is sampled there. Its KV then
moves to a decode instance in `serving.kv_transfer_time` (the core interconnect model, as
`serving.predict` prices it), each transfer on its own (links are not shared between
transfers). It arrives in the decode pool (`Disaggregated.decode`) when the transfer ends,
holding its prompt and first token as a prefix already in KV (`Requests.cached_len`): the
decode engine admits it when its blocks fit and computes the first token's KV in its first
step (costed as a one-token chunk), then decodes the rest. The first token counts as
emitted when its KV has landed (vLLM's disaggregated proxy returns it from the decode
instance), so TTFT is the prefill pool's TTFT plus the transfer; the rest is the decode
pool's, its queueing included.

Approximations: the pools run one after the other on the same arrivals (the prefill pool
never waits for decode capacity: no back-pressure from a full decode pool), and prefill
instances free a request's KV when its transfer starts.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp

from ..architecture import Model
from ..checks import arguments
from ..design import Design, Disaggregated
from ..hardware import Chip
from ..serving import kv_transfer_time
from .arrivals import Requests
from .engines import Policy
from .entry import simulate
from .results import Result


def _check(model, chip, design, prefill_policy, decode_policy, requests):
    arguments(model=(model, Model), chip=(chip, Chip), design=(design, Design),
              prefill_policy=(prefill_policy, Policy), decode_policy=(decode_policy, Policy),
              requests=(requests, Requests))
    if not isinstance(design.layout, Disaggregated):
        raise ValueError(f"design.layout must be a Disaggregated layout (prefill and decode "
                         f"pools), got {type(design.layout).__name__}; simulate an aggregated "
                         "one with `simulate`")
    if not design.layout.static:
        raise ValueError("design.layout: the simulator runs static pools (Layout), got "
                         "LayoutNumbers; pass the Disaggregated of Layouts the numbers came "
                         "from")
    if requests.clients:
        raise ValueError("requests: a closed loop is not simulated across disaggregated pools "
                         "(requests.clients must be 0)")
    if not decode_policy.prefix_caching:
        raise ValueError("decode_policy.prefix_caching must be True: the decode pool holds "
                         "each request's transferred KV as a cached prefix")


@eqx.filter_jit
def simulate_disaggregated(model: Model, chip: Chip, design: Design, prefill_policy: Policy,
                           decode_policy: Policy, requests: Requests, *,
                           max_steps: int = 100_000, hard: bool = True,
                           vectorize: bool = True, window: int | str | None = None) -> Result:
    """Simulate `requests` served by the prefill and decode pools of
    `design.layout` (`Disaggregated`), under their own policies.

    Args:
        model, chip: as in `simulate`.
        design: its layout a `Disaggregated` one (each pool's replicas behind a round-robin
            router); precisions and runtime shared by both pools.
        prefill_policy, decode_policy: each pool's scheduler settings (the decode pool's
            with `prefix_caching`, which holds the transferred KV).
        requests: open-loop arrivals and lengths.
        max_steps, hard, vectorize, window: static; as in `simulate`, for each pool.

    Returns:
        `Result` of the whole service: per-request times (first token when its KV has
        reached the decode pool), busy time and dynamic energy per chip averaged over both
        pools' chips, `chips` of both pools, `steps` of both.

    Raises:
        ValueError: a layout that is not `Disaggregated`, a closed loop, a decode policy
            without prefix caching, and what `simulate` refuses of either pool.
    """
    _check(model, chip, design, prefill_policy, decode_policy, requests)
    layout = design.layout
    kw = dict(max_steps=max_steps, hard=hard, vectorize=vectorize, window=window)
    n = requests.size
    inputs, outputs, valid = requests.input_len, requests.output_len, requests.valid
    # Prefill pool: each request a one-token one (its first token is sampled there).
    pre = simulate(model, chip, eqx.tree_at(lambda d: d.layout, design, layout.prefill),
                   prefill_policy, Requests(arrival=requests.arrival, input_len=inputs,
                                            output_len=jnp.ones(n), valid=valid,
                                            cached_len=requests.cached_len), **kw)
    transfer = kv_transfer_time(model, chip, design, layout, inputs)
    ready = pre.first_token + transfer
    # Decode pool: requests with more than one token arrive when their KV lands, in order
    # of arrival there (a window reads requests in index order).
    decoding = valid & (outputs > 1.0) & jnp.isfinite(ready)
    order = jnp.argsort(jnp.where(decoding, ready, jnp.inf), stable=True)
    back = jnp.argsort(order, stable=True)
    dec = simulate(model, chip, eqx.tree_at(lambda d: d.layout, design, layout.decode),
                   decode_policy, Requests(
                       arrival=jnp.where(decoding, ready, 0.0)[order],
                       input_len=(inputs + 1.0)[order],
                       output_len=jnp.maximum(outputs - 1.0, 1.0)[order],
                       valid=decoding[order], cached_len=inputs[order]), **kw)
    first_token = jnp.where(jnp.isfinite(pre.first_token), ready, jnp.inf)
    finish = jnp.where(outputs > 1.0, dec.finish[back], first_token)
    end = jnp.maximum(pre.end_time, dec.end_time)
    pre_chips, dec_chips = layout.prefill.chips, layout.decode.chips
    chips = pre_chips + dec_chips

    def per_chip(a, b):
        return (pre_chips * a + dec_chips * b) / chips

    # In the system while its KV moves, too.
    moving = jnp.sum(jnp.where(valid & jnp.isfinite(pre.first_token),
                               jnp.minimum(ready, end) - jnp.minimum(pre.first_token, end),
                               0.0))
    return Result(arrival=requests.arrival, scheduled=pre.scheduled, first_token=first_token,
                  finish=finish, input_len=inputs, output_len=outputs, valid=valid,
                  finished=valid & jnp.isfinite(finish),
                  preemptions=pre.preemptions + jnp.where(decoding, dec.preemptions[back], 0.0),
                  end_time=end, busy_time=per_chip(pre.busy_time, dec.busy_time),
                  dynamic_energy=per_chip(pre.dynamic_energy, dec.dynamic_energy),
                  in_system_area=pre.in_system_area + dec.in_system_area + moving,
                  steps=pre.steps + dec.steps, idle_power=chip.idle_power,
                  chips=jnp.asarray(chips, dtype=float),
                  window_overflow=pre.window_overflow | dec.window_overflow,
                  mixed_steps=pre.mixed_steps + dec.mixed_steps)
