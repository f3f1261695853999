"""Chip specs: peak compute per format, memory, slices, network tiers, power, efficiencies.

A `Chip` is an immutable pytree: every number is an array leaf (so `jax.grad` and the
calibration reach it), names and the supported formats are static. Datasheet units are
converted once, in `from_datasheet`.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .checks import FRACTION, NON_NEGATIVE, POSITIVE, Range, as_number, check
from .formats import COMPUTE_CLASSES
from .interconnect import AbstractInterconnect, Ring, Switch, Torus


def _array(x):
    return jnp.asarray(x, dtype=float)


#: The least fraction of peak FLOP/s an operator is charged at (dimensionless): a matmul of
#: no rows costs at most 1e6 times its FLOPs at peak, never a division by zero.
FRACTION_FLOOR = 1e-6


class Efficiency(eqx.Module):
    """How much of the peak a real kernel reaches, as smooth functions of its shape.

    Compute: a matmul with M rows (tokens) reaches
    `compute_max * M / (M + compute_rows_half)` of peak FLOP/s: small-M matmuls (decode at low
    batch, a few tokens per expert) waste the tensor-core tiles. The peak of a format
    narrower than BF16 is first bounded by `format_ceiling` (`class_peaks`).
    Memory: a kernel moving `b` bytes takes `b / (bandwidth * bandwidth_max) + memory_latency`.
    Every kernel also pays `kernel_overhead` (launch, ramp-up and tail), and every engine step
    pays `step_overhead` (scheduling, sampling, host sync) in `perfmodel.design.Runtime`.

    Priors (before calibration): NVIDIA's aiconfigurator system files apply 0.8 x HBM
    bandwidth and a 3 us constant memory latency (ai-dynamo/aiconfigurator,
    systems/*.yaml, `mem_bw_empirical_scaling_factor`, `mem_empirical_constant_latency`).
    """

    compute_max: jnp.ndarray = eqx.field(converter=as_number, default=0.75)
    """Fraction of peak FLOP/s a large matmul reaches (dimensionless, (0, 1]); of BF16's
    peak exactly, of narrower formats' peaks under `format_ceiling`."""
    compute_rows_half: jnp.ndarray = eqx.field(converter=as_number, default=64.0)
    """Rows (tokens) at which a matmul reaches half of `compute_max` (tokens)."""
    bandwidth_max: jnp.ndarray = eqx.field(converter=as_number, default=0.8)
    """Fraction of HBM bandwidth a large streaming read reaches (dimensionless, (0, 1])."""
    memory_latency: jnp.ndarray = eqx.field(converter=as_number, default=3e-6)
    """Fixed latency of a memory-bound kernel (s)."""
    kernel_overhead: jnp.ndarray = eqx.field(converter=as_number, default=2e-6)
    """Launch, ramp and tail time per kernel (s)."""
    attention_max: jnp.ndarray = eqx.field(converter=as_number, default=0.5)
    """Fraction of peak FLOP/s the decode attention kernels of MLA and windowed models
    reach (DeepSeek-V3/R1 and Kimi: the absorbed MLA kernel over the latent cache; gpt-oss's
    sliding windows with sinks), MTP verification included: fitted on InferenceMAX's
    DeepSeek-R1 and gpt-oss rows, which hardly constrain it, so it sits near its prior,
    0.3, from MLA decode-kernel microbenchmarks (`calibration.params.FAMILY_FIELDS` gives
    them: 0.26 on B200, 0.39 on Hopper, of the BF16 peak), not FlashMLA's best case (660 of
    H800's 989 TFLOP/s). The default here, for chips built without a fit, is 0.5
    (dimensionless, (0, 1])."""
    prefill_attention_max: jnp.ndarray = eqx.field(converter=as_number, default=0.5)
    """Fraction of peak FLOP/s the prompt (prefill) attention of the same models reaches:
    a different kernel from decode's (MLA prefill runs non-absorbed multi-head attention
    over the prompt, FlashAttention-style), so a separate fitted term (dimensionless,
    (0, 1]). The fit puts it below `attention_max` (0.06-0.23 against 0.09-0.38,
    `perfmodel/data/fitted_params.json`): the rows' time to first token grows faster with
    the prompt than these FLOPs at FlashAttention's rate explain, and the fit charges the
    difference here, the one prompt-quadratic term it has. Fitted files without it
    (before 2026-12-04) priced prompt attention at `attention_max`, and `perfmodel.fitted`
    reads them that way."""
    window_prefill_attention_max: jnp.ndarray = eqx.field(converter=as_number, default=0.5)
    """Fraction of peak FLOP/s the prompt attention of windowed GQA models reaches
    (gpt-oss: sliding windows with attention sinks, half the layers full): another kernel
    from MLA's prompt attention (each engine's FlashAttention or Triton variant with sinks,
    not the non-absorbed MLA prefill), so a separate fitted term (dimensionless, (0, 1]):
    0.05 on Hopper (the 134 gpt-oss H200 vLLM rows) against MLA's 0.13 there, 0.12 on
    Blackwell against 0.22 (`perfmodel/data/fitted_params.json`). Fitted files without it
    (before 2026-12-05) priced both at `prefill_attention_max`, and `perfmodel.fitted`
    reads them that way."""
    full_attention_max: jnp.ndarray = eqx.field(converter=as_number, default=0.5)
    """Fraction of peak FLOP/s the attention kernels of full (unwindowed) GQA/MHA models
    reach (Llama, Qwen, Mixtral: FlashAttention's kernels). Not fitted (no InferenceMAX row
    serves such a model), set from the papers: FlashAttention-2 reaches 50-73 % of A100's
    peak in the forward pass (Dao, 2023) and FlashAttention-3 75 % of H100's (Shah et al.,
    2024); serving runs variable-length, paged kernels over shorter sequences, so the lower
    end, 0.5. `attention_max`, fitted, does not transfer: at Hopper's 0.07 the TensorRT-LLM
    tables' Llama rows ran slower the longer their prompts (median 0.71x at 20,000/2,000
    tokens; `python calibration/trtllm_check.py --attention-max 0.0662`)
    (dimensionless, (0, 1])."""
    format_ceiling: jnp.ndarray = eqx.field(converter=as_number, default=4.0)
    """A ceiling on a tensor-core kernel's FLOP/s that does not grow with the number
    format, as a multiple of the chip's BF16 peak (dimensionless, > 0; inf: none). Narrow
    formats multiply the tensor cores' rate, not the rest of a kernel's pipeline (operand
    staging, scale factors, epilogues), so a class with k times BF16's peak runs at
    k (1 + c) / (k + c) times BF16's rate (`class_peaks`; BF16 keeps its peak, and
    `compute_max` stays the fraction of it a large BF16 matmul reaches). aiconfigurator's
    GEMM timings (`benchmarks_aic_gemm.csv`; medians of large GEMMs over their peak, printed
    by `python calibration/trtllm_check.py`) show the pattern: B200 BF16 68 %, FP8 52 %,
    NVFP4 34 %; B300, whose FP4 peak is 6.2x its BF16 one against B200's 4x, NVFP4 26 %;
    H200 BF16 77 %, FP8 58 % (`tests/test_roofline.py` checks the fitted ratios against
    these timings). Default 4 (the calibration's prior; it fits one per family)."""

    def __check_init__(self):
        check(self, {"compute_max": FRACTION, "compute_rows_half": POSITIVE,
                     "bandwidth_max": FRACTION, "memory_latency": NON_NEGATIVE,
                     "kernel_overhead": NON_NEGATIVE, "attention_max": FRACTION,
                     "prefill_attention_max": FRACTION, "full_attention_max": FRACTION,
                     "window_prefill_attention_max": FRACTION,
                     "format_ceiling": Range(low=0.0, low_open=True, infinite=True)})

    def class_peaks(self, peak_flops):
        """Each compute class's peak FLOP/s (`peak_flops`, (..., classes), BF16 first) as a
        kernel of that class sees it under `format_ceiling`, relative to BF16's (FLOP/s):
        P_c (1 + 1/c) / (1 + (P_c / P_bf16) / c), so BF16 keeps its peak (`compute_max` is
        the fraction of it a large BF16 matmul reaches) and a class k times as fast reaches
        k (1 + c) / (k + c) times BF16's rate."""
        bf16 = lax.index_in_dim(peak_flops, COMPUTE_CLASSES.index("bf16"), axis=-1)
        inverse = 1.0 / self.format_ceiling
        return peak_flops * (1.0 + inverse) / (1.0 + (peak_flops / bf16) * inverse)

    def inverse_class_peaks(self, peak_flops):
        """1 / `class_peaks` (s/FLOP), (P_bf16 + P_c / c) / ((1 + 1/c) P_c P_bf16): one
        division for every class (a one-class operator then reads its column, where the
        inverse of each operator's peak was a division of its own under a wide vmap;
        `roofline.step_cost`; a division by the broadcast BF16 peak would be a second
        kernel). In PFLOP/s: the product of two peaks in FLOP/s, squared in the
        derivative, overflows float32."""
        peta = peak_flops * 1e-15
        bf16 = lax.index_in_dim(peta, COMPUTE_CLASSES.index("bf16"), axis=-1)
        inverse = 1.0 / self.format_ceiling
        return 1e-15 * (bf16 + peta * inverse) / ((1.0 + inverse) * peta * bf16)

    def compute_fraction(self, rows):
        """Fraction of peak FLOP/s reached by a matmul with `rows` rows (tokens)."""
        rows = jnp.maximum(_array(rows), 0.0)
        return self.compute_max * rows / (rows + self.compute_rows_half)

    def inverse_compute_fraction(self, rows, floor: float = FRACTION_FLOOR):
        """1 / max(`compute_fraction`(rows), floor) in one division (dimensionless, at
        most 1 / floor): (r + h) / (compute_max r) with the rows held at or above r_0 =
        floor h / (compute_max - floor), where the fraction reaches the floor (the fraction
        grows with the rows, so clamping the rows there is the floor's max). The operators
        of a step divided twice each, a fraction and its inverse, and divisions are what
        the step's fusions spend most of their cycles on under a wide `vmap` on XLA:CPU
        (`benchmarks/profile_vmap.py`). No row count makes a zero denominator, so the
        gradient is finite everywhere: zero below r_0, as the max's was."""
        rows = _array(rows)
        half, top = self.compute_rows_half, self.compute_max
        # A fraction at or below the floor everywhere (compute_max <= floor) reads the
        # floor: the clamp stays positive, the min below applies it.
        start = floor * half / jnp.maximum(top - floor, floor)
        rows = jnp.maximum(rows, start)
        return jnp.minimum((rows + half) / (top * rows), 1.0 / floor)


class EnergyCoefficients(eqx.Module):
    """Dynamic energy per unit of work; idle power lives on the `Chip`.

    Priors (before calibration, `calibration/` refits them): about 0.5 pJ/FLOP for BF16 tensor
    math at 4-5 nm, halving per halving of operand width (Horowitz, "Computing's energy
    problem", ISSCC 2014, scaled); HBM3 access about 4 pJ/bit plus on-chip movement, i.e. about
    60 pJ/byte end to end (O'Connor et al., "Fine-Grained DRAM", MICRO 2017: 3.9 pJ/bit HBM2
    core+IO); NVLink-class SerDes about 5 pJ/bit = 40 pJ/byte.
    """

    per_flop: jnp.ndarray = eqx.field(converter=as_number,
                                      default=(0.5e-12, 0.25e-12, 0.25e-12, 0.125e-12))
    """Joules per FLOP for each compute class of `formats.COMPUTE_CLASSES` (J/FLOP)."""
    per_hbm_byte: jnp.ndarray = eqx.field(converter=as_number, default=60e-12)
    """Joules per byte read or written in HBM (J/byte)."""
    per_link_byte: jnp.ndarray = eqx.field(converter=as_number, default=40e-12)
    """Joules per byte sent over the scale-up or scale-out network (J/byte)."""
    active_power: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Power above idle drawn while kernels run, whatever work they do: clocks, static power
    of the units at active clocks, stalled pipelines. It makes a slow kernel cost energy in
    proportion to its time, not only to its work (GPU power models split power the same
    way: AccelWattch, MICRO 2021, constant + static + dynamic). Prior 0: work alone;
    the power calibration fits it (W)."""

    def __check_init__(self):
        check(self, {"per_flop": NON_NEGATIVE, "per_hbm_byte": NON_NEGATIVE,
                     "per_link_byte": NON_NEGATIVE, "active_power": NON_NEGATIVE})


class Chip(eqx.Module):
    """One accelerator (one package; for GB200/GB300 one GPU of the superchip).

    Example:
        >>> chip = from_datasheet("toy", bf16_tflops=1000, hbm_gb=80, hbm_tb_s=3.0,
        ...                       scaleup_gb_s=450, tdp_w=700)
        >>> float(chip.peak_flops[0])
        1000000000000000.0
    """

    name: str = eqx.field(static=True)
    family: str = eqx.field(static=True)
    native_classes: tuple[str, ...] = eqx.field(static=True)
    """Compute classes of `formats.COMPUTE_CLASSES` the chip runs natively."""
    fp4_flavor: str = eqx.field(static=True)
    """What plain "fp4" means here: "nvfp4" or "mxfp4"."""
    domain_size: int = eqx.field(static=True)
    """Chips in one scale-up domain (NVL72: 72; HGX: 8)."""

    peak_flops: jnp.ndarray = eqx.field(converter=as_number)
    """Dense peak per compute class of `formats.COMPUTE_CLASSES` (FLOP/s); a class the chip
    lacks holds the rate it is emulated at (BF16's)."""
    hbm_bandwidth: jnp.ndarray = eqx.field(converter=as_number)
    """Main-memory bandwidth (bytes/s)."""
    hbm_capacity: jnp.ndarray = eqx.field(converter=as_number)
    """Main-memory capacity (bytes)."""
    sram_bytes: jnp.ndarray = eqx.field(converter=as_number)
    """On-chip SRAM / last-level cache (bytes)."""
    num_slices: jnp.ndarray = eqx.field(converter=as_number)
    """Core+memory slices (dies, chiplets, Jalapeno's slices); 1 for a monolithic GPU."""
    slice_bandwidth: jnp.ndarray = eqx.field(converter=as_number)
    """Aggregate bandwidth of the fabric between slices (bytes/s)."""
    scale_up: AbstractInterconnect
    scale_out: AbstractInterconnect
    tdp: jnp.ndarray = eqx.field(converter=as_number)
    """Rated board power (W)."""
    idle_power: jnp.ndarray = eqx.field(converter=as_number)
    """Power drawn while serving with no work in flight: static + clocks-on baseline (W)."""
    allin_power: jnp.ndarray = eqx.field(converter=as_number)
    """All-in power per chip: chip, host, network and facility share (W); InferenceX's
    "tokens/s per MW" divides by it."""
    energy: EnergyCoefficients = eqx.field(default_factory=EnergyCoefficients)
    efficiency: Efficiency = eqx.field(default_factory=Efficiency)
    prompt_attention_speedup: jnp.ndarray = eqx.field(converter=as_number, default=1.0)
    """Speed of prompt-attention kernels relative to the chips its family's `efficiency` was
    fitted on (dimensionless, > 0; 1 for those chips and wherever nothing is documented).
    A measured hardware difference the family fit cannot see: Blackwell Ultra (B300, GB300)
    doubles the special-function units' exponential throughput (MUFU.EX2) over Blackwell
    (B200, GB200), which computes every softmax score's exponential, and NVIDIA measured
    FP8 attention's forward pass on DeepSeek-V3 shapes about 35 % faster on GB300 than on
    GB200 (NVIDIA technical blog, "Making Softmax More Efficient with NVIDIA Blackwell
    Ultra", 2026): 1.35. Decode attention keeps its fitted speed: no measurement of it is
    published, and absorbed MLA decode does 3.4x the matmul work per score of the prompt
    kernel measured, so its softmax share, and the gain, are smaller."""

    def __check_init__(self):
        check(self, {"peak_flops": POSITIVE, "hbm_bandwidth": POSITIVE,
                     "hbm_capacity": POSITIVE, "sram_bytes": NON_NEGATIVE,
                     "num_slices": Range(low=1.0, integer=True),
                     "slice_bandwidth": POSITIVE, "tdp": POSITIVE, "idle_power": NON_NEGATIVE,
                     "allin_power": POSITIVE, "prompt_attention_speedup": POSITIVE})
        n = len(COMPUTE_CLASSES)
        if self.peak_flops.shape != (n,):
            raise ValueError(f"Chip {self.name!r}: peak_flops must have shape ({n},), one per "
                             f"compute class {COMPUTE_CLASSES}; got {self.peak_flops.shape}")
        for cls in self.native_classes:
            if cls not in COMPUTE_CLASSES:
                raise ValueError(f"Chip {self.name!r}: native class {cls!r} is not one of "
                                 f"{COMPUTE_CLASSES}")
        if self.fp4_flavor not in ("nvfp4", "mxfp4"):
            raise ValueError(f"Chip {self.name!r}: fp4_flavor must be 'nvfp4' or 'mxfp4'")
        if not isinstance(self.domain_size, int) or isinstance(self.domain_size, bool) \
                or self.domain_size < 1:
            raise ValueError(f"Chip {self.name!r}: domain_size must be an integer >= 1, got "
                             f"{self.domain_size!r}")
        if not any(isinstance(x, jax.core.Tracer) for x in (self.idle_power, self.tdp)) \
                and np.any(np.asarray(self.idle_power) >= np.asarray(self.tdp)):
            raise ValueError(f"Chip {self.name!r}: idle_power ({float(np.max(self.idle_power)):g}"
                             f" W) must be below tdp ({float(np.min(self.tdp)):g} W)")

    def class_index(self, cls: str) -> int:
        return COMPUTE_CLASSES.index(cls)


def _whole(value, chip: str, key: str) -> int:
    """`value` as an int, or ValueError naming `key` (a count given as 2.7 is a mistake, not
    2)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not float(value).is_integer():
        raise ValueError(f"chip {chip!r}: {key} must be a whole number, got {value!r}")
    return int(value)


def _algorithms(text: str, name: str) -> dict:
    """`Switch` keyword arguments of a `scaleup_algorithms` string ("ring|one_shot<=8")."""
    algorithms, limit = [], {}
    for part in str(text).split("|"):
        part = part.strip()
        if part.startswith("one_shot<="):
            try:
                limit = {"direct_max_group": int(part[len("one_shot<="):])}
            except ValueError:
                raise ValueError(f"chip {name!r}: scaleup_algorithms {text!r}: one_shot<=N "
                                 "needs an integer N") from None
            part = "one_shot"
        algorithms.append(part)
    return {"algorithms": tuple(algorithms), **limit}


def from_datasheet(name: str, *, bf16_tflops: float, hbm_gb: float, hbm_tb_s: float,
                   scaleup_gb_s: float, tdp_w: float, fp8_tflops: float | None = None,
                   int8_tops: float | None = None, fp4_tflops: float | None = None,
                   fp4_flavor: str = "nvfp4", family: str = "generic", sram_mb: float = 50.0,
                   num_slices: float = 1.0, slice_tb_s: float | None = None,
                   scaleup_latency_us: float = 1.0, collective_base_us: float = 6.0,
                   domain_size: int = 8,
                   scaleup_topology: str = "switch", torus_dims: tuple[int, ...] = (16, 16),
                   scaleup_algorithms: str = "ring", scaleout_gb_s: float = 50.0,
                   scaleout_latency_us: float = 10.0,
                   idle_w: float | None = None, allin_kw: float | None = None,
                   energy: EnergyCoefficients | None = None,
                   efficiency: Efficiency | None = None,
                   prompt_attention_speedup: float = 1.0) -> Chip:
    """Build a `Chip` from datasheet units (TFLOPS, GB, TB/s, GB/s, W, us, MB).

    Dense (not sparse) peaks. A format left `None` is not native: it runs at the BF16 rate.
    `scaleup_gb_s` is per chip per direction; `scaleup_latency_us` is per algorithm step and
    `collective_base_us` the fixed cost of any collective. `idle_w` defaults to 0.15 x TDP
    and `allin_kw` to 2 x TDP (documented assumptions; presets give published values where
    any exist). `scaleup_algorithms` lists a switch's all-reduce algorithms separated by
    "|", a one-shot limit as `one_shot<=N` (e.g. "ring|tree|one_shot<=128"; see
    `perfmodel.interconnect`). `slice_tb_s` defaults to 2 x HBM bandwidth (a fabric that
    rarely binds). `prompt_attention_speedup`: see `Chip.prompt_attention_speedup`.

    Raises:
        ValueError: a non-positive or missing required number, naming it.
    """
    required = {"bf16_tflops": bf16_tflops, "hbm_gb": hbm_gb, "hbm_tb_s": hbm_tb_s,
                "scaleup_gb_s": scaleup_gb_s, "tdp_w": tdp_w}
    numbers = {"fp8_tflops": fp8_tflops, "int8_tops": int8_tops, "fp4_tflops": fp4_tflops,
               "sram_mb": sram_mb, "num_slices": num_slices, "slice_tb_s": slice_tb_s,
               "scaleup_latency_us": scaleup_latency_us,
               "collective_base_us": collective_base_us, "scaleout_gb_s": scaleout_gb_s,
               "scaleout_latency_us": scaleout_latency_us, "idle_w": idle_w,
               "allin_kw": allin_kw, "prompt_attention_speedup": prompt_attention_speedup,
               **required}
    for key, value in numbers.items():
        if value is not None and (isinstance(value, bool) or not isinstance(
                value, (int, float, np.integer, np.floating))):
            raise TypeError(f"chip {name!r}: {key} must be a number, got "
                            f"{type(value).__name__} {value!r}")
    for key, value in required.items():
        if value is None or not value > 0 or not math.isfinite(value):
            raise ValueError(f"chip {name!r}: {key} must be a positive finite number, got "
                             f"{value!r}")
    peaks = {"bf16": bf16_tflops, "fp8": fp8_tflops, "int8": int8_tops, "fp4": fp4_tflops}
    native = tuple(c for c in COMPUTE_CLASSES if peaks[c] is not None and peaks[c] > 0)
    peak = [(peaks[c] if c in native else bf16_tflops) * 1e12 for c in COMPUTE_CLASSES]
    link = dict(bandwidth=scaleup_gb_s * 1e9, latency=scaleup_latency_us * 1e-6,
                base_latency=collective_base_us * 1e-6)
    if scaleup_topology == "switch":
        up = Switch(**link, **_algorithms(scaleup_algorithms, name))
    elif scaleup_topology == "torus":
        up = Torus(**link, dims=tuple(torus_dims))
    elif scaleup_topology == "ring":
        up = Ring(**link)
    else:
        raise ValueError(f"chip {name!r}: scaleup_topology must be switch, torus or ring, "
                         f"got {scaleup_topology!r}")
    out = Switch(bandwidth=scaleout_gb_s * 1e9, latency=scaleout_latency_us * 1e-6,
                 base_latency=collective_base_us * 1e-6)
    return Chip(
        name=name, family=family, native_classes=native, fp4_flavor=fp4_flavor,
        domain_size=_whole(domain_size, name, "domain_size"), peak_flops=peak,
        hbm_bandwidth=hbm_tb_s * 1e12,
        hbm_capacity=hbm_gb * 1e9, sram_bytes=sram_mb * 1e6, num_slices=num_slices,
        slice_bandwidth=(slice_tb_s if slice_tb_s is not None else 2 * hbm_tb_s) * 1e12,
        scale_up=up, scale_out=out, tdp=tdp_w,
        idle_power=idle_w if idle_w is not None else 0.15 * tdp_w,
        allin_power=(allin_kw * 1e3) if allin_kw is not None else 2.0 * tdp_w,
        energy=energy if energy is not None else EnergyCoefficients(),
        efficiency=efficiency if efficiency is not None else Efficiency(),
        prompt_attention_speedup=prompt_attention_speedup)
