"""``python -m harness.gpucheck``: see :mod:`harness.gpucheck.orchestrate`."""

import sys

from harness.gpucheck.orchestrate import main

sys.exit(main())
