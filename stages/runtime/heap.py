"""Keep Python's cycle collector out of the step times of a loaded process.

A process that has imported torch and loaded SmolLM2 holds some 326,000 objects that
live as long as it does. Python's full (generation-2) collection walks all of them: on
this 2-core machine each one took 169-209 ms, and in a lockstep benchmark one landed
inside a timed step about once in a thousand steps. Besides the latency spike (a p99
TBT), it fell on whichever run allocated when the threshold tripped, so a lockstep
benchmark charged one run with a pause that was not its work (a 168 ms one, in the
adaptive width run). Frozen, a full collection takes about 0 ms.
"""

from __future__ import annotations

import gc


def settle_heap() -> int:
    """Collect what is garbage now, then freeze every survivor out of the collector's
    reach (:func:`gc.freeze`); later full collections walk only objects made after this
    call. Call once a process has loaded what it serves with (and again after more
    long-lived state, e.g. between benchmark groups). Returns the frozen count."""
    gc.collect()  # first, so that no garbage is frozen (frozen cycles are never freed)
    gc.freeze()
    return gc.get_freeze_count()
