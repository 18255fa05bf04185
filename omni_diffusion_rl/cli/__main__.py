"""`python -m omni_diffusion_rl.cli`: the `odrl` console script."""

import sys

from .main import entry

sys.exit(entry())
