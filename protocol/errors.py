"""The project's one error base.

It lives in the lowest layer (``protocol/`` imports nothing else of the project)
so that device code, wire code and the control plane all derive from it, and the
command line catches it once in ``main`` and prints its message as one line.
"""

from __future__ import annotations


class TreepipeError(Exception):
    """A user-facing error whose message names the problem and the fix."""


class RuntimeFailure(TreepipeError):
    """A command used right that failed at run time: a pipeline or server that does not
    start, answer or re-plan in time. The ``treepipe`` command exits 1 on it (worth a
    retry), where any other :class:`TreepipeError` is the user's to fix and exits 2
    (orchestrator/cli/exits.py)."""
