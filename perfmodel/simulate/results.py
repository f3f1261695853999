"""What a simulation reports: per-request outcomes and engine totals (`Result`), and their
summaries (`summarize`: latency means and percentiles, throughput, goodput under SLOs,
utilization, power)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp

from ..power import average_power


class Result(eqx.Module):
    """Per-request outcomes (shape (..., N)) and engine totals of one simulation."""

    arrival: jnp.ndarray
    """Arrival time (s; inf if never sent)."""
    scheduled: jnp.ndarray
    """First time scheduled (s; inf if never)."""
    first_token: jnp.ndarray
    """Time of the first output token (s; inf if none)."""
    finish: jnp.ndarray
    """Time of the last output token (s; inf if unfinished)."""
    input_len: jnp.ndarray
    output_len: jnp.ndarray
    valid: jnp.ndarray
    finished: jnp.ndarray
    """True when every output token was emitted."""
    preemptions: jnp.ndarray
    """Times each request was preempted."""
    end_time: jnp.ndarray
    """Clock when the simulation stopped (s)."""
    busy_time: jnp.ndarray
    """Time spent in engine steps (s)."""
    dynamic_energy: jnp.ndarray
    """Energy above idle per chip over all steps (J)."""
    in_system_area: jnp.ndarray
    """Integral over time of requests arrived and unfinished (request s), from the steps'
    own clock: Little's law checks it against the per-request records."""
    steps: jnp.ndarray
    """Engine steps run."""
    idle_power: jnp.ndarray
    """The chip's idle power (W)."""
    chips: jnp.ndarray
    """Chips of all instances."""
    window_overflow: jnp.ndarray
    """True when a `window` may have hidden a request the engine would have admitted."""
    mixed_steps: jnp.ndarray
    """Steps that carried both prefill tokens and decodes."""

    @property
    def queue_delay(self):
        """Arrival to first scheduled (s)."""
        return self.scheduled - self.arrival

    @property
    def ttft(self):
        """Arrival to first token (s)."""
        return self.first_token - self.arrival

    @property
    def tpot(self):
        """Mean time per output token after the first (s; NaN for one-token outputs)."""
        return jnp.where(self.output_len > 1, (self.finish - self.first_token)
                         / jnp.maximum(self.output_len - 1.0, 1.0), jnp.nan)

    @property
    def e2e(self):
        """Arrival to last token (s)."""
        return self.finish - self.arrival

    @property
    def arrived(self):
        return self.valid & (self.arrival <= self.end_time)


class Stats(eqx.Module):
    """Mean and percentiles of one latency over finished requests (s)."""

    mean: jnp.ndarray
    p50: jnp.ndarray
    p90: jnp.ndarray
    p95: jnp.ndarray
    p99: jnp.ndarray


class Summary(eqx.Module):
    """What a simulation says about the service."""

    ttft: Stats
    tpot: Stats
    e2e: Stats
    queue_delay: Stats
    requests: jnp.ndarray
    """Requests arrived."""
    finished: jnp.ndarray
    unfinished: jnp.ndarray
    """Arrived requests not finished when the simulation stopped."""
    preemptions: jnp.ndarray
    duration: jnp.ndarray
    """First arrival to end of the simulation (s)."""
    throughput: jnp.ndarray
    """Finished requests per second (1/s)."""
    goodput: jnp.ndarray
    """Finished requests per second meeting both SLOs (1/s)."""
    goodput_per_chip: jnp.ndarray
    utilization: jnp.ndarray
    """Fraction of the duration spent in engine steps."""
    power: jnp.ndarray
    """Average power per chip, idle gaps included (W)."""
    mean_in_system: jnp.ndarray
    """Time-average of requests arrived and unfinished, from the step clock."""


def _stats(x, mask):
    x = jnp.where(mask & jnp.isfinite(x), x, jnp.nan)
    q = jnp.nanpercentile(x, jnp.asarray([50.0, 90.0, 95.0, 99.0]), axis=-1)
    return Stats(mean=jnp.nanmean(x, axis=-1), p50=q[0], p90=q[1], p95=q[2], p99=q[3])


def summarize(result: Result, max_ttft=jnp.inf, max_tpot=jnp.inf) -> Summary:
    """Summaries of one simulation (vmap it over a batch of results).

    Args:
        result: from `simulate`.
        max_ttft, max_tpot: SLOs of goodput (s); inf: none.
    """
    done = result.finished
    arrived = result.arrived
    start = jnp.min(jnp.where(arrived, result.arrival, jnp.inf), axis=-1)
    duration = jnp.maximum(result.end_time - start, 1e-12)
    tpot_ok = jnp.where(result.output_len > 1, result.tpot <= max_tpot, True)
    good = done & (result.ttft <= max_ttft) & tpot_ok
    goodput = jnp.sum(good, axis=-1) / duration
    return Summary(
        ttft=_stats(result.ttft, done), tpot=_stats(result.tpot, done),
        e2e=_stats(result.e2e, done), queue_delay=_stats(result.queue_delay, done),
        requests=jnp.sum(arrived, axis=-1), finished=jnp.sum(done, axis=-1),
        unfinished=jnp.sum(arrived & ~done, axis=-1),
        preemptions=jnp.sum(result.preemptions, axis=-1), duration=duration,
        throughput=jnp.sum(done, axis=-1) / duration, goodput=goodput,
        goodput_per_chip=goodput / result.chips, utilization=result.busy_time / duration,
        power=average_power(result.idle_power, result.dynamic_energy, duration),
        mean_in_system=result.in_system_area / duration)
