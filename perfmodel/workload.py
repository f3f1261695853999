"""Workload: the traffic a deployment serves (request lengths, optional arrival rate)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp

from .checks import FRACTION, UNIT_INTERVAL, Range, as_number, check


class Workload(eqx.Module):
    """Request shape. Lengths are drawn uniformly in `[ratio * len, len]`, as InferenceMAX's
    random data set does with `RANDOM_RANGE_RATIO = 0.8` (SemiAnalysisAI/InferenceX,
    .github/workflows/benchmark-tmpl.yml); set the ratios to 1 for fixed lengths.

    Closed loop (InferenceMAX, MLPerf Offline-like): the design's concurrency is the number of
    clients, each sending its next request when the last one finishes. With `request_rate`
    (requests/s for the whole deployment) the load is open-loop (Poisson, MLPerf Server) and
    the in-flight count follows from Little's law.

    Example:
        >>> w = Workload(input_len=8192, output_len=1024)
        >>> round(float(w.mean_input_len), 1)
        7372.8
    """

    input_len: jnp.ndarray = eqx.field(converter=as_number)
    """Maximum (nominal) input length, ISL (tokens)."""
    output_len: jnp.ndarray = eqx.field(converter=as_number)
    """Maximum (nominal) output length, OSL (tokens)."""
    input_range_ratio: jnp.ndarray = eqx.field(converter=as_number, default=0.8)
    """Shortest input as a fraction of ISL (dimensionless, (0, 1])."""
    output_range_ratio: jnp.ndarray = eqx.field(converter=as_number, default=0.8)
    """Shortest output as a fraction of OSL (dimensionless, (0, 1])."""
    first_wave_fraction: jnp.ndarray = eqx.field(converter=as_number, default=0.1)
    """Share of requests sent in the opening burst, when every client starts at once
    (InferenceMAX: 10 prompts per client, so 0.1); 0 for a warmed-up or Poisson load. It
    shapes p99 TTFT only."""
    request_rate: jnp.ndarray | None = eqx.field(
        default=None, converter=as_number)
    """Open-loop arrival rate (requests/s); None for a closed loop."""

    def __check_init__(self):
        check(self, {"input_len": Range(low=1.0), "output_len": Range(low=1.0, low_open=True),
                     "input_range_ratio": FRACTION, "output_range_ratio": FRACTION,
                     "first_wave_fraction": UNIT_INTERVAL,
                     "request_rate": Range(low=0.0, low_open=True, optional=True)})

    @property
    def mean_input_len(self):
        return self.input_len * (1.0 + self.input_range_ratio) / 2.0

    @property
    def mean_output_len(self):
        return self.output_len * (1.0 + self.output_range_ratio) / 2.0
