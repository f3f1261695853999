"""Every command models a chip the same way: the same chip, model and design give the same
throughput and power through the sweep behind `perfmodel pareto`, the comparison behind
`perfmodel compare` and `perfmodel.predict`, the API that `perfmodel predict` wraps."""

import numpy as np
import pytest

import perfmodel as pm
from perfmodel import fitted
from perfmodel.studies import jalapeno
from perfmodel.sweep import default_runtime, sweep

# Jalapeno is the chip the two power models disagreed on; a small model keeps the default
# run short, the wide layouts run with the slow tests.
CASES = [("llama-3.1-8b", "jalapeno", 1),
         pytest.param("gpt-oss-120b", "jalapeno", 8, marks=pytest.mark.slow),
         pytest.param("deepseek-r1", "gb200", 8, marks=pytest.mark.slow),
         pytest.param("llama-3.1-70b", "mi355x", 4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("model_name,chip_name,chips", CASES)
def test_commands_agree_on_throughput_and_power(model_name, chip_name, chips):
    workload = pm.Workload(8192, 1024)
    grid = (64.0,)
    pareto = sweep(model_name, chip_name, workload, chips=chips, precision="fp4", grid=grid)
    comparison = jalapeno.chip_points(model_name, pm.get_chip(chip_name), workload,
                                     chips=chips, grid=grid).sweep
    model, chip = pm.get_model(model_name), pm.get_chip(chip_name)
    checked = 0
    for i, layout in enumerate(pareto.layouts):
        points = np.flatnonzero(pareto.layout_index == i)
        if not len(points) or layout.replicas != 1:
            continue
        k = int(points[0])
        same = [j for j in np.flatnonzero(comparison.layout_index == i)
                if comparison.values["concurrency"][j] == pareto.values["concurrency"][k]]
        assert comparison.layouts[i] == layout and same
        design = pm.Design(concurrency=pareto.values["concurrency"][k], layout=layout,
                           precision=pm.precision(chip, model, "fp4"),
                           runtime=default_runtime(chip))
        direct = pm.predict(model, chip, workload, design, hard=True)
        for key, field in (("tput_per_chip_total", "throughput_per_chip"),
                           ("power_w_modelled", "power_per_chip")):
            want = float(getattr(direct, field))
            assert pareto.values[key][k] == pytest.approx(want, rel=1e-9), (layout, key)
            assert comparison.values[key][same[0]] == pytest.approx(want, rel=1e-9)
        checked += 1
    assert checked >= 1


def test_one_chip_model_for_every_caller():
    """`get_chip` is the fitted chip; there is no second, differently calibrated one."""
    for name in ("jalapeno", "gb200", "h100", "mi355x", "rubin"):
        chip = pm.get_chip(name)
        again = fitted.apply(pm.get_chip(name, calibrated=False))
        assert float(chip.energy.per_flop[0]) == float(again.energy.per_flop[0])
        assert float(chip.idle_power) == float(again.idle_power)
        assert float(chip.efficiency.compute_max) == float(again.efficiency.compute_max)
