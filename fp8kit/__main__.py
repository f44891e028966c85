"""`python -m fp8kit`: the same as the `fp8kit` command."""

import sys

from fp8kit.cli import main

sys.exit(main())
