"""Real multi-process pipelines (Redis + draft service + stage workers) on the tiny model.

Each configuration starts real processes talking over real sockets and checks
that the tokens equal both the in-process engine's and plain autoregressive
decoding's, greedy and with seeded sampling.  Bad frames sent straight to a
worker's inbox are dropped without killing it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from orchestrator.models.loading import early_exit_draft, replay_source
from protocol.config.recovery import parse_recovery
from protocol.links import frames, messages
from protocol.links.keys import LINK_SERVER_NAME, LinkKeys, curve_client, grpc_channel_credentials
from protocol.links.messages import Nodes
from protocol.links.transport import open_outbox
from protocol.scheduling.records import GenerationResult
from stages.model.sampling import SamplingParams
from stages.speculation.engine import PipelineEngine
from stages.speculation.replay import parse_replay
from stages.speculation.token_sources import DraftModelSource, NgramSource, TokenSource
from tests.runtime_harness import Pipeline, tiny_model_folder
from tests.test_openai_api import add_tokenizer
from tests.tiny_models import PROMPT, TARGET, target_shards

# (transport, stages, source, width, topk, plan, recovery): every transport, 2-4 stages,
# four kinds of source, draft:K miss recovery (on the replay pipeline: each node's top-1
# levels leave slots for corrections, whose re-roots the engine's schedule must match
# step for step); the workers of a configuration with a plan register themselves
# (--plan, as in a Kubernetes rollout), the others are registered by the harness.  The
# tests that kill, restart or re-plan workers run last on the 3-stage n-gram pipeline,
# each a pipeline start fewer than one of their own (the pipeline starts are most of
# this file's time).  One pipeline per distinct path, no more:
# - one replay pipeline: the runtime's part of a replay source (the draft service parses
#   it and computes the continuation on its shards) is the same for a fixed rate
#   (replay:P) and a range (replay:P-Q); only the proposals ReplaySource draws differ,
#   which tests/test_replay.py checks in process for both;
# - one planned pipeline (zmq): gRPC links are the 2-stage draft-model pipeline's, and
#   gRPC links across a SIGKILLed stage and a re-plan are tests/test_launcher.py's
#   (test_stage_killed_mid_request, test_scale_2_to_4_and_back_mid_request_then_down:
#   workers started with --plan there too); a 3-stage gRPC n-gram pipeline of its own
#   covered nothing more.
ZMQ_PLANNED = ("zmq", 3, "ngram", 4, 2, "three", "none")
GRPC_DRAFT = ("grpc", 2, "layers:2", 8, 4, "", "none")
# early-exit recovery's token channel, over gRPC (the draft:K pipeline above runs ZeroMQ)
GRPC_EXIT = ("grpc", 3, "ngram", 4, 4, "", "early-exit:1:4")
CONFIGS = [ZMQ_PLANNED, GRPC_DRAFT, ("zmq", 4, "none", 1, 1, "", "none"),
           ("zmq", 3, "replay:0.5-0.9:64", 4, 1, "", "draft:6")]
PROMPTS = [PROMPT, [7, 7, 7, 7, 1, 2, 7, 7, 7]]
SAMPLED = {"temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 11}
# a response_format's schema: eight colors (long enough for a kill at token 15 to land
# inside the JSON)
COLORS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 8,
          "maxItems": 8}


def config_id(c: tuple) -> str:
    return "-".join(str(x) for x in c if x not in ("", "none"))


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model")
    add_tokenizer(folder)  # the last stage's grammars (response_format) read it
    return folder


@pytest.fixture(scope="module", params=CONFIGS, ids=config_id)
def pipeline(request: pytest.FixtureRequest, model_folder: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    transport, stages, source, width, topk, plan, recovery = request.param
    logs = tmp_path_factory.mktemp("logs")
    p = Pipeline(str(model_folder), stages, transport, source, width, topk, log_dir=logs,
                 plan=plan, recovery=recovery)
    try:
        p.start(TARGET.n_layers)
        if plan:  # the workers register themselves: a request waits for them
            wait_ready(p)
        yield p
        # over every test of this configuration: no link message was lost (a lost one
        # heals through the input timeout, well inside a test's own limits)
        assert not p.input_timeouts()
    finally:
        p.stop()


def engine(p: Pipeline, model_folder: Path) -> tuple[PipelineEngine, str]:
    """The in-process engine for the pipeline's configuration, and its method."""
    source: TokenSource | None = None
    if p.source == "ngram":
        source = NgramSource()
    elif p.source.startswith("layers:"):
        source = DraftModelSource(early_exit_draft(model_folder, int(p.source[7:]),
                                                   torch.float64, "cpu"))
    shards = target_shards(p.stages)
    replay = parse_replay(p.source)
    if replay is not None:  # the draft service computes the same continuation
        source = replay_source(replay, shards)
    eng = PipelineEngine(shards, source, p.width, p.topk, recovery=parse_recovery(p.recovery))
    return eng, "pp" if source is None else "specpipe"


def reference(p: Pipeline, model_folder: Path, prompt: list[int], n: int,
              sampling: SamplingParams) -> tuple[list[int], GenerationResult, str]:
    """(ar tokens, the in-process engine's result, its method) for the pipeline's
    configuration."""
    eng, method = engine(p, model_folder)
    ar = eng.generate(prompt, n, sampling, method="ar").tokens
    return ar, eng.generate(prompt, n, sampling, method=method), method


def ar_of(p: Pipeline, prompt: list[int], n: int, sampling: SamplingParams) -> list[int]:
    """Plain autoregressive tokens on the pipeline's shards (no engine run beside)."""
    return PipelineEngine(target_shards(p.stages)).generate(prompt, n, sampling,
                                                            method="ar").tokens


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_lossless_on_the_engines_schedule(pipeline: Pipeline, model_folder: Path,
                                          sampled: bool) -> None:
    """The runtime's tokens equal ar's and the in-process engine's; and not only the
    tokens: step for step the same hits, misses and steps without a verification as the
    engine (arrive.lua records each step's outcome)."""
    on_the_engines_schedule(pipeline, model_folder, sampled)


def on_the_engines_schedule(pipeline: Pipeline, model_folder: Path, sampled: bool) -> int:
    """test_lossless_on_the_engines_schedule's checks; the engine's re-roots (recovery)."""
    params = SAMPLED if sampled else {}
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    recovered = 0
    for prompt in PROMPTS:
        got = pipeline.generate(prompt, 48, params)
        ar, res, method = reference(pipeline, model_folder, prompt, 48, sp)
        assert got == ar, f"runtime differs from ar on {prompt}"
        assert got == res.tokens
        want = outcomes(res)
        if prompt == PROMPTS[1]:  # a prompt that misses, and hits where a draft proposes
            assert "m" in want and ("h" in want) == (method == "specpipe")
        # one epoch ('|' marks its step 0), then the decode steps
        assert settled_schedule(pipeline, len(want) + 1) == "|" + want, prompt
        recovered += res.stats()["recovered"]
    assert not pipeline.input_timeouts()  # no link message was lost
    return recovered


def test_int8_weights_reach_the_stage_processes(model_folder: Path, tmp_path: Path) -> None:
    """--quantize int8 through real processes: the stages quantize their own shards, so the
    runtime's specpipe tokens are int8 ar's (which differ from float ar's within 48)."""
    p = Pipeline(str(model_folder), 2, source="ngram", log_dir=tmp_path, quantize="int8")
    try:
        p.start(TARGET.n_layers)
        got = p.generate(PROMPT, 48)
    finally:
        p.stop()
    int8 = PipelineEngine(target_shards(2, quantize="int8")).generate(PROMPT, 48, method="ar")
    assert got == int8.tokens and got != ar_of(p, PROMPT, 48, SamplingParams())


@pytest.mark.parametrize("pipeline", [GRPC_EXIT], ids=config_id, indirect=True)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_early_exit_recovery_on_the_engines_schedule(pipeline: Pipeline, model_folder: Path,
                                                     sampled: bool) -> None:
    """Early-exit recovery through real processes: stage 1's exit candidates reach the
    draft service over the token channel (gRPC) in time for the same step as in the
    engine, so the runtime re-roots the misses the engine re-roots, step for step (the
    greedy runs re-root some; the sampled ones happen to catch none on these prompts)."""
    recovered = on_the_engines_schedule(pipeline, model_folder, sampled)
    assert recovered > 0 or sampled


def test_stop_id_ends_request(pipeline: Pipeline) -> None:
    ar = ar_of(pipeline, PROMPT, 30, SamplingParams())
    stop = ar[10]
    got = pipeline.generate(PROMPT, 30, {}, stop_ids=[stop])
    assert got == ar[: ar.index(stop) + 1]
    # nothing of a finished request is kept forever, its token log included
    sync = pipeline.sync()
    rid = pipeline.last_rid
    keys = [sync.req_key(rid)] + [k.decode() for k in sync.r.scan_iter(sync.req_key(rid) + ":*")]
    ttls = {k: sync.r.ttl(k) for k in keys}
    assert sync.req_key(rid, "log") in ttls and all(t > 0 for t in ttls.values()), ttls


def _frame(parts: list[Nodes]) -> list[bytes]:
    return [bytes(b) for b in frames.encode(*messages.encode(parts))]


def _bad_messages(dim: int) -> list[list[bytes]]:
    meta = {"req": "x", "epoch": 0, "step": 1}
    ids = torch.tensor([5, 3])  # not increasing
    good_x = torch.zeros(2, dim, dtype=torch.float64)
    huge = {"v": 1, "kind": "hidden", "meta": meta,
            "tensors": [{"name": "x", "dtype": "float64", "shape": [1 << 20, 1 << 10]}]}
    enc = _frame([Nodes("hidden", "x", 0, 1, ids, ids, ids, good_x)])
    one = torch.tensor([1])
    wrong_dtype = _frame([Nodes("hidden", "x", 0, 1, one, one - 1, one, torch.zeros(1, dim))])
    # the parts claim 3 nodes, the tensors hold 1
    kind, parts, tensors = messages.encode([Nodes("level", "x", 0, 1, one, one - 1, one)])
    parts["parts"][0][4] = 3
    short = [bytes(b) for b in frames.encode(kind, parts, tensors)]
    return [
        [b"\xff\x00garbage"],  # not msgpack
        [msgpack.packb(huge), b""],  # declares a 8 GiB tensor
        [msgpack.packb({"v": 1, "kind": "hidden", "meta": meta, "tensors": []}), b"extra"],
        enc,  # decreasing node ids
        wrong_dtype,  # float32 hidden states to a float64 stage
        short,  # fewer nodes than its parts say
        [bytes(b) for b in frames.encode("nonsense", meta, {})],
    ]


def test_bad_frames_are_dropped(pipeline: Pipeline) -> None:
    """Malformed and oversized frames to stage 1's inbox: dropped, nobody dies."""
    pipeline.generate(PROMPT, 2)  # its inboxes are bound (when this test runs first)
    target = pipeline.argv["stage1"][pipeline.argv["stage1"].index("--listen") + 1]
    bad = _bad_messages(TARGET.dim)
    keys = LinkKeys.from_env()  # the pipeline's (tests/conftest.py): only they get through
    assert keys is not None
    if pipeline.transport == "zmq":
        sock = zmq.Context.instance().socket(zmq.PUSH)
        curve_client(sock, keys)
        sock.connect(f"tcp://{target}")
        for parts in bad:
            sock.send_multipart(parts)
        time.sleep(1.0)  # the CURVE handshake, then the frames (close(0) drops unsent ones)
        sock.close(0)
    else:
        import grpc

        from protocol import treepipe_pb2, treepipe_pb2_grpc

        with grpc.secure_channel(target, grpc_channel_credentials(keys),
                                 [("grpc.ssl_target_name_override", LINK_SERVER_NAME)]) as ch:
            stub = treepipe_pb2_grpc.StageLinkStub(ch)
            stub.Push(iter([treepipe_pb2.Frame(header=p[0], tensors=p[1:]) for p in bad]),
                      timeout=10)
        out = open_outbox("grpc", target)  # the real sender path too
        out.send(messages.FRAME_KIND, {"parts": [["x", "hidden", 0, 1, 1, 1]]},
                 {"ids": torch.tensor([1])})  # no parents, tokens or hidden states
        time.sleep(0.3)
        out.close()
    got = pipeline.generate(PROMPT, 24)
    ar = ar_of(pipeline, PROMPT, 24, SamplingParams())
    assert got == ar
    pipeline.check_alive()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        beat = pipeline.sync().heartbeats().get("stage1")
        rejected = beat.rejected if beat is not None else 0
        if rejected >= len(bad):
            break
        time.sleep(0.2)
    assert rejected >= len(bad), f"stage1 reports {rejected} rejected messages"


def wait_ready(p: Pipeline, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not p.sync().ready():
        p.check_alive()
        assert time.monotonic() < deadline, "workers did not join"
        time.sleep(0.2)


# (moved here from tests/test_reliability.py, onto this file's zmq n-gram pipeline: the
# configuration it had started for itself)
@pytest.mark.parametrize("pipeline", [ZMQ_PLANNED], ids=config_id, indirect=True)
def test_cancel_then_request_never_stalls_the_next_request(pipeline: Pipeline) -> None:
    """A cancelled request's late verdicts cannot interrupt the next request's steps:
    over many cancel-then-request rounds no worker ever waits out its input timeout
    (the symptom of an interrupted prefill) and every next request equals ar."""
    from protocol.sync.synchroniser import Busy

    p = pipeline
    assert (p.transport, p.stages, p.source, p.width, p.topk) == ("zmq", 3, "ngram", 4, 2)
    ar = PipelineEngine(target_shards(1)).generate(PROMPT, 24, method="ar").tokens
    sync = p.sync()
    for _ in range(12):
        p.generate(PROMPT, 200, at=(2, lambda: sync.cancel(p.last_rid, "client")))
        while True:  # the cancelled request drains out at its next step boundary
            try:
                got = p.generate(PROMPT, 24)
                break
            except Busy:
                time.sleep(0.01)
        assert got == ar
    assert not p.input_timeouts()


@pytest.mark.parametrize("pipeline", [ZMQ_PLANNED], ids=config_id, indirect=True)
def test_penalties_equal_ar_across_a_stage_restart(pipeline: Pipeline,
                                                   model_folder: Path) -> None:
    """Penalties, logit_bias and min_tokens as the gateway stores them: the runtime gives
    ar's tokens under the same parameters, greedy and seeded, also when the verifying
    stage is SIGKILLed mid-request and resumes from the token log (its penalties then
    count the logged tokens)."""
    adjust = {"presence_penalty": 0.5, "frequency_penalty": 0.75, "repetition_penalty": 1.5,
              "logit_bias": {7: 4.0, 12: -100.0}, "min_tokens": 12}
    stored = {**adjust, "logit_bias": [[7, 4.0], [12, -100.0]]}
    p = pipeline
    assert (p.transport, p.stages, p.plan) == ("zmq", 3, "three") and p.log_dir is not None
    wait_ready(p)
    for base in ({}, SAMPLED):
        sp = SamplingParams(**base, **adjust)  # type: ignore[arg-type]
        plain = ar_of(p, PROMPT, 40, SamplingParams(**base))
        stop = [plain[2]]  # ends plain ar early; min_tokens holds it off
        ar = PipelineEngine(target_shards(1)).generate(PROMPT, 40, sp, "ar",
                                                       stop_ids=stop).tokens
        assert len(ar) > 12 and ar != plain[:len(ar)]
        assert p.generate(PROMPT, 40, {**base, **stored}, stop_ids=stop) == ar

    log = p.log_dir / "stage2.log"
    logged = len(log.read_text())  # what the tests before this one left there

    sp = SamplingParams(**SAMPLED, **adjust)  # type: ignore[arg-type]
    ar = PipelineEngine(target_shards(1)).generate(PROMPT, 60, sp, "ar").tokens
    got = p.generate(PROMPT, 60, {**SAMPLED, **stored}, at=(15, lambda: p.restart("stage2")))
    assert got == ar
    assert "joined: epoch" in log.read_text()[logged:]


@pytest.mark.parametrize("pipeline", [ZMQ_PLANNED], ids=config_id, indirect=True)
def test_logprobs_across_a_stage_restart(pipeline: Pipeline) -> None:
    """A request asking for logprobs (seeded, with top_k): ar's tokens, and every commit
    event carries the token's raw logprob and top 3 equal to teacher forcing, also when
    the verifying stage is SIGKILLed mid-request and resumes from the token log (the
    tokens after the resume get theirs from the restarted stage)."""
    from protocol.requests.logprobs import TokenLogprobs

    p = pipeline
    assert p.log_dir is not None
    wait_ready(p)
    log = p.log_dir / "stage2.log"
    logged = len(log.read_text())
    ar = PipelineEngine(target_shards(1)).generate(PROMPT, 40, SamplingParams(**SAMPLED),
                                                   "ar").tokens
    got = p.generate(PROMPT, 40, {**SAMPLED, "logprobs": 3},
                     at=(15, lambda: p.restart("stage2")))
    assert got == ar
    assert "joined: epoch" in log.read_text()[logged:]  # it did resume
    evs = {int(ev["i"]): ev for _, ev in p.sync().events(p.last_rid, "0", 0) if "tok" in ev}
    lps = [TokenLogprobs.from_wire(evs[i]["lp"], 3, TARGET.vocab_size) for i in range(40)]
    m = target_shards(1)[0]
    seq = PROMPT + ar
    h = m.forward(torch.tensor(seq), torch.arange(len(seq)), m.new_cache(len(seq)))
    ref = torch.log_softmax(m.logits(h).to(torch.float32), -1)[len(PROMPT) - 1:-1]
    for j, (t, lp) in enumerate(zip(ar, lps, strict=True)):
        assert abs(lp.logprob - float(ref[j, t])) < 1e-3, j
        vals, ids = torch.topk(ref[j], 3)
        assert [a for a, _ in lp.top] == ids.tolist(), j
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), vals, atol=1e-3)
    # a request that does not ask gets no logprobs on its events
    p.generate(PROMPT, 4)
    assert all("lp" not in ev for _, ev in p.sync().events(p.last_rid, "0", 0))


def settled_schedule(pipeline: Pipeline, n: int, timeout_s: float = 10.0) -> str:
    """The last request's step marks once there are ``n`` (or the timeout passed): its last
    step's mark is recorded when that barrier completes, which may come after the
    request's end event (the last stage's arrival) that ``generate`` returns at."""
    deadline = time.monotonic() + timeout_s
    while len(got := pipeline.sync().schedule(pipeline.last_rid)) < n \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def outcomes(res: GenerationResult) -> str:
    """An engine run's steps as arrive.lua records them: hit, miss, or '.' (nothing
    verified)."""
    return "".join("h" if s.hits else "m" if s.verified else "." for s in res.steps)


@pytest.mark.parametrize("pipeline", [GRPC_DRAFT], ids=config_id, indirect=True)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_json_schema_masks_the_drafts(pipeline: Pipeline, model_folder: Path,
                                      sampled: bool) -> None:
    """The draft service drafts under a request's response_format as the engine does
    (stages.model.grammar.DraftMask): ar's tokens under the grammar, and step for step
    the engine's hits and misses, which the mask changes here (unmasked, the tiny
    draft's favourites are rarely JSON, so it misses far more often)."""
    from protocol.requests.response_format import grammar_spec
    from stages.model.grammar import GrammarVocab
    from stages.model.tokenizer import TextTokenizer

    spec = grammar_spec({"type": "json_schema", "json_schema": {"schema": COLORS}})
    params = {**(SAMPLED if sampled else {}), "response_format": spec}
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    grammar = GrammarVocab(TextTokenizer.from_folder(model_folder), TARGET.vocab_size)
    eng, method = engine(pipeline, model_folder)
    ar = eng.generate(PROMPT, 100, sp, "ar", constraint=grammar.constraint(spec)).tokens
    res = eng.generate(PROMPT, 100, sp, method, constraint=grammar.constraint(spec))
    assert pipeline.generate(PROMPT, 100, params) == res.tokens == ar
    want = "|" + outcomes(res)
    assert settled_schedule(pipeline, len(want)) == want
    eng.mask_drafts = False
    free = eng.generate(PROMPT, 100, sp, method, constraint=grammar.constraint(spec))
    assert free.tokens == ar
    assert outcomes(free).count("h") < outcomes(res).count("h")


@pytest.mark.parametrize("pipeline", [ZMQ_PLANNED], ids=config_id, indirect=True)
def test_json_schema_across_a_stage_restart(pipeline: Pipeline, model_folder: Path) -> None:
    """A response_format as the gateway stores it (seeded): ar's tokens under the same
    grammar, JSON that validates, also when the verifying stage is SIGKILLed mid-request
    and rebuilds the request's grammar state from the token log (the epoch's restart
    rebuilds the draft service's mask over the proposals from it too)."""
    import json

    import jsonschema

    from protocol.requests.response_format import grammar_spec
    from stages.model.grammar import GrammarVocab
    from stages.model.tokenizer import TextTokenizer

    schema = COLORS
    spec = grammar_spec({"type": "json_schema", "json_schema": {"schema": schema}})
    p = pipeline
    assert p.log_dir is not None
    wait_ready(p)
    log = p.log_dir / "stage2.log"
    logged = len(log.read_text())
    tok = TextTokenizer.from_folder(model_folder)
    sp = SamplingParams(**SAMPLED, response_format=spec)  # type: ignore[arg-type]
    ar = PipelineEngine(target_shards(1)).generate(
        PROMPT, 100, sp, "ar", constraint=GrammarVocab(tok, TARGET.vocab_size).constraint(
            spec)).tokens
    assert len(ar) > 15
    jsonschema.validate(json.loads(tok.decode(ar)), schema)
    got = p.generate(PROMPT, 100, {**SAMPLED, "response_format": spec},
                     at=(15, lambda: p.restart("stage2")))
    assert got == ar
    assert "joined: epoch" in log.read_text()[logged:]  # it did resume


# Last on the zmq n-gram pipeline (it leaves two stages; the module fixture stops it).
@pytest.mark.parametrize("pipeline", [ZMQ_PLANNED], ids=config_id, indirect=True)
def test_workers_rejoin_and_replan_without_a_control_plane(pipeline: Pipeline) -> None:
    """What a Kubernetes rollout does: no supervisor calls register or resume.

    Workers started with --plan register themselves.  A SIGKILLed stage that comes
    back resumes the running request; then every worker is replaced by a 2-stage
    layout mid-request (a re-plan).  The tokens equal ar's throughout.
    """
    p = pipeline
    assert (p.transport, p.stages, p.plan) == ("zmq", 3, "three") and p.log_dir is not None
    wait_ready(p)
    assert p.sync().participants() == ["draft", "stage0", "stage1", "stage2"]
    ar = ar_of(p, PROMPT, 80, SamplingParams())

    log = p.log_dir / "stage1.log"
    logged = len(log.read_text())  # what the tests before this one left there

    assert p.generate(PROMPT, 80, at=(20, lambda: p.restart("stage1"))) == ar
    assert "joined: epoch" in log.read_text()[logged:]
    epoch = p.sync().epoch()
    assert p.generate(PROMPT, 80, at=(20, lambda: p.replan(2, "two"))) == ar
    sync = p.sync()
    assert sync.layout_id() == "two" and sync.epoch() > epoch
    assert sync.participants() == ["draft", "stage0", "stage1"]
    assert not p.input_timeouts()
