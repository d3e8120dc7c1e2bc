"""Balanced routing (``MiniMaxM3Config.balanced_routing``, benchmarks with random weights): the round-robin
routes load every expert equally, and the MoE computes exactly the weighted sum of the experts it names."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minimax_jax.config import MiniMaxM3Config
from minimax_jax.layers import MoE, balanced_routes, swigluoai


def test_routes_are_balanced_and_distinct():
    for n, k, e in ((37, 4, 16), (64, 2, 4), (5, 3, 8)):
        w, ex = balanced_routes(n, k, e, 2.0, like=jnp.zeros((n, e)))
        ex = np.asarray(ex)
        assert all(len(set(row)) == k for row in ex)  # k distinct experts per token
        load = np.bincount(ex.ravel(), minlength=e)
        assert load.max() - load.min() <= 1
        np.testing.assert_allclose(np.asarray(w).sum(-1), 2.0, rtol=1e-6)


def test_moe_with_balanced_routing_is_the_sum_of_its_experts():
    cfg = MiniMaxM3Config.tiny(balanced_routing=True)
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (11, cfg.hidden_size), jnp.float32)
    got = np.asarray(moe(x))
    gu, dn = (np.asarray(a, np.float64) for a in moe.expert_params())
    k, e = cfg.num_experts_per_tok, cfg.num_local_experts
    want = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(k):
            ex = (t * k + j) % e
            h = np.asarray(swigluoai(jnp.asarray(np.asarray(x[t], np.float64) @ gu[ex]), alpha=cfg.swiglu_alpha,
                                     limit=cfg.swiglu_limit, beta=cfg.swiglu_beta))
            want[t] += cfg.routed_scaling_factor / k * (h @ dn[ex])
    want += np.asarray(moe.shared_experts(x), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
