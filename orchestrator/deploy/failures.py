"""The error of a command used right that failed at run time.

Raised by the launcher (a pipeline that does not start, answer or re-plan in time);
the ``treepipe`` command maps it to exit status 1, worth retrying, where any other
:class:`~protocol.errors.TreepipeError` is the user's to fix (orchestrator/cli/exits.py).
"""

from __future__ import annotations

from protocol.errors import TreepipeError


class RuntimeFailure(TreepipeError):
    """A command that was used right but failed at run time (exit status 1)."""
