"""The shape of the compiled kernel that sweeps and `benchmarks/bench_vmap.py` run.

Speed is measured by benchmark scripts, never by a timed test. What a test can hold is the
structure XLA compiles the wide `vmap` of `predict` into, which is deterministic for a given
JAX/XLA version and follows the time (`python benchmarks/profile_vmap.py`): at `01c0001` the
DVFS power cap, written as a root of a ratio, compiled into 76 fusions and 3,808 bytes of
memory traffic per configuration and ran 4x slower (`bench_vmap.py`: 13 ms against 3.4 ms a
call of 100,000 configurations) than the same numbers written as a root of a maximum of two
times (34 fusions and 1,224 bytes at `8117281`), unnoticed for a day. The bounds sit above
today's kernel and below the slow one (measured with JAX 0.10.2); a new XLA that moves
them is a reason to rerun `python benchmarks/profile_vmap.py --trace` before relaxing them.
They were raised from 42 fusions and 1,600 bytes when the steady state began to price the
queue of the requests an SGLang look admits together (`serving._aggregated`): its share of
a prompt came from the prompt-only step that only the p99 TTFT needed before, so a kernel
of mean metrics evaluated that step too (49 fusions and 2,760 bytes, against 36 and 1,320
without the term; `bench_vmap.py` 7.2-7.5 ms against 4.0-4.1 ms on the same machine). The
share now comes from the mixed step the kernel evaluates anyway (41 fusions and 1,864
bytes), and the bounds came down with it. XLA's own count of FLOPs per configuration is
bounded too: it is what grows when XLA copies a chain of cheap operations into several
consumers instead of computing it once. At `ea18c38` the `where` around the power cap's
root made it copy the whole mixed step into four fusions (1,371 FLOP per configuration);
with the root alone (`power._stretched_time`) and the hard maxima and minima elementwise
(`smooth._hard_max`) the kernel is 26 fusions, 1,240 bytes and 863 FLOP per configuration
(`f32505f`). Then 20 fusions, 896 bytes and 725 FLOP: the cap's root as a square root (no
power operation), one reciprocal per fabric for its collectives, one division for the
inverse peaks of every compute class, no queue term where the scheduler is known to look
every step, and no dead placement term (a column the design sets to 0) (each held apart by
a test in `tests/test_roofline.py` or `tests/test_interconnect.py`). 720 FLOP and 22
divisions (from 29) since each matmul's inverse fraction of peak is one division
(`Efficiency.inverse_compute_fraction`): the step fusions' cycles go mostly to float64
divisions. Then 16 fusions, 720 bytes, 676 FLOP and 20 divisions: the routed experts'
activation bytes are their assignments times the values each moves, where a division by
the rows per expert (which the rows then cancelled) split the step's kernel. The gradient
kernel is bounded too (slow: it compiles in about 20 s).
"""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_vmap  # noqa: E402
from profile_vmap import structure  # noqa: E402


def test_the_vmapped_predict_compiles_to_few_fusions_and_little_traffic():
    batched, _, _, _ = bench_vmap.build()
    kernel = structure(batched, bench_vmap.configurations(100_000))
    assert kernel["fusions"] <= 18, f"{kernel['fusions']} fusions (16 now, 76 at 01c0001)"
    assert kernel["xla_bytes_per_config"] <= 800.0, (
        f"{kernel['xla_bytes_per_config']:.0f} bytes per configuration (720 now, "
        "3,808 at 01c0001)")
    assert kernel["xla_flops_per_config"] <= 900.0, (
        f"{kernel['xla_flops_per_config']:.0f} FLOP per configuration (676 now, 1,371 at "
        "ea18c38, where the mixed step was computed four times)")
    assert kernel["powers"] == 0, "the power cap's root should be a square root"
    # Each matmul's inverse fraction of peak is one division (`Efficiency.
    # inverse_compute_fraction`), where the fraction and its inverse were two.
    assert kernel["divisions"] <= 21, (
        f"{kernel['divisions']} divisions (20 now, 29 when each matmul divided twice)")


@pytest.mark.slow   # the gradient kernel compiles in about 20 s on 2 cores
def test_the_gradient_kernel_computes_each_chain_once():
    """The per-configuration gradients of `bench_vmap.build_grads` (what a fit or a
    gradient sweep runs): XLA copies chains of cheap operations into every fusion that
    reads them, and a division ends such a chain. Multiplying the operators' times by the
    inverse of the runtime's efficiencies instead of dividing by them took divisions out
    and let XLA copy the chains before them: 17,754 FLOP and 56,627 bytes per
    configuration against 10,712 and 34,057, 15 % fewer gradients a second."""
    grads, chip, design = bench_vmap.build_grads()
    kernel = structure(grads, bench_vmap.configurations(10_000), chip, design)
    assert kernel["xla_flops_per_config"] <= 12_500.0, kernel
    assert kernel["xla_bytes_per_config"] <= 40_000.0, kernel
