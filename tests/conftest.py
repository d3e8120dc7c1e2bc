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

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import pallas_kernels.platform  # noqa: F401, E402  (installs the Triton deprecation filter)
