"""The DSpark drafter's context cache (SPEC section 6): per draft layer, the keys/values projected from the
target features of every context position, in one fixed-size buffer per request row.

Only context entries live here; a draft block's own keys/values are dropped after each step. Rollback is by
length: entries past ``lengths[r]`` are invisible and get overwritten by the next append
(:meth:`minimax_jax.drafter.DSparkDrafter.write_context`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minimax_jax.drafter_config import DSparkConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """Context keys/values of every draft layer, one fixed-size buffer per request row.

    ``k, v [L, R, S, H_kv, D]`` (slot ``j`` = absolute position ``j``; keys already normed and rotated) and
    ``lengths int32[R]``: slots ``< lengths[r]`` hold valid context. A padding row has length 0.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, cfg: DSparkConfig, num_requests: int, capacity: int, *, dtype=jnp.bfloat16) -> DraftCache:
        if num_requests < 1 or capacity < 1:
            raise ValueError(f"num_requests and capacity must be >= 1, got {num_requests}, {capacity}")
        c = cfg.layer_config
        shape = (c.num_hidden_layers, num_requests, capacity, c.num_key_value_heads, c.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((num_requests,), jnp.int32))

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_requests(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def rollback(self, lengths: jax.Array) -> DraftCache:
        """Shrink each row to ``min(lengths, current)``: entries beyond become invisible (and are overwritten by
        the next append)."""
        lengths = jnp.asarray(lengths, jnp.int32)
        if lengths.shape != self.lengths.shape:
            raise ValueError(f"lengths must be int32[R] with R = {self.num_requests}, got shape {lengths.shape}")
        return dataclasses.replace(self, lengths=jnp.minimum(self.lengths, jnp.maximum(lengths, 0)))
