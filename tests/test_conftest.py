"""The test configuration's bound on memory mappings (`conftest.py`): a worker past the bound
drops JAX's caches when it leaves a test file, and within a file only past the higher one."""

import types

import jax
import jax.numpy as jnp

import conftest


def _items(this, following):
    item = types.SimpleNamespace(path=this)
    nextitem = None if following is None else types.SimpleNamespace(path=following)
    return item, nextitem


def _compiled_kernel():
    kernel = jax.jit(lambda x: 2.0 * x + 1.0)
    kernel(jnp.ones(3))
    assert kernel._cache_size() == 1
    return kernel


def test_mappings_are_counted():
    assert conftest.mappings() > 0


def test_caches_kept_under_the_bound_or_within_a_file(monkeypatch):
    kernel = _compiled_kernel()
    monkeypatch.setattr(conftest, "MAPPINGS_CLEAR", 10**9)
    monkeypatch.setattr(conftest, "MAPPINGS_FORCE", 10**9)
    conftest.pytest_runtest_teardown(*_items("a.py", "b.py"))   # under the bound
    assert kernel._cache_size() == 1
    monkeypatch.setattr(conftest, "MAPPINGS_CLEAR", 0)
    conftest.pytest_runtest_teardown(*_items("a.py", "a.py"))   # same file next
    assert kernel._cache_size() == 1


def test_caches_dropped_within_a_file_past_the_higher_bound(monkeypatch):
    monkeypatch.setattr(conftest, "MAPPINGS_FORCE", 0)
    kernel = _compiled_kernel()
    conftest.pytest_runtest_teardown(*_items("a.py", "a.py"))
    assert kernel._cache_size() == 0


def test_caches_dropped_past_the_bound_between_files(monkeypatch):
    monkeypatch.setattr(conftest, "MAPPINGS_CLEAR", 0)
    for following in ("b.py", None):   # another file next, or the worker's last test
        kernel = _compiled_kernel()
        conftest.pytest_runtest_teardown(*_items("a.py", following))
        assert kernel._cache_size() == 0
