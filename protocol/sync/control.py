"""Control messages from the synchroniser to a worker's control list, parsed in one place.

``start``  a request (or a restart of it under a new epoch; ``resume`` when join.lua
           restarted it): ``{"op": "start", "req": R, "epoch": E[, "resume": true]}``
``step``   the verdict of a finished step (protocol/sync/lua/arrive.lua):
           ``{"op": "step", "req", "epoch", "step", "token", "child", "root", "done"}``

The Lua scripts write them as JSON; :func:`parse_control` checks every field and
raises :class:`ControlError` with one line, so a garbage message is a logged,
dropped message rather than a worker crash.  No torch and no control-plane imports:
device code (stages/) and the synchroniser client both import this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protocol.errors import TreepipeError

MAX_ID_LEN = 128


class ControlError(TreepipeError, ValueError):
    """A control message that does not follow the schema; the message says which field."""


@dataclass(frozen=True)
class Verdict:
    """Outcome of one step: the verified token and how the tree follows it.

    ``token`` -1: nothing was verified this step.  ``child``: id of the root's child
    that carries ``token`` (a hit), -1 on a miss.  ``root``: the id the tree owner
    reserved for a new root, used on a miss (-1: take a fresh id).
    """

    token: int = -1
    child: int = -1
    root: int = -1
    done: bool = False

    @property
    def verified(self) -> bool:
        return self.token >= 0

    @property
    def hit(self) -> bool:
        return self.token >= 0 and self.child >= 0

    @property
    def miss(self) -> bool:
        return self.token >= 0 and self.child < 0


@dataclass(frozen=True)
class Start:
    """Start (or restart under a new epoch) request ``req``."""

    req: str
    epoch: int
    resume: bool = False

    def to_json(self) -> dict[str, Any]:
        """The wire form, as start.lua / join.lua write it."""
        out: dict[str, Any] = {"op": "start", "req": self.req, "epoch": self.epoch}
        if self.resume:
            out["resume"] = True
        return out


@dataclass(frozen=True)
class Step:
    """The verdict of step ``step`` of request ``req`` in ``epoch``."""

    req: str
    epoch: int
    step: int
    verdict: Verdict

    def to_json(self) -> dict[str, Any]:
        """The wire form, as arrive.lua writes it."""
        v = self.verdict
        return {"op": "step", "req": self.req, "epoch": self.epoch, "step": self.step,
                "token": v.token, "child": v.child, "root": v.root, "done": v.done}


Control = Start | Step


def _int(d: dict[str, Any], name: str, low: int) -> int:
    v = d.get(name)
    # JSON numbers from cjson may arrive as floats (e.g. 3.0); bools are not ints here
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if type(v) is not int or v < low:
        raise ControlError(f"control field {name!r} must be an int >= {low}, got {v!r}")
    return v


def _req(d: dict[str, Any]) -> str:
    req = d.get("req")
    if not isinstance(req, str) or not 0 < len(req) <= MAX_ID_LEN:
        raise ControlError(f"control field 'req' must be a request id of 1..{MAX_ID_LEN} chars, "
                           f"got {req!r}")
    return req


def parse_control(raw: bytes | str | dict[str, Any]) -> Control:
    """Parse and check one control message; raises ControlError on any bad field."""
    if isinstance(raw, dict):
        d = raw
    else:
        try:
            d = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ControlError(f"control message is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ControlError(f"control message must be a JSON object, got {type(d).__name__}")
    op = d.get("op")
    if op == "start":
        resume = d.get("resume", False)
        if not isinstance(resume, bool):
            raise ControlError(f"control field 'resume' must be a bool, got {resume!r}")
        return Start(_req(d), _int(d, "epoch", 0), resume)
    if op == "step":
        done = d.get("done")
        if not isinstance(done, bool):
            raise ControlError(f"control field 'done' must be a bool, got {done!r}")
        verdict = Verdict(_int(d, "token", -1), _int(d, "child", -1), _int(d, "root", -1), done)
        return Step(_req(d), _int(d, "epoch", 0), _int(d, "step", 0), verdict)
    raise ControlError(f"control op must be 'start' or 'step', got {op!r}")
