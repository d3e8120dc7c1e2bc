"""Penalties at verify / draft positions (spec_decode/penalties.py): the fused application equals the dense one
(to an ulp), and it never materialises the ``int32[positions, V]`` counts (memory_analysis of the compiled program,
against the dense version as a control)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode.penalties import penalize_at, penalize_at_reference


def case(rng, p, v, n, d):
    """Random positions: half the rows with each penalty off, drafts with repeats and -1 padding, every
    ``num_before`` in ``[0, D]``."""
    def maybe(off, on):
        return jnp.asarray(np.where(rng.random(p) < 0.5, off, on), jnp.float32)

    return (jnp.asarray(rng.normal(0, 3, (p, v)), jnp.float32),
            jnp.asarray(rng.integers(0, 3, (n, v)), jnp.int32),
            jnp.asarray(rng.random((n, v)) < 0.2),
            jnp.asarray(rng.integers(0, n, p), jnp.int32),
            jnp.asarray(rng.integers(-1, min(v, 6), (p, d)), jnp.int32),  # few distinct ids: repeats
            jnp.asarray(rng.integers(0, d + 1, p), jnp.int32),
            maybe(1.0, 1.4), maybe(0.0, 0.6), maybe(0.0, 0.9),
            jnp.asarray(rng.uniform(0.3, 2.0, p), jnp.float32))


@pytest.mark.parametrize("p,v,n,d", [(1, 8, 1, 0), (5, 16, 3, 1), (24, 40, 4, 7), (33, 7, 2, 3)])
def test_fused_penalties_equal_the_dense_counts(p, v, n, d):
    args = case(np.random.default_rng(p * 100 + d), p, v, n, d)
    got = jax.jit(penalize_at)(*args)
    want = jax.jit(penalize_at_reference)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)  # fusion: 1 ulp at most
    # rows with every penalty off are untouched
    off = (np.asarray(args[6]) == 1.0) & (np.asarray(args[7]) == 0.0) & (np.asarray(args[8]) == 0.0)
    np.testing.assert_array_equal(np.asarray(got)[off], np.asarray(args[0])[off])


def test_no_counts_array_is_materialised():
    """``P x V x 4`` bytes is the dense counts array (1.6 GB at M3's V = 200,064 and 2,048 verify rows): the
    fused program's temporaries stay far below it; the dense version (control) needs at least that."""
    p, v, n, d = 256, 32768, 16, 7
    shapes = [((p, v), jnp.float32), ((n, v), jnp.int32), ((n, v), bool), ((p,), jnp.int32), ((p, d), jnp.int32),
              ((p,), jnp.int32)] + [((p,), jnp.float32)] * 4
    args = [jax.ShapeDtypeStruct(s, t) for s, t in shapes]
    dense_bytes = p * v * 4

    def temp(fn):
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    assert temp(penalize_at_reference) >= dense_bytes
    assert temp(penalize_at) < dense_bytes // 16
