import sys

from minimax_jax.cli import main

sys.exit(main())
