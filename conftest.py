"""Test configuration: float64 and strict promotion (as STYLE.md asks), warnings are errors
(pyproject), and a fixed hypothesis profile that fits CI's 2 cores."""

import os

import jax

# The command line's persistent compilation cache stays off in tests (hermetic runs);
# tests/test_cli.py turns it on where it tests it.
os.environ.setdefault("PERFMODEL_CACHE_DIR", "off")
# JAX's own persistent cache too (it initialises once per process): a slow-stage worker
# crashed serializing an executable into it (segmentation fault in
# `put_executable_and_time`); which test had given it a folder was not found. Subprocess
# tests of the command line's cache set their own environment.
jax.config.update("jax_enable_compilation_cache", False)
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")
