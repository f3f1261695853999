"""Requests offered to the engine (`Requests`: fixed-size arrays, open or closed loop) and
their builders: Poisson and gamma arrivals, a closed loop of clients, a trace."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..checks import NON_NEGATIVE, Range, as_number, check


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
