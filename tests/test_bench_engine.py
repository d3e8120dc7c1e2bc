"""scripts/bench_engine.py's arguments it refuses (exit 2, before any model loads). Its start-up and throughput
runs are the engine's own warm-up and ``generate`` (tests/test_engine_serving.py), timed on a GPU."""

import pytest

from scripts import bench_engine


@pytest.mark.parametrize("argv, message", [
    (["--startup", "8", "--startup-profile", "--startup-trace"], "give one"),
    (["--draft-lengths", "0,3,9"], "must lie in [0, K=7]"),
])
def test_bad_arguments_are_refused_before_any_model_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_engine.main(["--out", "/nonexistent/never_written", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
