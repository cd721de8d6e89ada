"""`python -m trainer train …` from a checkout: the same as `rampwatch train …`."""

import sys

from rampwatch.cli import main

sys.exit(main())
