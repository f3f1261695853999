"""Power: idle + dynamic energy / time, capped at TDP by slowing the chip down.

    P = P_idle + (E_flop * FLOP + E_hbm * bytes_HBM + E_link * bytes_link
                  + P_active * t_busy) / t

(t_busy: the part of the step the chip runs kernels; host overheads are idle time.)

Over the cap the chip does not exceed TDP: it lowers its clock (and its voltage with it)
until the step's power fits. Dynamic power is alpha C V^2 f: with the voltage fixed it
falls in proportion to the clock (exponent 1); with the voltage proportional to the clock
as the cube (exponent 3; Weste and Harris, "CMOS VLSI Design", 4th ed., section 5.2).
`DVFS_EXPONENT` k sits between: at a clock scaled by 1/s a step takes s times as long
and each operation costs 1/s^(k-1) of its energy. With R = E_dyn / (t (TDP - P_idle)),
the uncapped step's dynamic power over the headroom,

    s = smooth_max(1, R)^(1/k),   t' = s t,   E_dyn' = E_dyn / s^(k-1),

and the reported power is P_idle + E_dyn' / t' (TDP when the cap binds). The whole step
stretches (memory-bound work is held to the core clock too), and the active term
`P_active t_busy` scales like the rest.

k = 2 is what the one measurement of the same system at two power caps says: NVIDIA's
MLPerf Inference v4.1 closed Offline results on 8 H200-SXM-141GB with TensorRT
(`benchmarks_mlperf.csv`), the MaxQ system with its GPUs capped at 500 W against the
700 W one (the 500 W limit: `power_limit` of the H200_SXM_141GBx8_MaxQ configs in
NVIDIA's v4.1 submission, closed/NVIDIA/configs, as `calibration/power/mlperf_power.csv`
records), 0.807x the tokens/s per GPU on Llama-2-70B and 0.830x on Mixtral-8x7B; the
model puts both 700 W points at the cap and predicts 0.805x for each with k = 2; with
both points capped the ratio is that of the headrooms above idle to the power 1/k, so
k = 3 gives 0.865x and k = 1 (the rule before, energy per operation held constant)
0.648x.
Those four rows are therefore not independent checks of the power cap (`python
calibration/mlperf_check.py --maxq` prints the comparison; `tests/test_power.py` checks it).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .hardware import Chip
from .roofline import StepCost
from .smooth import DEFAULT_SHARPNESS, smooth_max

#: How fast dynamic power falls with the clock under DVFS, P ~ f^k (module docstring: from
#: the MaxQ and 700 W H200 results of MLPerf Inference v4.1).
DVFS_EXPONENT = 2.0


@jax.custom_jvp
def _stretched_time(time, ceiling):
    """The capped step time (time^(k-1) x ceiling)^(1/k) (s), `ceiling` (s) the maximum of
    `apply_power_cap`: zero at zero time, the one root of the cap, nothing around it.

    The root is what XLA:CPU treats as expensive: it computes it once, in one fusion, and
    every consumer reads the result. A `where` around it (the zero-time case) is cheap, so
    XLA copied it, and the whole step's formulas under it, into each consumer: a vmapped
    `predict` of mean metrics recomputed the mixed step in four fusions (docs/history.md, "Speed";
    `benchmarks/profile_vmap.py`). The derivative's guard lives in
    the rule below instead: at zero time the capped time is the time (its tangent)."""
    if DVFS_EXPONENT == 2.0:
        # The same root as a square root: XLA:CPU's power is an exp of a log, about a fifth
        # of a wide vmap's time (`benchmarks/profile_vmap.py --trace`).
        return jnp.sqrt(time * ceiling)
    return (time ** (DVFS_EXPONENT - 1.0) * ceiling) ** (1.0 / DVFS_EXPONENT)


@_stretched_time.defjvp
def _stretched_time_jvp(primals, tangents):
    (time, ceiling), (dtime, dceiling) = primals, tangents
    capped = _stretched_time(time, ceiling)
    # d t' = t' / k ((k - 1) dt / t + dc / c) where the step runs; dt where it does not
    # (t = 0: the uncapped time is returned as it is).
    running = time * ceiling > 0
    safe_time, safe_ceiling = jnp.where(running, time, 1.0), jnp.where(running, ceiling, 1.0)
    rate = capped / DVFS_EXPONENT * ((DVFS_EXPONENT - 1.0) * dtime / safe_time
                                     + dceiling / safe_ceiling)
    return capped, jnp.where(running, rate, dtime)


def average_power(idle_power, dynamic_energy, time, utilization=1.0):
    """Average power of a chip that runs steps of `dynamic_energy` above idle (J) per `time`
    (s) a `utilization` share of the time and idles the rest (W):
    P_idle + utilization x E_dyn / t. A run's total dynamic energy over its duration (the
    simulator's report) is the same with utilization 1.

    Example:
        >>> float(average_power(100.0, 3.0, 0.01, utilization=0.5))
        250.0
    """
    return idle_power + utilization * dynamic_energy / time


class PowerResult(eqx.Module):
    time: jnp.ndarray
    """Step time after the power cap (s)."""
    power: jnp.ndarray
    """Average power of the chip over the step (W)."""
    dynamic_energy: jnp.ndarray
    """Dynamic energy of the step (J)."""
    throttle: jnp.ndarray
    """Capped over uncapped step time (>= 1; about 1 when the cap does not bind)."""


def dynamic_energy(chip: Chip, cost: StepCost):
    """Joules of a step above idle: FLOPs by class, HBM bytes, network bytes, and the
    active power over the time kernels run."""
    return (cost.compute_energy + chip.energy.per_hbm_byte * cost.hbm_bytes
            + chip.energy.per_link_byte * cost.link_bytes
            + chip.energy.active_power * cost.busy_time)


def apply_power_cap(chip: Chip, time, energy, sharpness=DEFAULT_SHARPNESS,
                    hard: bool = False) -> PowerResult:
    """Slow a step down (clock and voltage) until its average power is at most TDP.

    Args:
        chip: gives `tdp` and `idle_power`.
        time: uncapped step time (s).
        energy: dynamic energy of the step at full clock (J).

    Returns:
        The stretched time, the power, the dynamic energy at the lowered clock (J) and
        the stretch (module docstring).

    Example:
        >>> from perfmodel.presets import get_chip
        >>> chip = get_chip("h100")
        >>> r = apply_power_cap(chip, 1e-3, 10.0, hard=True)   # 10 kW asked: throttled
        >>> round(float(r.power), 6) == round(float(chip.tdp), 6)
        True
        >>> asked = 10.0 / 1e-3 / float(chip.tdp - chip.idle_power)   # 10 kW over the headroom
        >>> round(float(r.throttle), 6) == round(asked ** (1 / DVFS_EXPONENT), 6)
        True
    """
    headroom = jnp.maximum(chip.tdp - chip.idle_power, 1e-3)
    # s = smooth_max(1, R)^(1/k) with R = energy / (headroom time); the p-norm is
    # homogeneous, so s time = (time^(k-1) smooth_max(time, energy / headroom))^(1/k): the
    # previous rule's maximum of two times, then a root (for k = 2, sqrt(time x maximum)).
    # Written with R itself, the same numbers compiled into a vmapped `predict` 4x slower on
    # XLA:CPU (76 fusions against 34; `benchmarks/bench_vmap.py` 13 ms against 3.4 ms;
    # `tests/test_kernel_structure.py`).
    k = DVFS_EXPONENT
    ceiling = smooth_max(time, energy / headroom, sharpness=sharpness, hard=hard)
    # The root alone (`_stretched_time`: XLA computes it once under a vmap). A step of no
    # time and no energy (nothing to run) is not stretched: its ratio is 1, not 0 / 0 (the
    # `where`s inside the division, so that XLA keeps one copy of it too, and the gradient
    # is finite there).
    capped = _stretched_time(time, ceiling)
    running = time * ceiling > 0
    slowdown = jnp.where(running, time, 1.0) / jnp.where(running, capped, 1.0)   # 1 / s
    energy = energy * slowdown ** (k - 1.0)                                     # E / s^(k-1)
    power = average_power(chip.idle_power, energy, capped)
    stretch = 1.0 / slowdown
    return PowerResult(time=capped, power=power, dynamic_energy=energy, throttle=stretch)
