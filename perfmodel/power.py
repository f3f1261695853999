"""Power: idle + dynamic energy / time, capped at TDP by slowing the chip down.

    P = P_idle + (E_flop * FLOP + E_hbm * bytes_HBM + E_link * bytes_link
                  + P_active * t_busy) / t

(t_busy: the part of the step the chip runs kernels; host overheads are idle time.)

Over the cap the chip does not exceed TDP: it lowers clocks until the dynamic energy fits,
so a step takes at least E_dyn / (TDP - P_idle). That is one more term of the roofline,
`t' = smooth_max(t, E_dyn / (TDP - P_idle))`, and the reported power is P_idle + E_dyn / t'.
(Dynamic energy per operation is held constant under DVFS: a conservative simplification.)
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp

from .hardware import Chip
from .roofline import StepCost
from .smooth import DEFAULT_SHARPNESS, smooth_max


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
    """Stretch a step so its average power stays at or under TDP.

    Args:
        chip: gives `tdp` and `idle_power`.
        time: uncapped step time (s).
        energy: dynamic energy of the step (J).

    Example:
        >>> from perfmodel.presets import get_chip
        >>> chip = get_chip("h100")
        >>> r = apply_power_cap(chip, 1e-3, 10.0, hard=True)   # 10 kW asked: throttled
        >>> round(float(r.power), 6) == round(float(chip.tdp), 6)
        True
    """
    headroom = jnp.maximum(chip.tdp - chip.idle_power, 1e-3)
    capped = smooth_max(time, energy / headroom, sharpness=sharpness, hard=hard)
    power = average_power(chip.idle_power, energy, capped)
    return PowerResult(time=capped, power=power, dynamic_energy=energy,
                       throttle=capped / time)
