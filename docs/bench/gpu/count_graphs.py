"""Run a treepipe command and count what compiled execution did meanwhile: CUDA graphs
recorded (and the seconds that took) and dynamo graphs compiled. For telling a slow
compiled step (steady state) from one that keeps recording or recompiling
(docs/benchmarks.md, "Execution").

    python docs/bench/gpu/count_graphs.py bench --model ... --execution compiled ...
"""

from __future__ import annotations

import sys
import time

import stages.model.cuda_graphs as cuda_graphs
from orchestrator.cli.main import main

counts = {"recorded": 0, "record_s": 0.0}
_record = cuda_graphs._Graph.__init__


def _counted_record(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    _record(self, *args, **kwargs)
    counts["recorded"] += 1
    counts["record_s"] += time.perf_counter() - t


cuda_graphs._Graph.__init__ = _counted_record  # type: ignore[method-assign]

if __name__ == "__main__":
    rc = main(sys.argv[1:])
    try:
        from torch._dynamo.utils import counters
        graphs = counters["stats"]["unique_graphs"]
    except ImportError:
        graphs = -1
    print(f"cuda graphs recorded {counts['recorded']} ({counts['record_s']:.2f} s), "
          f"dynamo graphs {graphs}", file=sys.stderr)
    sys.exit(rc)
