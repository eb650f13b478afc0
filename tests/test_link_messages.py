"""protocol/links/messages.py: every request's part of a hop in one frame, checked."""

from __future__ import annotations

import pytest
import torch

from protocol.links import frames
from protocol.links.frames import FrameError, Message
from protocol.links.messages import FRAME_KIND, MAX_PARTS, Nodes, encode, parse

DIM = 4
E = torch.zeros(0, dtype=torch.long)


def wire(kind: str, meta: dict, tensors: dict) -> Message:
    """Through the real frame codec, as an inbox receives it."""
    return Message(*frames.decode([bytes(b) for b in frames.encode(kind, meta, tensors)]))


def hidden(req: str, step: int, ids: list[int]) -> Nodes:
    t = torch.tensor(ids, dtype=torch.long)
    return Nodes("hidden", req, 2, step, t, t - 1, t + 100,
                 torch.arange(len(ids) * DIM, dtype=torch.float32).reshape(-1, DIM) + step)


def test_parts_come_back_as_sent() -> None:
    sent = [hidden("a", 3, [4, 5, 9]), hidden("b", 1, []),
            Nodes("prefill", "c", 2, 0, E, E, E, torch.ones(5, DIM)), hidden("d", 7, [1])]
    got = parse(wire(*encode(sent)), DIM, torch.float32)
    assert [(n.kind, n.req, n.epoch, n.step, len(n), n.rows()) for n in got] == [
        ("hidden", "a", 2, 3, 3, 3), ("hidden", "b", 2, 1, 0, 0), ("prefill", "c", 2, 0, 0, 5),
        ("hidden", "d", 2, 7, 1, 1)]
    for s, g in zip(sent, got, strict=True):
        assert torch.equal(s.ids, g.ids) and torch.equal(s.parents, g.parents)
        assert torch.equal(s.tokens, g.tokens) and torch.equal(s.x, g.x)


def test_levels_carry_no_hidden_states() -> None:
    t = torch.tensor([3, 4])
    kind, meta, tensors = encode([Nodes("level", "a", 0, 1, t, t - 3, t),
                                  Nodes("level", "b", 0, 2, t[:1], t[:1] - 4, t[:1])])
    assert "x" not in tensors
    got = parse(wire(kind, meta, tensors), DIM, torch.float32)
    assert [(n.req, len(n), n.x) for n in got] == [("a", 2, None), ("b", 1, None)]


def exit_part(req: str, ids: list[int], k: int = 3) -> Nodes:
    """Stage J's early-exit candidates for nodes ``ids`` (miss recovery's token channel)."""
    t = torch.tensor(ids, dtype=torch.long)
    cand = torch.arange(len(ids) * k, dtype=torch.long).reshape(-1, k) + 7
    return Nodes("exit", req, 1, 4, t, t - 1, t + 100, None, cand,
                 torch.full((len(ids), k), 0.25))


def test_exit_candidates_come_back_as_sent() -> None:
    sent = [exit_part("a", [4, 5]), exit_part("b", []), exit_part("c", [9])]
    kind, meta, tensors = encode(sent)
    assert "x" not in tensors and tensors["cand"].shape == (3, 3)
    got = parse(wire(kind, meta, tensors), DIM, torch.float32)
    for s, g in zip(sent, got, strict=True):
        assert (g.kind, g.req, len(g), g.rows(), g.x) == ("exit", s.req, len(s), 0, None)
        assert torch.equal(s.ids, g.ids) and torch.equal(s.cand, g.cand)
        assert torch.equal(s.cand_p, g.cand_p)


def _bad_exits() -> list[tuple[str, Message]]:
    kind, meta, tensors = encode([exit_part("a", [1, 2])])

    def with_tensors(**changed: torch.Tensor) -> Message:
        return wire(kind, meta, {**tensors, **changed})

    return [
        ("exit part carries candidates, not", wire(kind, {"parts": [["a", "exit", 1, 4, 2, 2]]},
                                                   tensors)),
        ("needs tensors", wire(kind, meta, {k: v for k, v in tensors.items() if k != "cand_p"})),
        ("'cand' must be int64 \\[2, K\\]", with_tensors(cand=tensors["cand"][:1])),
        ("'cand' must be int64", with_tensors(cand=tensors["cand"].float())),
        ("'cand_p' must be float32", with_tensors(cand_p=tensors["cand_p"].double())),
        ("probabilities in \\[0, 1\\]", with_tensors(cand_p=tensors["cand_p"] * float("nan"))),
        ("token ids >= 0", with_tensors(cand=-tensors["cand"])),
    ]


@pytest.mark.parametrize(("why", "msg"), _bad_exits(), ids=[w for w, _ in _bad_exits()])
def test_a_bad_exit_part_is_refused_in_one_line(why: str, msg: Message) -> None:
    with pytest.raises(FrameError, match=why) as e:
        parse(msg, DIM, torch.float32)
    assert "\n" not in str(e.value)


def _bad() -> list[tuple[str, Message]]:
    one = hidden("a", 1, [1])
    kind, meta, tensors = encode([one])

    def with_parts(parts: list) -> Message:
        return wire(kind, {"parts": parts}, tensors)

    return [
        ("is not 'nodes'", wire("hidden", meta, tensors)),
        ("must list 1..", with_parts([])),
        ("must list 1..", with_parts([["a", "hidden", 2, 1, 1, 1]] * (MAX_PARTS + 1))),
        ("must be \\[request", with_parts([["a", "hidden", 2, 1, 1]])),
        ("id string", with_parts([["", "hidden", 2, 1, 1, 1]])),
        ("part kind 'halt'", with_parts([["a", "halt", 2, 1, 1, 1]])),
        ("step must be a non-negative int", with_parts([["a", "hidden", 2, -1, 1, 1]])),
        ("epoch must be a non-negative int", with_parts([["a", "hidden", True, 1, 1, 1]])),
        ("level part carries no", with_parts([["a", "level", 2, 1, 1, 1]])),
        ("1 rows for 2 nodes", with_parts([["a", "hidden", 2, 1, 2, 1]])),
        ("prefill part carries rows, not nodes", with_parts([["a", "prefill", 2, 1, 1, 1]])),
        ("needs tensors", wire(kind, meta, {k: v for k, v in tensors.items() if k != "x"})),
        ("has 1 entries, the parts 2 nodes",
         with_parts([["a", "hidden", 2, 1, 1, 1], ["b", "level", 2, 1, 1, 0]])),
        ("must be torch.float32 \\[2, 4\\]",
         with_parts([["a", "hidden", 2, 1, 1, 1], ["b", "prefill", 2, 1, 0, 1]])),
        ("strictly increasing", wire(*encode([hidden("a", 1, [5, 3])]))),
        ("two parts name the same", wire(*encode([hidden("a", 1, [1]), hidden("a", 1, [2])]))),
        ("NaN or inf", wire(*encode([Nodes("prefill", "a", 0, 0, E, E, E,
                                           torch.full((1, DIM), float("nan")))]))),
        ("1-D int64", wire(kind, meta, {**tensors, "ids": tensors["ids"].int()})),
    ]


@pytest.mark.parametrize(("why", "msg"), _bad(), ids=[w for w, _ in _bad()])
def test_a_bad_frame_is_refused_in_one_line(why: str, msg: Message) -> None:
    with pytest.raises(FrameError, match=why) as e:
        parse(msg, DIM, torch.float32)
    assert "\n" not in str(e.value)


def test_the_frame_kind_is_the_only_one() -> None:
    assert encode([hidden("a", 1, [1])])[0] == FRAME_KIND
