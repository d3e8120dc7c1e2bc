import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# the engine turns the persistent compilation cache on by default; tests that need it set their own directory
os.environ.setdefault("MINIMAX_JAX_COMPILATION_CACHE", "0")
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # The suite is compile-bound on CPU: skipping LLVM's optimisation of XLA's CPU code takes about a third off
    # the compile time (and off the suite), and changes no result (no fast-math either way). CPU runs only: the
    # GPU tests keep optimised kernels.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import atexit  # noqa: E402
import contextlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One JAX persistent compilation cache for the whole run (CPU runs only), shared by the xdist workers (they inherit
# the environment of the process that starts them) and removed at its end. The suite builds many engines with the
# same programs, and on a CPU compiling them is most of its time. Tests that exercise the engine's own caches set
# MINIMAX_JAX_COMPILATION_CACHE=1 and a directory of their own in a subprocess; the tests that nothing compiles
# after warm-up count the programs this cache serves too (``compile_counter(cache_loads=True)``).
# ``MINIMAX_JAX_SUITE_CACHE=0`` runs the suite without it.
if (os.environ["JAX_PLATFORMS"] == "cpu" and os.environ["MINIMAX_JAX_COMPILATION_CACHE"] == "0"
        and os.environ.get("MINIMAX_JAX_SUITE_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")):
    if not os.environ.get("MINIMAX_JAX_SUITE_CACHE_DIR"):
        os.environ["MINIMAX_JAX_SUITE_CACHE_DIR"] = tempfile.mkdtemp(prefix="minimax-jax-suite-cache-")
        atexit.register(shutil.rmtree, os.environ["MINIMAX_JAX_SUITE_CACHE_DIR"], True)
    from spec_decode.compilation_cache import use_directory

    use_directory(os.environ["MINIMAX_JAX_SUITE_CACHE_DIR"])

import pallas_kernels.platform  # noqa: F401, E402  (installs the Triton deprecation filter)


@contextlib.contextmanager
def _persistent_cache(path):
    """JAX's persistent compilation cache in ``path`` (None: off) inside the block, the suite's after it."""
    from spec_decode.compilation_cache import use_directory

    before = jax.config.jax_compilation_cache_dir
    use_directory(path)
    try:
        yield path
    finally:
        use_directory(before)


@pytest.fixture
def no_persistent_cache():
    """The suite's shared compilation cache off for one test: one that compares a program's compiled text (the
    cache's key leaves locations out, so it may serve another lowering's executable), or that stores executables
    itself (on a CPU one the cache served serialises without its code)."""
    with _persistent_cache(None):
        yield


@pytest.fixture
def own_persistent_cache(tmp_path):
    """JAX's persistent compilation cache in a directory of the test's own; yields its path."""
    with _persistent_cache(str(tmp_path / "xla-cache")) as path:
        yield path
