"""``python -m orchestrator.lab.recovery``: see :mod:`orchestrator.lab.recovery.measure`."""

import sys

from orchestrator.lab.recovery.measure import main

sys.exit(main())
