"""Control messages from the synchroniser to a worker's control list, parsed in one place.

``start``  a new epoch of the batch: every participant drops what it holds and starts
           the requests ``reqs`` at step 0 (``resume`` when join.lua restarted them from
           their token logs; ``more`` when requests wait in line to join):
           ``{"op": "start", "epoch": E, "reqs": [R, ...][, "resume": true][, "more": true]}``
``step``   the verdicts of a finished step of the batch, one per request in it, the
           requests that join the batch in the next step, and whether more wait in line
           (protocol/sync/lua/arrive.lua): ``{"op": "step", "epoch", "step",
           "v": [[R, token, child, root, done], ...], "join": [R, ...][, "more": true]}``

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
    """Start a new epoch with the requests ``reqs``, each at its step 0."""

    epoch: int
    reqs: tuple[str, ...]
    resume: bool = False
    more: bool = False  # requests wait in line: the scheduler lets them join

    def to_json(self) -> dict[str, Any]:
        """The wire form, as start.lua / join.lua write it."""
        out: dict[str, Any] = {"op": "start", "epoch": self.epoch, "reqs": list(self.reqs)}
        if self.resume:
            out["resume"] = True
        if self.more:
            out["more"] = True
        return out


@dataclass(frozen=True)
class Step:
    """The verdicts of step ``step`` of the batch in ``epoch`` (request id -> verdict) and
    the requests joining at the next step."""

    epoch: int
    step: int
    verdicts: tuple[tuple[str, Verdict], ...] = ()
    join: tuple[str, ...] = ()
    more: bool = False  # requests still wait in line: the scheduler lets them join

    @property
    def goes_on(self) -> bool:
        """Whether the batch has a next step: a request still runs, one joins, or some
        wait in line (the scheduler decides at the next barrier)."""
        return bool(self.join) or self.more or any(not v.done for _, v in self.verdicts)

    def to_json(self) -> dict[str, Any]:
        """The wire form, as arrive.lua writes it."""
        out: dict[str, Any] = {
            "op": "step", "epoch": self.epoch, "step": self.step,
            "v": [[r, v.token, v.child, v.root, v.done] for r, v in self.verdicts],
            "join": list(self.join)}
        if self.more:
            out["more"] = True
        return out


Control = Start | Step


def _int(d: dict[str, Any], name: str, low: int) -> int:
    v = d.get(name)
    # JSON numbers from cjson may arrive as floats (e.g. 3.0); bools are not ints here
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if type(v) is not int or v < low:
        raise ControlError(f"control field {name!r} must be an int >= {low}, got {v!r}")
    return v


def _bool(d: dict[str, Any], name: str) -> bool:
    v = d.get(name, False)
    if not isinstance(v, bool):
        raise ControlError(f"control field {name!r} must be a bool, got {v!r}")
    return v


def _rid(v: Any, what: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ID_LEN:
        raise ControlError(f"control field {what!r} must hold request ids of 1..{MAX_ID_LEN} "
                           f"chars, got {v!r}")
    return v


def _list(d: dict[str, Any], name: str) -> list[Any]:
    v = d.get(name)
    # Redis's cjson writes an empty Lua table as {}: an empty list
    if v == {}:
        return []
    if not isinstance(v, list):
        raise ControlError(f"control field {name!r} must be a list, got {v!r}")
    return v


def _verdict(item: Any) -> tuple[str, Verdict]:
    if not isinstance(item, list) or len(item) != 5:
        raise ControlError(f"a verdict must be [req, token, child, root, done], got {item!r}")
    rid, token, child, root, done = item
    if not isinstance(done, bool):
        raise ControlError(f"control field 'done' must be a bool, got {done!r}")
    f = {"token": token, "child": child, "root": root}
    return _rid(rid, "v"), Verdict(_int(f, "token", -1), _int(f, "child", -1),
                                   _int(f, "root", -1), done)


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
        reqs = tuple(_rid(r, "reqs") for r in _list(d, "reqs"))
        return Start(_int(d, "epoch", 0), reqs, _bool(d, "resume"), _bool(d, "more"))
    if op == "step":
        verdicts = tuple(_verdict(x) for x in _list(d, "v"))
        join = tuple(_rid(r, "join") for r in _list(d, "join"))
        return Step(_int(d, "epoch", 0), _int(d, "step", 0), verdicts, join, _bool(d, "more"))
    raise ControlError(f"control op must be 'start' or 'step', got {op!r}")
