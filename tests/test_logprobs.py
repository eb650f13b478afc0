"""Logprobs without a pipeline: the wire form and its checks, the last stage's
computation, the sampling parameter, the barrier (a real Redis) and the gateway's check.

The served path (chat, completions, streams and gRPC against a running pipeline, equal
to teacher forcing) is in tests/test_openai_api.py.
"""

from __future__ import annotations

import json
import re
import types
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch

from orchestrator.serving.runner import RequestError, RequestRunner
from protocol.requests.logprobs import (
    LOGPROB_FLOOR,
    MAX_WIRE_CHARS,
    LogprobsError,
    TokenLogprobs,
)
from protocol.requests.sampling_params import SamplingError, SamplingParams
from protocol.sync.synchroniser import Report, Synchroniser
from stages.model.sampling import choose_token, token_logprobs
from stages.runtime.worker import _verified
from tests.test_sync import admitted


@pytest.fixture
def sync(redis_url: str) -> Iterator[Synchroniser]:
    s = Synchroniser(redis_url, f"l{uuid.uuid4().hex[:8]}")
    yield s
    s.close()


def test_wire_round_trip() -> None:
    lp = TokenLogprobs(-0.25, ((3, -0.25), (7, -1.5), (1, -1.5)))
    assert TokenLogprobs.from_wire(lp.to_wire(), 3, 64) == lp
    assert TokenLogprobs.from_wire(TokenLogprobs(-2.0).to_wire(), 0, 64) == TokenLogprobs(-2.0)
    # -inf (a raw logit of -inf) is vLLM's floor: the JSON stays standard
    assert json.loads(TokenLogprobs(float("-inf")).to_wire()) == [LOGPROB_FLOOR]


@pytest.mark.parametrize(("raw", "want", "says"), [
    ("nope", 0, "not JSON"),
    ('{"a": 1}', 0, "not [logprob"),
    ("[-1, 2]", 1, "not [logprob"),
    ("[-1, 2, -1]", 2, "1 alternatives, the request asked for 2"),
    ("[-1, 64, -1]", 1, "token id 64 outside [0, 64)"),
    ("[-1, true, -1]", 1, "token id True"),
    ("[0.5]", 0, "logprob 0.5 outside"),
    ('["x"]', 0, "logprob 'x'"),
    ("[-1, 2, -3, 4, -1]", 2, "not sorted"),
    ("[" + "0," * MAX_WIRE_CHARS + "0]", 0, "characters"),
], ids=["json", "object", "even", "count", "vocab", "bool-id", "positive", "string",
        "unsorted", "long"])
def test_wire_refuses_malformed_entries(raw: str, want: int, says: str) -> None:
    with pytest.raises(LogprobsError, match=re.escape(says)):
        TokenLogprobs.from_wire(raw, want, 64)


def test_token_logprobs_are_the_raw_log_softmax() -> None:
    """float32 log_softmax of the row as given (no temperature, no penalties); top-k most
    likely first, ties by lower id."""
    logits = torch.tensor([1.0, 3.0, 3.0, -2.0, 0.5], dtype=torch.float64)
    ref = torch.log_softmax(logits.to(torch.float32), -1)
    got = token_logprobs(logits, 3, 3)
    assert got.logprob == pytest.approx(float(ref[3]))
    assert [t for t, _ in got.top] == [1, 2, 0]
    assert [v for _, v in got.top] == pytest.approx([float(ref[1]), float(ref[2]),
                                                      float(ref[0])])
    assert token_logprobs(logits, 0, 0).top == ()


def test_asking_changes_no_token() -> None:
    """The last stage's report: the same token with or without logprobs; only a request
    that asked carries them."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for sp in (SamplingParams(), SamplingParams(0.9, 0.9, 8, 5, presence_penalty=1.0)):
        token = choose_token(logits, sp, [1, 2], [3])
        plain = _verified(logits, token, "", sp)
        asked = _verified(logits, token, "", SamplingParams(**{**sp.__dict__, "logprobs": 4}))
        assert plain.token == asked.token == token and plain.logprobs is None
        assert asked.logprobs == token_logprobs(logits, token, 4)


def test_sampling_parameter_bounds_and_wire() -> None:
    assert "logprobs" not in SamplingParams().to_wire()  # the wire of the others is unchanged
    for k in (0, 20):
        sp = SamplingParams(logprobs=k)
        assert SamplingParams.from_wire(sp.to_wire()) == sp
    for bad in (-1, 21, True, 1.5, "3"):
        with pytest.raises(SamplingError) as e:
            SamplingParams(logprobs=bad)  # type: ignore[arg-type]
        assert e.value.field == "logprobs"
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams.from_wire({"logprobs": "x"})


def test_barrier_puts_logprobs_on_the_commit_event(sync: Synchroniser) -> None:
    """The last stage's entry rides its token's commit event as 'lp', unread; a report
    without one (or without a token) adds none."""
    rid, e = admitted(sync)
    lp = TokenLogprobs(-0.5, ((9, -0.5),))
    sync.arrive(e, 1, "draft", {rid: Report(root_id=50)})
    sync.arrive(e, 1, "stage0", {rid: Report()})
    assert sync.arrive(e, 1, "stage1", {rid: Report(token=9, logprobs=lp)}) == "GO"
    sync.arrive(e, 2, "stage1", {rid: Report(token=11)})
    evs = [ev for _, ev in sync.events(rid, "0", 0) if "tok" in ev]
    assert [ev.get("lp") for ev in evs] == [lp.to_wire(), None]
    assert TokenLogprobs.from_wire(evs[0]["lp"], 1, 64) == lp
    assert sync.request(rid).log == [9, 11]  # the token log holds tokens only


def test_barrier_drops_a_malformed_entry(sync: Synchroniser) -> None:
    """A non-string or over-long entry is left off the event (the gateway then names
    the token's logprobs missing); the token is committed all the same."""
    rid, e = admitted(sync)
    keys = [sync.key("epoch"), sync.key("batch"), sync.key("joining"),
            sync.key("bar", e, 1), sync.key("participants")]
    for worker, lps in (("draft", {rid: [1, 2]}), ("stage0", "not json"),
                        ("stage1", {rid: "x" * (MAX_WIRE_CHARS + 1)})):
        token = 9 if worker == "stage1" else -1
        sync._arrive(keys=keys, args=[e, 1, worker, sync.ctl_prefix, sync.ttl_s, 0,
                                      sync.req_key(""), json.dumps({rid: [token, -1, ""]}),
                                      "[]", json.dumps(lps)])
    (ev,) = [ev for _, ev in sync.events(rid, "0", 0) if "tok" in ev]
    assert ev["tok"] == "9" and "lp" not in ev


def test_gateway_names_missing_or_bad_logprobs() -> None:
    """A commit event without its logprobs, or with a malformed entry, ends the request
    with INTERNAL naming the token: one line, no traceback."""
    runner = types.SimpleNamespace(vocab=64)
    good = TokenLogprobs(-1.0, ((2, -1.0),))
    assert RequestRunner._logprobs(runner, {"tok": "2", "i": "0", "lp": good.to_wire()},  # type: ignore[arg-type]
                                   1) == good
    for ev, says in (({"tok": "2", "i": "4"}, "token 4: no logprobs came with it"),
                     ({"tok": "2", "i": "5", "lp": "[1]"}, "token 5: logprob 1 outside")):
        with pytest.raises(RequestError) as e:
            RequestRunner._logprobs(runner, ev, 0)  # type: ignore[arg-type]
        assert e.value.code == grpc.StatusCode.INTERNAL and says in str(e.value)
