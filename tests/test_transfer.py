"""One vector each way (``spec_decode.transfer``): the device loop's inputs packed on the host and unpacked in a
jitted program, its outputs packed in the program and unpacked on the host, every bit kept; the layout the host
derives from the loop's configuration is the one the traced loop builds (CPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode.cost_table import CostTable, CostTableArrays
from spec_decode.device_loop import LoopConfig, LoopInputs, LoopOutputs, loop_outputs_layout, pack_loop_inputs
from spec_decode.step import StepConfig
from spec_decode.transfer import PackedLayout, pack_device, pack_host, unpack_device, unpack_host

STEEP = CostTable.from_measurements({8: 0.25, 16: 1.0, 32: 2.0, 64: 4.0})


def _draw(rng):
    """Random values of a leaf's dtype and shape: negative ints, floats with -0, infinities and NaN, booleans."""

    def draw(x):
        x = np.asarray(x) if not isinstance(x, jax.ShapeDtypeStruct) else np.zeros(x.shape, x.dtype)
        if x.dtype == np.bool_:
            return rng.random(x.shape) < 0.5
        if x.dtype == np.int32:
            return rng.integers(-2**31, 2**31 - 1, x.shape, dtype=np.int32)
        v = rng.standard_normal(x.shape).astype(np.float32)
        if v.size >= 4:
            v.flat[:4] = [-0.0, np.inf, -np.inf, np.nan]
        return v

    return draw


def _random_loop_inputs(rng, rows: int, stop_ids: int, blocks: int) -> LoopInputs:
    i, f = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
    template = LoopInputs(rows=i, block_tables=np.zeros((rows, blocks), np.int32), limit=i, temperature=f, top_k=i,
                          top_p=f, seed=i, stop_ids=np.zeros((rows, stop_ids), np.int32), max_steps=np.int32(0),
                          cost_table=CostTableArrays.from_table(STEEP), min_tokens=i, min_p=f,
                          repetition_penalty=f, presence_penalty=f, frequency_penalty=f, end_on_finish=np.bool_(0),
                          timing_branch=np.int32(0), timing_budget=np.int32(0), plan_interval=np.int32(0))
    return jax.tree.map(_draw(rng), template)


def _assert_same_tree(got, want):
    got_leaves, got_tree = jax.tree.flatten(got)
    want_leaves, want_tree = jax.tree.flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        if w.dtype == np.float32:  # bit for bit: -0.0 and NaN included
            np.testing.assert_array_equal(g.view(np.int32), w.view(np.int32))
        else:
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("rows, stop_ids, blocks, seed", [(1, 1, 1, 0), (8, 3, 5, 1), (13, 2, 7, 2)])
def test_loop_inputs_travel_to_the_device_in_one_vector(rows, stop_ids, blocks, seed):
    """Every array of a call's inputs comes back from the one int32 vector exactly (bits, dtype, shape), inside a
    jitted program as the loop unpacks it; a vector of another size or a leaf of another dtype is refused."""
    inputs = _random_loop_inputs(np.random.default_rng(seed), rows, stop_ids, blocks)
    layout = PackedLayout.of(inputs)
    packed = pack_loop_inputs(inputs)
    assert packed.dtype == np.int32 and packed.shape == (layout.size,)
    _assert_same_tree(jax.jit(lambda p: unpack_device(p, layout))(packed), inputs)
    with pytest.raises(ValueError, match=f"int32\\[{layout.size}\\]"):
        unpack_device(jnp.asarray(packed[:-1]), layout)
    with pytest.raises(TypeError, match="float64"):
        pack_host(dataclasses.replace(inputs, top_p=np.zeros(rows, np.float64)))


@pytest.mark.parametrize("rows, width, k, logprobs, seed", [(1, 1, 0, None, 0), (8, 24, 7, None, 1),
                                                           (5, 16, 3, 4, 2)])
def test_loop_outputs_travel_to_the_host_in_one_vector(rows, width, k, logprobs, seed):
    """The loop's outputs, packed in a jitted program by the layout the host derives from the loop's
    configuration, come back exactly; a tree of another layout is refused when the program is traced."""
    step = StepConfig(num_speculative_tokens=k, mode="adaptive" if k else "none", sampling=logprobs is not None)
    cfg = LoopConfig(step=step, rows=rows, output_len=width, draft_lengths=(k,), token_buckets=((64,),),
                     logit_rows=((8,),), max_total_logit_rows=8, num_stop_ids=2, max_blocks=3, logprobs=logprobs)
    layout = loop_outputs_layout(cfg)
    outputs = jax.tree.map(_draw(np.random.default_rng(seed)),
                           jax.tree.unflatten(layout.treedef, [jax.ShapeDtypeStruct(s, {"int32": np.int32,
                                                                                        "float32": np.float32,
                                                                                        "bool": np.bool_}[kind])
                                                               for s, kind in layout.leaves]))
    assert isinstance(outputs, LoopOutputs) and (outputs.top_ids is None) == (logprobs is None)
    packed = jax.jit(lambda o: pack_device(o, layout))(outputs)
    assert packed.dtype == jnp.int32 and packed.shape == (layout.size,)
    _assert_same_tree(unpack_host(np.asarray(packed), layout), outputs)
    wrong = dataclasses.replace(outputs, steps=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="layout"):
        jax.jit(lambda o: pack_device(o, layout))(wrong)
    with pytest.raises(ValueError, match=f"int32\\[{layout.size}\\]"):
        unpack_host(np.asarray(packed)[1:], layout)


def test_an_empty_tree_packs_to_an_empty_vector():
    layout = PackedLayout.of(())
    assert layout.size == 0 and pack_host(()).shape == (0,)
    assert unpack_host(np.asarray(jax.jit(pack_device)(())), layout) == ()
