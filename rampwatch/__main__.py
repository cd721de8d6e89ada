"""`python -m rampwatch …`: the same as the `rampwatch` command (rampwatch/cli.py)."""

import sys

from rampwatch.cli import main

sys.exit(main())
