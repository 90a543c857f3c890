"""`python -m normlab ...` is the `normlab` command (used by torchrun: `torchrun -m normlab train ...`)."""

import sys

from normlab.cli import main

sys.exit(main())
