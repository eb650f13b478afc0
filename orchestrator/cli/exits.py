"""Exit statuses of the ``treepipe`` command.

A usage error (a bad flag, file or manifest: the user's to fix) exits 2, like
argparse's own; a runtime failure (a pipeline that does not answer or did not
re-plan in time: worth retrying, a ``RuntimeFailure`` of protocol/errors.py)
exits 1.  Both print one line, never a traceback.
"""

from __future__ import annotations

USAGE = 2
RUNTIME = 1


def lost_redis(e: BaseException) -> str | None:
    """One line for a lost or unanswering Redis connection, None for anything else.

    Looked up by name so that the CLI's start-up does not import redis for commands
    that never talk to it.
    """
    names = {c.__module__ + "." + c.__name__ for c in type(e).__mro__}
    if not names & {"redis.exceptions.ConnectionError", "redis.exceptions.TimeoutError"}:
        return None
    if "redis.exceptions.AuthenticationError" in names:
        return None
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    return (f"the pipeline's Redis did not answer ({why}); it may be paused or restarting: "
            f"try again in a few seconds, or see the pipeline's redis.log")
