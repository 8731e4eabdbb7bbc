"""`python -m specjax.cli ...`: the `specjax` command."""

import sys

from specjax.cli.command import main

sys.exit(main())
