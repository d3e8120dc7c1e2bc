"""``python -m minimax_jax`` is not the command line: the CLI imports the engine (``spec_decode``), which sits
above ``minimax_jax`` in the package layering."""

import sys

print("minimax-jax: error: the command line is 'minimax-jax' (or 'python -m spec_decode'); "
      "'python -m minimax_jax' cannot import the engine", file=sys.stderr)
sys.exit(2)
