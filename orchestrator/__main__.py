"""``python -m orchestrator``: the ``treepipe`` command (used to start pipeline processes)."""

import sys

from orchestrator.cli.main import main

sys.exit(main())
