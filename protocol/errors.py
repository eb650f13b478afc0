"""The project's one error base.

It lives in the lowest layer (``protocol/`` imports nothing else of the project)
so that device code, wire code and the control plane all derive from it, and the
command line catches it once in ``main`` and prints its message as one line.
"""

from __future__ import annotations


class TreepipeError(Exception):
    """A user-facing error whose message names the problem and the fix."""
