"""Data-parallel engine instances behind a round-robin router (`_replicated`)."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from .arrivals import Requests
from .results import Result
from .scheduler import _instance


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

