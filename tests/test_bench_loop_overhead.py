"""scripts/bench_loop_overhead.py's parts that need no GPU: the shapes each branch is timed in, and the arguments
it refuses (exit 2, before any model loads). The timing runs themselves are the engine's
(``Engine._loop_branch_timer``, tested in tests/test_device_loop.py)."""

import pytest

from scripts import bench_loop_overhead


def test_each_branch_is_timed_full_in_its_tail_and_at_the_live_counts_asked():
    # 3/128 at 64 slots: 64 slots full, 32 slots drafting 3 each fill it, and the asked counts below it
    assert bench_loop_overhead.shapes(3, 128, 64, (4, 8, 32, 64, 100)) == [
        ("full", 64), ("tail", 32), ("live 4", 4), ("live 8", 8)]
    # a count equal to the tail's is timed once; length 0 has no tail
    assert bench_loop_overhead.shapes(3, 32, 64, (4, 8)) == [("full", 32), ("tail", 8), ("live 4", 4)]
    assert bench_loop_overhead.shapes(0, 64, 64) == [("full", 64)]


@pytest.mark.parametrize("argv, message", [
    (["--modes", "adaptive@9"], "draft lengths in"),
    (["--modes", "none"], "need a speculative engine"),
    (["--main-branch", "3-256"], "DRAFT_LENGTH/TOKENS"),
    (["--live", "8"], "--live goes with --contexts"),
    (["--contexts", "112", "--live", "0"], "--live counts must lie in"),
    (["--contexts", "112", "--live", "600"], "--live counts must lie in"),
    (["--contexts", "441"], "does not leave a step's 8 positions"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--sampling-loop", "--contexts", "112"], "separate runs"),
    (["--contexts", "112", "--main-branch", "3/256"], "go with the forced-branch timing"),
    (["--sampling-loop", "--dump-hlo", "/tmp/x"], "go with the forced-branch timing"),
    (["--sampling-loop", "--modes", "adaptive@3,7"], "one draft length per mode"),
    (["--contexts", "112", "--trace-calls", "4"], "--trace-calls goes with the forced-branch timing"),
    (["--trace-calls", "-1"], "--trace-calls must be at least 0"),
])
def test_bad_arguments_are_refused_before_any_model_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_loop_overhead.main(["--out", "/nonexistent/never_written.json", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
