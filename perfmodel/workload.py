"""Workload: the traffic a deployment serves (request lengths, optional arrival rate)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp

from .checks import FRACTION, NON_NEGATIVE, UNIT_INTERVAL, Range, as_number, check


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
    output_cv2: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Squared coefficient of variation of the output lengths, Var(O) / E[O]^2
    (dimensionless, >= 0) of a data set with a spread of its own (reasoning traces:
    DeepSeek-R1's MLPerf outputs, median 2,108 tokens, mean 3,886, p99 20,000). A request
    stays in the running batch for as long as it decodes, so the batch holds long ones
    more often than they arrive: its mean context is `decode_context`, E[I] + E[O^2] /
    (2 E[O]), not E[I] + E[O] / 2 (length-biased sampling, the inspection paradox;
    Kleinrock, Queueing Systems vol. 1, sec. 5.2). Default 0: the lengths' own spread, from
    the range ratios alone (under 0.6 % of the mean at a ratio of 0.8), is not counted."""

    cached_fraction: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Share of each prompt found in the prefix cache (dimensionless, in [0, 1)): tokens an
    earlier request of the same conversation or agent session left in the KV cache, which
    the engine reuses instead of computing them (vLLM's automatic prefix caching, SGLang's
    radix cache, TensorRT-LLM's KV-cache reuse). A request's prefill computes the rest,
    each computed token attending to the cached prefix and the computed tokens before it;
    its KV cache, its decode context and the input tokens counted in throughput are the
    whole prompt's. Multi-turn chat and agents resend the conversation so far on every turn
    (ML.ENERGY's LM Arena workload: every earlier turn of the conversation; the serving
    simulator's `Requests.cached_len` per request, `simulate.agent_sessions`). Default 0:
    nothing cached, as InferenceMAX's random prompts."""

    def __check_init__(self):
        check(self, {"input_len": Range(low=1.0), "output_len": Range(low=1.0, low_open=True),
                     "input_range_ratio": FRACTION, "output_range_ratio": FRACTION,
                     "first_wave_fraction": UNIT_INTERVAL,
                     "request_rate": Range(low=0.0, low_open=True, optional=True),
                     "output_cv2": NON_NEGATIVE,
                     "cached_fraction": Range(low=0.0, high=1.0, high_open=True)})

    @property
    def mean_input_len(self):
        return self.input_len * (1.0 + self.input_range_ratio) / 2.0

    @property
    def mean_output_len(self):
        return self.output_len * (1.0 + self.output_range_ratio) / 2.0

    @property
    def computed_input_len(self):
        """Mean prompt tokens a request's prefill computes (tokens): the mean prompt less its
        cached share (`cached_fraction`)."""
        return self.mean_input_len * (1.0 - self.cached_fraction)

    @property
    def prefill_context(self):
        """Mean context (tokens) a computed prompt token attends to: the cached prefix plus,
        causally, half of the computed rest.

        Example:
            >>> w = Workload(1000, 100, 1.0, 1.0, cached_fraction=0.75)
            >>> float(w.computed_input_len), float(w.prefill_context)
            (250.0, 875.0)
        """
        return self.mean_input_len * (1.0 + self.cached_fraction) / 2.0

    @property
    def decode_context(self):
        """Mean context (tokens) of the sequences a running batch decodes, which sizes their
        KV cache and attention: the mean prompt plus half the output, length-biased by
        `output_cv2`.

        Example:
            >>> w = Workload(800, 3886, 1.0, 1.0, output_cv2=1.42)
            >>> round(float(w.decode_context)), round(float(Workload(800, 3886, 1.0, 1.0)
            ...                                            .decode_context))
            (5502, 2743)
        """
        return self.mean_input_len + self.mean_output_len * (1.0 + self.output_cv2) / 2.0

    def closed_loop(self, input_len, output_len) -> Workload:
        """This workload's shape (length ranges, first wave, output spread, cached share) at
        other lengths (tokens), closed-loop (no `request_rate`): one point of a sweep.

        Example:
            >>> w = Workload(800, 3886, 1.0, 1.0, output_cv2=1.42, request_rate=2.0)
            >>> p = w.closed_loop(1024, 256)
            >>> float(p.output_cv2), p.request_rate, float(p.input_len)
            (1.42, None, 1024.0)
        """
        return Workload(input_len, output_len, input_range_ratio=self.input_range_ratio,
                        output_range_ratio=self.output_range_ratio,
                        first_wave_fraction=self.first_wave_fraction,
                        output_cv2=self.output_cv2, cached_fraction=self.cached_fraction)
