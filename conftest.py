"""Test configuration: float64 and strict promotion (as STYLE.md asks), warnings are errors
(pyproject), a fixed hypothesis profile that fits CI's 2 cores, and a bound on the memory
mappings a test process holds."""

import gc
import os

import jax
import pytest

# The command line's persistent compilation cache stays off in tests (hermetic runs);
# tests/test_cli.py turns it on where it tests it.
os.environ.setdefault("PERFMODEL_CACHE_DIR", "off")
# JAX's own persistent cache too (it initialises once per process). Subprocess tests of the
# command line's cache set their own environment.
jax.config.update("jax_enable_compilation_cache", False)
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


# Each compiled XLA:CPU executable holds about three memory mappings of its own (measured:
# 300 small kernels, 427 -> 1,394 mappings) until nothing refers to it. A test worker that
# ran the whole slow stage reached Linux's limit of 65,530 mappings per process
# (`vm.max_map_count`; its core dump held 64,834): the next compilation returned an error
# (thrown from `ValueOrThrow` in the dump), and raising it crashed the worker inside the C++
# unwinder (segmentation fault or abort in `backend_compile_and_load`; dumped here in
# `test_domain_fuzz.py`, and likely the same in CI's earlier crash in
# `test_simulate_disaggregated.py`, which left no dump). Past `MAPPINGS_CLEAR`, the worker
# drops JAX's caches when it leaves a test file (so that a file's tests keep the kernels
# they share), and past `MAPPINGS_FORCE` after any test (one slow file added about 18,000
# mappings on its own): kernels compile again when next needed.
MAPPINGS_CLEAR = 20_000
MAPPINGS_FORCE = 45_000


def mappings() -> int:
    """Memory mappings of this process (lines of /proc/self/maps; 0 where there is none)."""
    try:
        with open("/proc/self/maps", "rb") as fh:
            return fh.read().count(b"\n")
    except OSError:
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    same_file = nextitem is not None and nextitem.path == item.path
    if mappings() > (MAPPINGS_FORCE if same_file else MAPPINGS_CLEAR):
        jax.clear_caches()
        gc.collect()
