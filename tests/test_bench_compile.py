"""scripts/bench_compile.py's parts that need no GPU: naming a program by its StepKey repr, and counting the
Pallas kernel calls of a lowered module (distinct kernels once each)."""

import pytest

from scripts import bench_compile
from spec_decode.buckets import StepKey


def test_a_step_key_repr_names_its_program():
    key = StepKey(tokens=64, logit_rows=48, sampling=True, draft_len=7)
    assert bench_compile.parse_step_key(repr(key)) == key
    assert bench_compile.parse_step_key(repr(StepKey(8, 8))) == StepKey(8, 8)
    with pytest.raises(SystemExit, match="not a program name"):
        bench_compile.parse_step_key("loop-greedy")


def test_pallas_calls_are_counted_and_told_apart():
    call = ('    %{0} = stablehlo.custom_call @__gpu$xla.gpu.triton(%{1}, %arg2) {{backend_config = {{grid_x = {2} : '
            'i32, ir = "kernel"}}}} : (tensor<8xf32>) -> tensor<8xf32>')
    text = "\n".join([call.format(3, 1, 4), call.format(7, 5, 4),  # the same kernel twice (other SSA names)
                      call.format(9, 8, 16),  # another grid: another kernel
                      "    %10 = stablehlo.add %9, %9 : tensor<8xf32>"])
    stats = bench_compile.module_stats(text)
    assert stats["triton_calls"] == 3 and stats["triton_distinct"] == 2 and stats["module_chars"] == len(text)


def test_draft_lengths_are_parsed_sorted_and_distinct():
    """``--draft-lengths`` of the start-up and compile benches (and ``bench_e2e.py``'s ``adaptive@...`` modes)."""
    import argparse

    from scripts.bench_common import draft_lengths_arg, mode_settings

    assert draft_lengths_arg("0,3,7") == (0, 3, 7)
    assert draft_lengths_arg("7, 3,3,") == (3, 7)
    for bad in ("", ",", "3,x", "-1,3"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers"):
            draft_lengths_arg(bad)
    assert mode_settings("adaptive@3,0", 7)["draft_lengths"] == (0, 3)
    with pytest.raises(ValueError, match="draft lengths in"):
        mode_settings("adaptive@3,9", 7)
    with pytest.raises(ValueError, match="draft lengths in"):
        mode_settings("adaptive@x", 7)
