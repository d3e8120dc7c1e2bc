import sys

from spec_decode.cli import main

sys.exit(main())
