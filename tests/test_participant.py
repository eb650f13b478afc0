"""A worker's input wait on a real link and a real Redis: early messages are kept.

A peer that saw a new epoch's (or a new request's) control message first may send
its link message before this worker has left the old step.  Dropping that message
lost the new epoch's prefill and stalled the request until the input timeout
(seen as 60 s waits in the runtime tests and after a restart under load).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from orchestrator.deploy.redis_server import RedisServer, free_port
from protocol.links.messages import Nodes
from protocol.links.transport import Outbox, open_inbox, open_outbox
from protocol.sync.synchroniser import Synchroniser
from stages.runtime.participant import EARLY_MAX, EARLY_REQUESTS, Interrupted, Participant

DIM = 8


@pytest.fixture(params=["zmq", "grpc"])
def link(request: pytest.FixtureRequest) -> Iterator[tuple[Participant, Outbox]]:
    server = RedisServer().start()
    addr = f"127.0.0.1:{free_port()}"
    inbox = open_inbox(request.param, addr)
    outbox = open_outbox(request.param, addr)
    sync = Synchroniser(server.url, f"p{uuid.uuid4().hex[:6]}")
    # a long input timeout: only the control message may end a wait in these tests
    worker = Participant("stage1", sync, inbox, input_timeout_s=30.0)
    worker.dim, worker.dtype = DIM, torch.float32
    try:
        yield worker, outbox
    finally:
        outbox.close()
        inbox.close()
        sync.close()
        server.stop()


EMPTY = torch.zeros(0, dtype=torch.long)


def prefill(req: str, epoch: int, step: int, rows: int, value: float) -> Nodes:
    return Nodes("prefill", req, epoch, step, EMPTY, EMPTY, EMPTY,
                 torch.full((rows, DIM), value))


def send_prefill(outbox: Outbox, req: str, epoch: int, rows: int = 3) -> None:
    outbox.send_nodes([prefill(req, epoch, 0, rows, float(epoch))])


def test_newer_epoch_message_waits_for_its_epoch(link: tuple[Participant, Outbox]) -> None:
    worker, outbox = link
    worker.epoch = 0
    send_prefill(outbox, "r1", 0)
    assert worker.expect("r1", "prefill", 0).epoch == 0
    # the peer moved to epoch 1 first: its prefill arrives while this worker waits in 0
    send_prefill(outbox, "r1", 1)
    time.sleep(0.2)
    worker.sync.r.rpush(worker.sync.key("ctl", worker.name), "{}")  # epoch 1's start
    with pytest.raises(Interrupted):
        worker.expect("r1", "hidden", 1)
    assert worker.sync.epoch() == 0  # the control message ended it, not the timeout path
    worker.epoch = 1
    got = worker.expect("r1", "prefill", 0)
    assert (got.req, got.epoch, got.step) == ("r1", 1, 0)
    assert float(got.x[0, 0]) == 1.0 and not worker.early


def test_next_request_message_is_kept_and_old_epochs_dropped(
        link: tuple[Participant, Outbox]) -> None:
    worker, outbox = link
    worker.epoch = 2
    send_prefill(outbox, "r1", 1)  # an older epoch of this request: dropped
    send_prefill(outbox, "r2", 2)  # another request of the step (or the next one): kept
    time.sleep(0.2)  # both are in the inbox before the control message
    worker.sync.r.rpush(worker.sync.key("ctl", worker.name), "{}")
    with pytest.raises(Interrupted):
        worker.expect("r1", "prefill", 0)
    assert worker.sync.epoch() == 0
    assert [(n.req, n.epoch) for n in worker.early] == [("r2", 2)]
    worker.sync.r.delete(worker.sync.key("ctl", worker.name))
    assert worker.expect("r2", "prefill", 0).req == "r2"


def send_chunk(outbox: Outbox, req: str, epoch: int, chunk: int) -> None:
    outbox.send_nodes([prefill(req, epoch, chunk, 2, float(chunk))])


def test_a_chunk_ahead_of_its_turn_is_kept(link: tuple[Participant, Outbox]) -> None:
    """Pipelined prefill: the next chunk may arrive before the one awaited (a reconnected
    stream); it is kept for its step, not dropped into an input timeout."""
    worker, outbox = link
    worker.epoch = 0
    send_chunk(outbox, "r1", 0, 1)
    send_chunk(outbox, "r1", 0, 0)
    assert float(worker.expect("r1", "prefill", 0).x[0, 0]) == 0.0
    assert [(n.req, n.step) for n in worker.early] == [("r1", 1)]
    assert float(worker.expect("r1", "prefill", 1).x[0, 0]) == 1.0


def test_an_ended_requests_messages_are_dropped(link: tuple[Participant, Outbox]) -> None:
    """A request cancelled mid-prefill: the chunks kept for it, and those still on their
    way, are dropped (a chunk is chunk x dim large); a newer epoch's are kept."""
    worker, outbox = link
    worker.epoch = 0
    send_chunk(outbox, "gone", 0, 2)
    send_chunk(outbox, "gone", 1, 0)  # a peer that started epoch 1 first
    send_chunk(outbox, "r1", 0, 0)
    assert worker.expect("r1", "prefill", 0).req == "r1"
    assert [(n.req, n.epoch) for n in worker.early] == [("gone", 0), ("gone", 1)]
    worker._finish("gone")
    assert [(n.req, n.epoch) for n in worker.early] == [("gone", 1)]
    send_chunk(outbox, "gone", 0, 3)  # still on its way when it ended
    send_chunk(outbox, "r2", 0, 0)
    assert worker.expect("r2", "prefill", 0).req == "r2"
    assert [(n.req, n.epoch) for n in worker.early] == [("gone", 1)]


def test_one_frame_carries_every_requests_part(link: tuple[Participant, Outbox]) -> None:
    """A peer sends the whole step's hop in one frame: the awaited part is returned, the
    other requests' parts are kept for the calls that ask for them (no second frame),
    and an older epoch's part in it is dropped."""
    worker, outbox = link
    worker.epoch = 1
    outbox.send_nodes([prefill("r1", 1, 0, 2, 1.0), prefill("old", 0, 0, 1, 9.0),
                       prefill("r2", 1, 0, 3, 2.0), prefill("r3", 1, 0, 1, 3.0)])
    got = worker.expect("r2", "prefill", 0)
    assert (got.req, list(got.x.shape), float(got.x[0, 0])) == ("r2", [3, DIM], 2.0)
    assert [n.req for n in worker.early] == ["r1", "r3"]
    assert worker.inbox.recv(0.2) is None  # nothing more came
    assert float(worker.expect("r3", "prefill", 0).x[0, 0]) == 3.0
    assert float(worker.expect("r1", "prefill", 0).x[0, 0]) == 1.0 and not worker.early


def test_stray_parts_of_a_frame_are_logged_once(link: tuple[Participant, Outbox],
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Parts of the awaited request and step but of another kind (a buggy peer): dropped
    with one warning for the frame, and the awaited part still comes through."""
    worker, outbox = link
    worker.epoch = 0
    one = torch.tensor([1])
    outbox.send_nodes([Nodes("level", "r1", 0, 0, one, one - 2, one),
                       Nodes("hidden", "r1", 0, 0, one, one - 2, one, torch.ones(1, DIM)),
                       prefill("r1", 0, 0, 2, 5.0)])
    with caplog.at_level("WARNING", logger="treepipe.worker"):
        got = worker.expect("r1", "prefill", 0)
    assert float(got.x[0, 0]) == 5.0 and not worker.early
    warned = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert warned == ["stage1: dropped 2 part(s) of r1 (level 0, hidden 0) while expecting "
                      "prefill for step 0"]


def test_early_messages_are_bounded(link: tuple[Participant, Outbox]) -> None:
    worker, outbox = link
    worker.epoch = 0
    # a few per request: a whole batch's prefills are kept, not only the last few
    for i in range(EARLY_MAX + 3):
        send_prefill(outbox, f"other{i}", 0)
    for _ in range(EARLY_MAX + 2):
        send_prefill(outbox, "same", 0)
    send_prefill(outbox, "r1", 0)
    assert worker.expect("r1", "prefill", 0).req == "r1"
    assert [n.req for n in worker.early] == [f"other{i}" for i in range(EARLY_MAX + 3)] + \
        ["same"] * EARLY_MAX
    # and a bounded number of requests: the oldest go first
    worker.early = []
    for i in range(EARLY_REQUESTS + 2):
        send_prefill(outbox, f"many{i}", 0)
    send_prefill(outbox, "r1", 0)
    assert worker.expect("r1", "prefill", 0).req == "r1"
    assert [n.req for n in worker.early] == [f"many{i}" for i in range(2, EARLY_REQUESTS + 2)]


def test_worker_of_another_plan_does_not_take_part(link: tuple[Participant, Outbox]) -> None:
    """Hidden sizes match across layouts, so only the plan check keeps a stage of an old
    layout from computing (wrong layers) in the new layout's epoch."""
    worker, _ = link
    sync = worker.sync
    sync.register(["draft", "stage0", "stage1"])
    sync.r.set(sync.key("plan"), "B")
    sync.submit("r1", [1, 2, 3], {}, 8, [])
    st = sync.request("r1")
    worker.epoch, worker.layout_id = st.epoch, "A"
    assert not worker.takes_part(st)
    worker.layout_id = "B"
    assert worker.takes_part(st) and st.layout_id == "B"
    worker.epoch = st.epoch - 1  # a worker still in an epoch that is over
    assert not worker.takes_part(st)


def test_a_stage_refuses_a_participant_list_its_layers_contradict(redis_url: str) -> None:
    """Pipelined chunks go by the stage's index in the participant list: a list in
    another order must fail in one line, not compute the wrong chunks."""
    from protocol.errors import TreepipeError
    from stages.runtime.worker import StageWorker
    from tests.tiny_models import target_shards

    last = target_shards(3)[2]
    sync = Synchroniser(redis_url, f"p{uuid.uuid4().hex[:6]}")
    ok = StageWorker("stage2", sync, last, None, None,
                     participants=["draft", "stage0", "stage1", "stage2"])
    assert ok.stage_position() == (2, 3)
    bad = StageWorker("stage2", sync, last, None, None,
                      participants=["draft", "stage2", "stage0", "stage1"])
    with pytest.raises(TreepipeError, match="stage 0 of 3 .* its layers contradict"):
        bad.stage_position()
    sync.close()
