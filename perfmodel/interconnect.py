"""Collective communication costs: latency + bytes / bandwidth (alpha-beta) terms.

An interconnect tier (`Switch`, `Ring`, `Torus`) knows how long one collective takes among
`n` chips inside it. `collective_time` composes a scale-up tier and a slower scale-out tier
when the group is larger than the scale-up domain (hierarchical: reduce-scatter inside each
domain, the reduced shards across domains, all-gather inside again).

Formulas (ring algorithms, as NCCL uses for large messages; Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005):
- all-reduce of M bytes per chip: 2 (n-1)/n * M / B + 2 (n-1) alpha
- all-gather / reduce-scatter with M bytes of output / input per chip: (n-1)/n * M / B + (n-1) alpha
- all-to-all with M bytes sent per chip: (n-1)/n * M / B + (n-1) alpha
- point-to-point of M bytes: M / B + alpha
where B is the achieved per-chip unidirectional bandwidth (link bandwidth x efficiency), and
every collective also pays a fixed `base_latency` (launch and synchronisation: nccl-tests
show about 8-10 us for the smallest all-gather on two B200s, shared/data NCCL table).

All-reduce on a `Switch` is priced by the minimum over the algorithms the fabric offers
(`Switch.algorithms`, `ALL_REDUCE_ALGORITHMS`), as libraries pick one by message and group
size (NCCL's cost model, NVIDIA/nccl src/graph/tuning.cc, takes the cheapest algorithm and
protocol per call):
- "ring": the formula above.
- "tree": recursive halving reduce-scatter and recursive doubling all-gather (Rabenseifner;
  Thakur et al. 2005), 2 ceil(log2 n) alpha + 2 (n-1)/n * M / B, on a full-bisection switch.
  Not offered on NVLink: NCCL's tree is a chain inside a node (tuning.cc prices its
  intra-node latency by nRanks/nNodes - 1 hops, its log2 only across nodes).
- "one_shot": every chip reads the n-1 peers' buffers and reduces locally, alpha + (n-1) *
  M / B (TensorRT-LLM's and vLLM's custom all-reduce for small messages, on up to
  `Switch.direct_max_group` chips: 8 in both libraries' NVLink kernels).
- "nvls": the switch reduces (NVLink SHARP, NCCL's NVLS algorithm since NCCL 2.17): a
  multimem load-reduce and a multicast store, 2 alpha + M / B.
The minimum is `perfmodel.smooth.smooth_min` (differentiable; at most n^(1/p) below the
exact minimum where algorithms tie) or, with `Switch.hard`, the exact minimum. Other
collectives and other topologies keep the ring formulas.

Which algorithms a chip's fabric offers is its `scaleup_algorithms` in `data/chips.csv`.
GPU fabrics keep the ring only: their per-step and base latencies are fitted (calibration/
fit.py) to NCCL measurements and InferenceMAX rows priced with the ring, which absorbs the
libraries' own choice; offering one-shot and NVLS on NVLink without refitting moved the
held-out InferenceMAX medians from 6.5 % to 10.3 % (throughput) and 7.7 % to 8.1 % (TPOT)
(`python calibration/validate.py --no-refit --skip-loco`). A refit with one-shot up to 8
chips on every NVLink and xGMI fabric for the engines' rows (the nccl-tests points still
priced by the ring NCCL runs, whose small-message latency grows with the group: 10, 15 and
25 us at 2, 4 and 8 B200s in `benchmarks_nccl_collectives.csv`) fitted its own rows better
and the held-out and leave-one-chip-out rows worse (2026-12-05; the figures are in that
session's note): not kept. Jalapeno offers ring, tree and one-shot across its 128-chip
domain (its assumptions in chips.csv).
"""

from __future__ import annotations

import abc
import functools
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .checks import FRACTION, NON_NEGATIVE, POSITIVE, as_number, check
from .smooth import smooth_min
from .static import branch, ceil, concrete, is_static, maximum

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")

#: All-reduce algorithms a `Switch` may offer (see the module docstring).
ALL_REDUCE_ALGORITHMS = ("ring", "tree", "one_shot", "nvls")


def _array(x):
    return jnp.asarray(x, dtype=float)


class AbstractInterconnect(eqx.Module):
    """A tier of the network among chips: bandwidth per chip, latency per step, efficiency.

    Subclasses say how a collective maps onto the topology (`_steps_and_bandwidth`).
    """

    bandwidth: eqx.AbstractVar[jnp.ndarray]
    latency: eqx.AbstractVar[jnp.ndarray]
    efficiency: eqx.AbstractVar[jnp.ndarray]
    base_latency: eqx.AbstractVar[jnp.ndarray]

    def __check_init__(self):   # equinox runs it for every subclass, beside theirs
        check(self, {"bandwidth": POSITIVE, "latency": NON_NEGATIVE, "efficiency": FRACTION,
                     "base_latency": NON_NEGATIVE})

    @abc.abstractmethod
    def _effective(self, kind: str, n):
        """(latency steps, bandwidth multiplier, traffic multiplier) of a collective over n
        chips (a static int >= 2, or an array of them)."""

    def time(self, kind: str, message_bytes, n):
        """Seconds for one collective among `n` chips of this tier.

        Args:
            kind: one of `COLLECTIVES`.
            message_bytes: bytes (see the module docstring for what M is per collective).
            n: group size (chips), a static positive integer or an array of them (possibly
                traced); 1 means no communication (time 0).

        Example:
            >>> link = Switch(bandwidth=450e9, latency=5e-6, efficiency=1.0)
            >>> round(float(link.time("all_reduce", 8e6, 8)) * 1e6, 3)  # 2*7/8*8e6/450e9 + 14*5us
            101.111
        """
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; valid: {', '.join(COLLECTIVES)}")
        if not is_static(n):
            return self._time_numbers(kind, message_bytes, _array(n))
        if n < 1 or int(n) != n:
            raise ValueError(f"collective group size must be a positive integer, got {n!r}")
        if n == 1 and kind != "p2p":
            return jnp.zeros_like(_array(message_bytes))
        return self._cost(kind, message_bytes, int(n))

    def _cost(self, kind, message_bytes, n):
        """Seconds of one collective among n >= 2 chips (static or an array)."""
        steps, bw_mult, traffic = self._effective(kind, n)
        return self._time(steps, bw_mult, traffic, message_bytes)

    def _time(self, steps, bw_mult, traffic, message_bytes):
        # Seconds per byte apart from the message: inside a gradient loop it depends on the
        # chip and the layout only, so XLA hoists it out, and each step multiplies instead
        # of dividing (a division per collective was a small kernel of its own per step).
        # The reciprocal alone, then the traffic factor: collectives of one fabric share it
        # (one division where each collective's factor made its own).
        per_byte = traffic * (1.0 / (self.bandwidth * self.efficiency * bw_mult))
        return self.base_latency + steps * self.latency + _array(message_bytes) * per_byte

    def _time_numbers(self, kind, message_bytes, n):
        # The formulas run on n >= 2 (a group of one moves nothing and its terms, e.g. a
        # torus spanning no axis, divide by zero); groups of one then select 0.
        time = self._cost(kind, message_bytes, jnp.maximum(n, 2.0))
        sizes = concrete(n)
        if kind == "p2p" or (sizes is not None and not np.any(sizes == 1)):
            return time
        return jnp.where(n == 1, 0.0, time)


def _ring_traffic(kind: str, n):
    if kind == "p2p":
        return 1.0, 1.0
    frac = (n - 1) / n
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * frac
    return 1.0 * (n - 1), frac


class Switch(AbstractInterconnect):
    """A switched fabric (NVLink Switch, Ethernet): every chip reaches every other at its full
    per-chip bandwidth. `bandwidth` is bytes/s per chip per direction.

    Example (a low-latency switch: a one-step all-reduce beats the ring's 2 (n-1) steps on
    small messages; 64 chips, 16 kB):
        >>> ring = Switch(bandwidth=800e9, latency=2e-6, efficiency=1.0)
        >>> fast = Switch(bandwidth=800e9, latency=2e-6, efficiency=1.0,
        ...               algorithms=("ring", "tree", "one_shot"), direct_max_group=128,
        ...               hard=True)
        >>> round(float(ring.time("all_reduce", 16e3, 64)) * 1e6, 1)
        252.0
        >>> round(float(fast.time("all_reduce", 16e3, 64)) * 1e6, 1)
        3.3
    """

    bandwidth: jnp.ndarray = eqx.field(converter=as_number)
    latency: jnp.ndarray = eqx.field(converter=as_number)
    efficiency: jnp.ndarray = eqx.field(converter=as_number, default=0.8)
    base_latency: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    algorithms: tuple[str, ...] = eqx.field(static=True, default=("ring",))
    """All-reduce algorithms the fabric and its library offer (`ALL_REDUCE_ALGORITHMS`)."""
    direct_max_group: int = eqx.field(static=True, default=8)
    """Largest group (chips) of the one-shot all-reduce."""
    hard: bool = eqx.field(static=True, default=False)
    """Price an all-reduce by the exact minimum over `algorithms` (else the smooth one)."""

    def __check_init__(self):
        algorithms = self.algorithms
        if not (isinstance(algorithms, tuple) and "ring" in algorithms
                and all(a in ALL_REDUCE_ALGORITHMS for a in algorithms)):
            raise ValueError(f"Switch.algorithms must be a tuple of {ALL_REDUCE_ALGORITHMS} "
                             f"including 'ring', got {algorithms!r}")
        if not (isinstance(self.direct_max_group, int) and self.direct_max_group >= 2):
            raise ValueError("Switch.direct_max_group must be an integer >= 2, got "
                             f"{self.direct_max_group!r}")

    def _effective(self, kind, n):
        steps, traffic = _ring_traffic(kind, n)
        return steps, 1.0, traffic

    def _cost(self, kind, message_bytes, n):
        ring = super()._cost(kind, message_bytes, n)
        if kind != "all_reduce" or self.algorithms == ("ring",):
            return ring
        times = [ring]
        frac = 2.0 * (n - 1) / n
        if "tree" in self.algorithms:
            log_n = math.ceil(math.log2(n)) if is_static(n) else jnp.ceil(jnp.log2(n))
            times.append(self._time(2.0 * log_n, 1.0, frac, message_bytes))
        if "one_shot" in self.algorithms:
            direct = self._time(1.0, 1.0, n - 1.0, message_bytes)
            if is_static(n):
                if n <= self.direct_max_group:
                    times.append(direct)
            else:
                times.append(jnp.where(n <= self.direct_max_group, direct, jnp.inf))
        if "nvls" in self.algorithms:
            times.append(self._time(2.0, 1.0, 1.0, message_bytes))
        return smooth_min(*jnp.broadcast_arrays(*times), hard=self.hard)


class Ring(AbstractInterconnect):
    """A bidirectional ring of direct links (each chip has two neighbours). `bandwidth` is
    bytes/s per chip per direction summed over its links. All-to-all crosses n/4 hops on
    average, which costs a factor n/4 in traffic per link (at least 1)."""

    bandwidth: jnp.ndarray = eqx.field(converter=as_number)
    latency: jnp.ndarray = eqx.field(converter=as_number)
    efficiency: jnp.ndarray = eqx.field(converter=as_number, default=0.8)
    base_latency: jnp.ndarray = eqx.field(converter=as_number, default=0.0)

    def _effective(self, kind, n):
        steps, traffic = _ring_traffic(kind, n)
        if kind == "all_to_all":
            traffic *= maximum(1.0, n / 4.0)
        return steps, 1.0, traffic


class Torus(AbstractInterconnect):
    """A k-dimensional torus with wraparound (TPU ICI). `bandwidth` is bytes/s per chip per
    direction summed over all its links; `dims` the torus shape.

    A group of n chips fills the axes in order; a collective runs bidirectional rings on each
    axis it spans concurrently, so it uses the links of those axes only (the scaling book,
    "How to Scale Your Model", part on TPU networking). Latency steps add over the axes.
    """

    bandwidth: jnp.ndarray = eqx.field(converter=as_number)
    latency: jnp.ndarray = eqx.field(converter=as_number)
    efficiency: jnp.ndarray = eqx.field(converter=as_number, default=0.8)
    base_latency: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    dims: tuple[int, ...] = eqx.field(static=True, default=(16, 16))

    def __check_init__(self):
        dims = self.dims
        if not (isinstance(dims, tuple) and dims and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims)):
            raise ValueError(f"Torus.dims must be a tuple of positive integers, got {dims!r}")

    def _spanned(self, n):
        """(sizes, axes): sizes of the axes a group of n chips spans, filling them in order,
        and how many. With an array n, one size per axis (1 where the group does not reach
        it) and `axes` an array."""
        if is_static(n):
            sizes, left = [], n
            for d in self.dims:
                if left <= 1:
                    break
                take = min(d, left)
                sizes.append(take)
                left = math.ceil(left / take)
            return sizes, len(sizes)
        sizes, axes, left = [], 0.0, n
        for d in self.dims:
            reach = left > 1
            take = jnp.where(reach, jnp.minimum(d, left), 1.0)
            sizes.append(take)
            axes = axes + reach
            left = jnp.where(reach, jnp.ceil(left / take), left)
        return sizes, axes

    def _effective(self, kind, n):
        sizes, axes = self._spanned(n)
        axes_fraction = axes / len(self.dims)
        steps = sum(s - 1 for s in sizes) * (2.0 if kind == "all_reduce" else 1.0)
        _, traffic = _ring_traffic(kind, n)
        if kind == "all_to_all":
            largest = max(sizes) if is_static(n) else functools.reduce(jnp.maximum, sizes)
            traffic *= maximum(1.0, largest / 4.0)
        if kind == "p2p":
            steps = 1.0
        return maximum(steps, 1.0), axes_fraction, traffic


def collective_time(kind: str, message_bytes, n, scale_up: AbstractInterconnect,
                    scale_out: AbstractInterconnect, domain_size: int):
    """Seconds for a collective among `n` chips, hierarchical past the scale-up domain.

    Args:
        kind: one of `COLLECTIVES`.
        message_bytes: bytes per chip (the M of the module docstring).
        n: group size (chips): a static positive integer, or an array of them (possibly
            traced: both tiers' times are computed and the group size selects).
        scale_up: the fast tier (NVLink, ICI, Infinity Fabric).
        scale_out: the slower tier between domains (InfiniBand/Ethernet NICs).
        domain_size: static number of chips one scale-up tier spans.

    Returns:
        Seconds, the shape of `message_bytes` (broadcast with `n`).

    Example:
        >>> up = Switch(bandwidth=900e9, latency=3e-6, efficiency=1.0)
        >>> out = Switch(bandwidth=50e9, latency=10e-6, efficiency=1.0)
        >>> t_in = collective_time("all_reduce", 1e9, 8, up, out, 8)
        >>> t_out = collective_time("all_reduce", 1e9, 16, up, out, 8)
        >>> bool(t_out > t_in)
        True
        >>> bool(jnp.allclose(collective_time("all_reduce", 1e9, jnp.asarray([8.0, 16.0]),
        ...                                   up, out, 8), jnp.stack([t_in, t_out])))
        True
    """
    domain_size = max(int(domain_size), 1)
    if not is_static(n):
        n = _array(n)
        # Where every group is known while tracing to fit in the domain, or none to
        # (an eager evaluation of many layouts), `branch` prices one tier only; the
        # group past the domain is evaluated on n >= domain + 1 (masked where n fits in
        # it): the all-to-all share below divides by n - 1.
        return branch(
            n <= domain_size,
            lambda: scale_up.time(kind, message_bytes, jnp.minimum(n, domain_size)),
            lambda: _hierarchical(kind, message_bytes, jnp.maximum(n, domain_size + 1.0),
                                  scale_up, scale_out, domain_size))
    n = int(n)
    if n <= domain_size:
        return scale_up.time(kind, message_bytes, n)
    return _hierarchical(kind, message_bytes, n, scale_up, scale_out, domain_size)


def _hierarchical(kind, message_bytes, n, scale_up, scale_out, domain_size):
    inner = domain_size
    outer = ceil(n / domain_size)
    message_bytes = _array(message_bytes)
    if kind == "all_reduce":
        return (scale_up.time("reduce_scatter", message_bytes, inner)
                + scale_out.time("all_reduce", message_bytes / inner, outer)
                + scale_up.time("all_gather", message_bytes, inner))
    if kind in ("all_gather", "reduce_scatter"):
        return (scale_up.time(kind, message_bytes / outer, inner)
                + scale_out.time(kind, message_bytes, outer))
    if kind == "all_to_all":
        # Of the bytes each chip sends, the share bound outside its domain crosses scale-out.
        cross = (n - inner) / (n - 1)
        return (scale_up.time(kind, message_bytes * (1 - cross), inner)
                + scale_out.time(kind, message_bytes * cross, outer))
    return scale_out.time("p2p", message_bytes, 2)
