"""Exit statuses of the ``treepipe`` command, and the error that asks for the runtime one.

A usage error (a bad flag, file or manifest: the user's to fix) exits 2, like
argparse's own; a runtime failure (a pipeline that does not answer or did not
re-plan in time: worth retrying) exits 1.  Both print one line, never a traceback.
"""

from __future__ import annotations

from protocol.errors import TreepipeError

USAGE = 2
RUNTIME = 1


class RuntimeFailure(TreepipeError):
    """A command that was used right but failed at run time (exit status 1)."""


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
