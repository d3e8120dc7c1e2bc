import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import pallas_kernels.platform  # noqa: F401, E402  (installs the Triton deprecation filter)
