"""scripts/bench_engine.py's arguments it refuses (exit 2, before any model loads), and its loads of a store's
executables one by one. Its start-up and throughput runs are the engine's own warm-up and ``generate``
(tests/test_engine_serving.py), timed on a GPU."""

import json

import jax
import jax.numpy as jnp
import numpy as np
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


def test_a_kept_cache_directory_must_start_empty(tmp_path, capsys):
    """--startup-cache-dir refuses a directory whose slot subdirectory holds files (the start-up would be warm),
    and a --load-store that is not a directory."""
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "leftover").write_text("x")
    for argv, message in ((["--startup", "8", "--startup-cache-dir", str(tmp_path)], "is not empty"),
                          (["--load-store", str(tmp_path / "missing")], "is not a directory")):
        with pytest.raises(SystemExit) as exit_info:
            bench_engine.main(["--out", str(tmp_path / "out"), *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_load_store_loads_each_executable_alone(tmp_path, capsys, no_persistent_cache):
    """--load-store: one row per stored executable (its size, its compiled images: one ELF object on the CPU,
    no PTX), slowest first, the slowest loaded twice; the loaded programs run. (Compiled with the suite's cache
    off: on a CPU an executable that cache served serialises without its code; the engine never stores one,
    ``executable_store.stores_cache_loads``.)"""
    from spec_decode.executable_store import ExecutableStore

    store = ExecutableStore(str(tmp_path / "executables"))
    x = jnp.arange(6.0)
    for i, fn in enumerate((jnp.sin, jnp.cos)):
        store.save(f"p{i}", jax.jit(fn).lower(x).compile())
    bench_engine.main(["--out", str(tmp_path / "out"), "--load-store", store.root])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(r["file"] for r in rows) == ["p0.exe", "p1.exe"]
    assert [r["load_s"] for r in rows] == sorted((r["load_s"] for r in rows), reverse=True)
    assert all(r["bytes"] == (tmp_path / "executables" / r["file"]).stat().st_size and r["elf_images"] >= 1
               and r["ptx_modules"] == 0 and r["load_s"] > 0 for r in rows)
    assert rows[0]["reload_s"] > 0 and "reload_s" not in rows[1]
    np.testing.assert_allclose(np.asarray(store.load("p1")(x)), np.cos(np.asarray(x)), rtol=1e-6)
