"""scripts/hlo_report.py: the control computations of a compiled program, their kernels and copies."""
import jax
import jax.numpy as jnp

from scripts.hlo_report import hlo_text, report, shape_bytes


def test_shape_bytes_of_arrays_and_tuples():
    assert shape_bytes("bf16[2,8192,32,32]{3,2,1,0}") == 2 * 8192 * 32 * 32 * 2
    assert shape_bytes("(f32[4]{0}, s32[], pred[3]{0})") == 16 + 4 + 3
    assert shape_bytes("token[]") == 0


def test_a_loop_with_a_switch_reports_its_body_branches_and_copies():
    rng = jax.random.PRNGKey(0)
    n = int(jax.random.randint(rng, (), 64, 256))  # a fresh size: the copy's bytes follow it

    def f(x, big):
        def body(c):
            i, x, big = c
            y = jax.lax.switch(i % 3, [lambda b: b * 2, lambda b: b + 1, lambda b: b[::-1]], big)
            return i + 1, x + y.sum(), y
        return jax.lax.while_loop(lambda c: c[0] < 10, body, (0, x, big))

    compiled = jax.jit(f, donate_argnums=(1,)).lower(jnp.float32(1), jnp.ones((n, 1024))).compile()
    rows = report(hlo_text(compiled))
    roles = [r["role"] for r in rows]
    assert roles[0] == "entry" and rows[0]["depth"] == 0
    bodies = [r for r in rows if r["role"].endswith(": body")]
    conds = [r for r in rows if r["role"].endswith(": condition")]
    branches = [r for r in rows if ": branch " in r["role"]]
    assert len(bodies) == 1 and len(conds) == 1 and len(branches) == 3
    assert all(r["depth"] == 2 for r in branches) and bodies[0]["depth"] == 1
    assert bodies[0]["ops"].get("conditional") == 1
    assert all(r["launching_ops"] >= 1 for r in branches)
    # every copy listed is counted, and none is larger than the array the loop carries
    for r in rows:
        assert r["copies"] >= len(r["largest_copies"])
        assert all(c["bytes"] <= 4 * n * 1024 for c in r["largest_copies"])
