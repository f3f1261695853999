"""The store of traced kernels (`perfmodel.compiled`): a kernel loaded from it gives
the compiled kernel's outputs, a change of any static argument or of an array's shape is a
new entry, and a torn file falls back to tracing."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from perfmodel import compiled as kc


class Scale(eqx.Module):
    factor: jax.Array
    power: int = eqx.field(static=True)


def _kernel(m: Scale, x, offset):
    return {"y": m.factor * x ** m.power + offset, "n": jnp.sum(x)}


kernel = kc.filter_jit(_kernel)


@pytest.fixture
def store(tmp_path, monkeypatch):
    folder = tmp_path / "traced"
    monkeypatch.setattr(kc, "traced_store", lambda: str(folder))
    return folder


def test_loaded_kernel_matches_and_keys_on_structure(store):
    x = jnp.arange(4.0)
    want = _kernel(Scale(jnp.asarray(2.0), 2), x, 1.0)
    got = kernel(Scale(jnp.asarray(2.0), 2), x, 1.0)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert len(os.listdir(store)) == 1
    # Same structure, new array values: the same entry.
    kernel(Scale(jnp.asarray(3.0), 2), x + 1.0, 1.0)
    assert len(os.listdir(store)) == 1
    # A static field, a Python scalar (static under filter_jit) and a shape are each a key.
    np.testing.assert_array_equal(kernel(Scale(jnp.asarray(2.0), 3), x, 1.0)["y"],
                                  2.0 * x ** 3 + 1.0)
    np.testing.assert_array_equal(kernel(Scale(jnp.asarray(2.0), 2), x, 5.0)["y"],
                                  2.0 * x ** 2 + 5.0)
    kernel(Scale(jnp.asarray(2.0), 2), jnp.arange(5.0), 1.0)
    assert len(os.listdir(store)) == 4


def test_torn_entry_falls_back_to_tracing(store):
    x = jnp.arange(3.0)
    kernel(Scale(jnp.asarray(1.0), 1), x, 0.0)
    (entry,) = os.listdir(store)
    (store / entry).write_bytes(b"torn")
    np.testing.assert_array_equal(kernel(Scale(jnp.asarray(1.0), 1), x, 0.0)["y"], x)


def test_store_beside_the_compilation_cache_only(monkeypatch, tmp_path):
    monkeypatch.delenv("PERFMODEL_TRACED_STORE", raising=False)
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert kc.traced_store() is None
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
        assert kc.traced_store() == str(tmp_path / "xla_traced")
        monkeypatch.setenv("PERFMODEL_TRACED_STORE", "off")
        assert kc.traced_store() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def _checked_kernel(x):
    return eqx.error_if(x, x < 0, "x must be non-negative") * 2.0


checked = kc.filter_jit(_checked_kernel)


def test_a_kernel_with_runtime_checks_is_remembered_as_not_stored(store):
    """Host callbacks do not export: the kernel runs as plain `filter_jit`, and the key is
    marked so later processes do not try again."""
    np.testing.assert_array_equal(checked(jnp.arange(3.0)), 2.0 * jnp.arange(3.0))
    (entry,) = os.listdir(store)
    assert entry.endswith(".skip")
    np.testing.assert_array_equal(checked(jnp.arange(3.0)), 2.0 * jnp.arange(3.0))
    with pytest.raises(Exception, match="non-negative"):
        checked(-jnp.ones(3))


def _chain(with_store: bool, tmp_path, monkeypatch):
    """Two kernels lowered before either runs, the second on the first's `out_shapes`,
    compiled side by side, then run: the outputs of calling them one after the other."""
    folder = tmp_path / ("traced" if with_store else "none")
    monkeypatch.setattr(kc, "traced_store", lambda: str(folder) if with_store else None)
    m, x = Scale(jnp.asarray(2.0), 2), jnp.arange(4.0)
    second = kc.filter_jit(lambda out, m: {"z": out["y"] * m.factor - out["n"]})
    with kc.side_by_side() as compiler:
        a = compiler.submit(kernel.lower(m, x, 1.0))
        b = compiler.submit(second.lower(a.out_shapes, m))
    assert a.compiled is not None and b.compiled is not None
    got = b(a(m, x, 1.0), m)["z"]
    np.testing.assert_array_equal(got, second(kernel(m, x, 1.0), m)["z"])
    np.testing.assert_array_equal(got, (2.0 * x ** 2 + 1.0) * 2.0 - 6.0)
    return folder


@pytest.mark.parametrize("with_store", [False, True])
def test_lowered_chain_compiled_side_by_side_matches_calls(with_store, tmp_path, monkeypatch):
    folder = _chain(with_store, tmp_path, monkeypatch)
    # Through the store, `lower` writes the same entries a call would (one per kernel).
    assert (len(os.listdir(folder)) == 2) if with_store else not folder.exists()


def test_lowered_kernel_refuses_another_structure():
    lowered = kernel.lower(Scale(jnp.asarray(2.0), 2), jax.ShapeDtypeStruct((4,), float), 1.0)
    with pytest.raises(ValueError, match="another structure"):
        lowered(Scale(jnp.asarray(2.0), 2), {"x": jnp.arange(4.0)}, 1.0)


def test_side_by_side_raises_a_failed_compilation():
    class Boom(kc.Lowered):
        def compile(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with kc.side_by_side() as compiler:
            compiler.submit(Boom(None, None, None))


def _qr_solve(a, b):
    import lineax as lx
    return lx.linear_solve(lx.MatrixLinearOperator(a), b, lx.QR(), throw=False).value


qr_solve = kc.filter_jit(_qr_solve)


def test_kernel_with_lapack_qr_is_stored(store):
    """LAPACK calls that `jax.export` guarantees across no versions (QR's `ormqr`, which the
    least-squares fits use) still go through the store: its key holds jax's and jaxlib's
    versions, so only the same versions load the program."""
    a = jnp.asarray([[2.0, 1.0], [1.0, 3.0], [0.0, 1.0]])
    b = jnp.asarray([1.0, 2.0, 3.0])
    np.testing.assert_allclose(qr_solve(a, b), _qr_solve(a, b), rtol=1e-12)
    (entry,) = os.listdir(store)
    assert entry.endswith(".pkl")


def test_stored_output_fed_back_compiles_once(store, caplog):
    """A stored program's outputs are committed to their device; fed to the same kernel
    again they must not compile it a second time (a program with explicit shardings)."""
    x = jnp.arange(3.0)
    m = Scale(jnp.asarray(2.0, dtype=x.dtype), 1)   # not weakly typed, as first[1] below
    with jax.log_compiles(), caplog.at_level("WARNING"):
        first = kernel(m, x, 1.0)["y"]
        assert first.committed
        again = kernel(Scale(first[1], 1), first, 1.0)["y"]
    compiles = [r for r in caplog.records if "Finished XLA compilation of jit(call)"
                in r.getMessage()]
    assert len(compiles) == 1, [r.getMessage() for r in compiles]
    np.testing.assert_array_equal(again, 3.0 * (2.0 * x + 1.0) + 1.0)
