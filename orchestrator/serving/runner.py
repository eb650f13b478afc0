"""The transport-agnostic request runner behind both the gRPC and the HTTP front ends.

:func:`validate` checks a request and tokenizes its prompt; :class:`RequestRunner`
admits it (a bounded queue in front of ``limits.concurrency`` pipeline slots),
submits it to the synchroniser and turns its commit events into :class:`Chunk`
objects, cutting stop strings and cancelling the request at the next step
boundary when the caller goes away.  A transport passes a :class:`Call` (a gRPC
context is one; the HTTP front end has its own) and maps :class:`RequestError`
codes to its own status.

Failures have classes a client can act on: bad input is INVALID_ARGUMENT, a full
queue RESOURCE_EXHAUSTED, and an unreachable synchroniser (Redis restarting or
paused) UNAVAILABLE with a retry hint once it has been unreachable for
``GatewayLimits.sync_outage_s`` (each attempt may add Redis's socket timeout, 5 s).
INTERNAL means a bug: :meth:`RequestRunner.internal` logs it once, in one line with
the request id, and counts it as a request finished with reason ``error``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import redis

from orchestrator.serving.formats import Formats, NoTokenizer
from protocol import treepipe_pb2
from protocol.requests.logprobs import LogprobsError, TokenLogprobs
from protocol.requests.response_format import FormatError
from protocol.requests.sampling_params import API_TEMPERATURE, SamplingError, SamplingParams
from protocol.scheduling.kv_blocks import longest_request, pool_blocks, request_blocks
from protocol.sync.synchroniser import (
    FAILED_PREFIX,
    LEASE_S,
    LOST,
    SOCKET_TIMEOUT_S,
    Busy,
    SpecStats,
    Synchroniser,
    TooBig,
    is_lost,
)
from stages.model.tokenizer import StreamDecoder, TextTokenizer

log = logging.getLogger("treepipe.gateway")
# how long requests wait out an unreachable synchroniser before UNAVAILABLE (documented
# in docs/serving.md); a request's own deadline, when shorter, ends it first
SYNC_OUTAGE_S = 30.0
RETRY_AFTER_S = 5  # the retry hint of an UNAVAILABLE answer
# the health watcher's pause between its Redis checks (gateway.py ``_watch``)
WATCH_WAIT_S = 0.5
# A Redis call that failed within this long says the outage still lasts: new requests
# are refused (and /health answers) without another, socket-timeout long, attempt.  The
# watcher reports a failure every socket timeout + its pause while Redis is silent; two of
# those periods, so that one late report on a loaded machine does not open the window
# (the state is cleared at once by any call that succeeds).
OUTAGE_FRESH_S = 2 * (SOCKET_TIMEOUT_S + WATCH_WAIT_S)


def fresh_seed(temperature: float) -> int:
    """The seed of a request that sent none: drawn from the OS when it samples, so two
    unseeded requests differ (regenerate, best-of-N); 0 when greedy, where it is unused."""
    return secrets.randbits(63) if temperature > 0 else 0


class RequestError(ValueError):
    """A request the gateway refuses; ``code`` is the gRPC status to answer with
    (the HTTP front end maps it to an HTTP status)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.code = code
        self.param = param
        self.retry_after = retry_after  # seconds (Retry-After), for UNAVAILABLE and the like


# No tokenizer we serve packs more than this many bytes of text into one token on real
# text, so a prompt above context × this many bytes cannot fit and is refused untokenized.
PROMPT_BYTES_PER_TOKEN = 32


@dataclass
class GatewayLimits:
    """What the gateway accepts and how much it queues."""

    context_length: int
    max_new_tokens: int = 1024
    default_new_tokens: int = 256
    concurrency: int = 1
    max_queue: int = 64
    # prompt tokens entering stage 1 per step over all joiners (0: each whole, at once)
    prefill_chunk: int = 0
    stall_s: float = 120.0  # no commit for this long while every worker is up: stuck
    # no commit for this long while workers are coming up (a restart, a re-plan that
    # reloads shards): the Kubernetes startup window, not the stall limit, applies
    recover_s: float = 900.0
    # KV budget of each stage in rows (the stages' --kv-tokens; 0: none): a request is
    # admitted while its worst case fits beside the running ones' (start.lua)
    kv_tokens: int = 0
    tree_width: int = 1  # the draft's (cap on its) level width: the tree rows a stage holds
    sync_outage_s: float = SYNC_OUTAGE_S  # Redis unreachable this long: UNAVAILABLE


@dataclass
class Admitted:
    """A validated request, ready for the synchroniser."""

    prompt: list[int]
    max_new: int
    params: dict[str, Any]
    stop_ids: list[int]
    stop: list[str]
    kv_blocks: int = 0  # its worst case on each stage (0: the pipeline has no KV budget)
    kv_budget: int = 0  # the blocks of each stage's pool it was admitted against
    include_stop: bool = False  # the text keeps the stop string that ended it (vLLM's flag)
    # token ids that end it as EOS does (already in stop_ids); their text is cut unless
    # include_stop, as vLLM does
    stop_token_ids: list[int] = field(default_factory=list)

    @property
    def logprobs(self) -> int | None:
        """The alternatives per token it asked logprobs for (None: no logprobs)."""
        return self.params.get("logprobs")


def validate(req: treepipe_pb2.GenerateRequest, model: str, tok: TextTokenizer | None,
             vocab: int, eos_ids: list[int], limits: GatewayLimits,
             formats: Formats | None = None, default_new: int | None = None) -> Admitted:
    """Check a request and tokenize its prompt; raises RequestError naming the fix.
    ``formats``: where its response_format compiles (None: a fresh one for ``tok``).
    A request without max_tokens generates ``default_new`` tokens (None: the gateway's
    ``default_new_tokens``), at most what the context holds after its prompt (vLLM's
    rule: a long prompt is not refused for a limit its client never set)."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if req.model and req.model != model:
        raise RequestError(grpc.StatusCode.NOT_FOUND,
                           f"unknown model {req.model!r}; this gateway serves {model!r}", "model")
    given = [n for n, v in (("prompt", req.prompt), ("messages", req.messages),
                            ("prompt_ids", req.prompt_ids)) if len(v)]
    if not given:
        raise RequestError(bad, "empty prompt; set one of prompt, messages or prompt_ids",
                           "prompt")
    if len(given) > 1:
        raise RequestError(bad, f"set only one of prompt, messages, prompt_ids (got "
                                f"{', '.join(given)})", "prompt")
    if (req.prompt or req.messages) and tok is None:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           "this model has no tokenizer; send prompt_ids", given[0])
    # refuse what cannot fit before tokenizing it: a multi-megabyte prompt costs seconds of
    # gateway CPU to encode only to be refused for its length afterwards
    text_bytes = len(req.prompt.encode()) + sum(len(m.content.encode()) + len(m.role)
                                                for m in req.messages)
    if text_bytes > limits.context_length * PROMPT_BYTES_PER_TOKEN:
        raise RequestError(bad, f"the prompt is {text_bytes} bytes, more than this pipeline's "
                                f"context of {limits.context_length} tokens can hold (at most "
                                f"{limits.context_length * PROMPT_BYTES_PER_TOKEN} bytes); "
                                f"shorten it", given[0])
    if req.prompt:
        if not req.prompt.strip():
            raise RequestError(bad, "empty prompt; the prompt is only whitespace", "prompt")
        prompt = tok.encode(req.prompt)  # type: ignore[union-attr]
    elif req.messages:
        msgs = [{"role": m.role, "content": m.content} for m in req.messages]
        if any(m["role"] not in ("system", "user", "assistant") for m in msgs):
            raise RequestError(bad, "message roles must be system, user or assistant",
                               "messages")
        try:
            prompt = tok.chat_ids(msgs)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - template errors come in many types
            raise RequestError(bad, f"chat messages do not fit the chat template: {e}",
                               "messages") from None
    else:
        prompt = list(req.prompt_ids)
        if any(t < 0 or t >= vocab for t in prompt):
            raise RequestError(bad, f"prompt token ids must lie in [0, {vocab}), this "
                                    f"model's vocabulary", "prompt")
    if not prompt:
        raise RequestError(bad, "the prompt encodes to no tokens; send some text", "prompt")
    if req.max_tokens < 0:
        raise RequestError(bad, f"max_tokens must be >= 0 (0 = default), got {req.max_tokens}",
                           "max_tokens")
    room = limits.context_length - len(prompt)
    if room < 1:
        raise RequestError(bad, f"the prompt ({len(prompt)} tokens) leaves no room for a "
                                f"token in the context of {limits.context_length}; shorten "
                                f"it", "prompt")
    default = limits.default_new_tokens if default_new is None else default_new
    max_new = req.max_tokens or min(default, limits.max_new_tokens, room)
    if max_new > limits.max_new_tokens:
        raise RequestError(bad, f"max_tokens {max_new} exceeds this pipeline's limit of "
                                f"{limits.max_new_tokens}", "max_tokens")
    if len(prompt) + max_new > limits.context_length:
        raise RequestError(bad, f"prompt ({len(prompt)} tokens) + max_tokens ({max_new}) "
                                f"exceeds the context of {limits.context_length}; shorten one",
                           "max_tokens")
    if any(not x for x in req.stop):
        raise RequestError(bad, "stop strings must not be empty", "stop")
    params = sampling(req.sampling, vocab, max_new,
                      req.logprobs if req.HasField("logprobs") else None,
                      format_spec(req, formats or Formats(tok, vocab)))
    return Admitted(prompt, max_new, params, [] if req.ignore_eos else list(eos_ids),
                    list(req.stop))


def format_spec(req: treepipe_pb2.GenerateRequest, formats: Formats) -> str | None:
    """The request's response_format as checked, compiled grammar text (None: free
    text); RequestError naming response_format when it cannot be served."""
    try:
        return formats.spec(req)
    except NoTokenizer as e:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(e),
                           "response_format") from None
    except FormatError as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                           "response_format") from None


def sampling(s: treepipe_pb2.SamplingParams, vocab: int | None, max_new: int,
             logprobs: int | None = None, response_format: str | None = None
             ) -> dict[str, Any]:
    """A request's decoding parameters as the stage worker reads them
    (SamplingParams.from_wire): checked by SamplingParams' own bounds, RequestError naming
    the field otherwise.  Absent temperature is the API's 1.0, absent seed a fresh one
    (both front ends, treepipe.proto), top_p 0 is off."""
    temperature = s.temperature if s.HasField("temperature") else API_TEMPERATURE
    rep = s.repetition_penalty if s.HasField("repetition_penalty") and \
        s.repetition_penalty != 0 else 1.0
    try:
        sp = SamplingParams(temperature, s.top_p or 1.0, s.top_k,
                            s.seed if s.HasField("seed") else fresh_seed(temperature),
                            presence_penalty=s.presence_penalty,
                            frequency_penalty=s.frequency_penalty, repetition_penalty=rep,
                            logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens,
                            logprobs=logprobs, response_format=response_format,
                            min_p=s.min_p)
        if vocab is not None:
            sp.check_vocab(vocab)
    except SamplingError as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from None
    if sp.min_tokens > max_new:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"min_tokens ({sp.min_tokens}) must be at most max_tokens "
                           f"({max_new})", "min_tokens")
    return sp.to_wire()


class Call(Protocol):
    """What the runner asks of the caller's connection (a gRPC context is one)."""

    def is_active(self) -> bool: ...

    def time_remaining(self) -> float | None: ...


@dataclass
class Chunk:
    """What one batch of commit events adds to a request's output."""

    request_id: str
    queue_ms: float
    token_ids: list[int] = field(default_factory=list)
    # (ms since the request arrived, ms since the previous token) per token
    timing: list[tuple[float, float]] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str = ""
    stats: SpecStats | None = None  # on the last chunk
    # one per token id when the request asked for logprobs (Admitted.logprobs), else none
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class Observer(Protocol):
    """Receives a request's life events (the Prometheus metrics implement it)."""

    def queued(self, delta: int) -> None: ...

    def admitted(self, queue_s: float) -> None: ...

    def running(self, delta: int, tokens: int) -> None: ...

    def tokens(self, timing: list[tuple[float, float]], first: bool) -> None: ...

    def finished(self, reason: str, prompt_tokens: int, generated: int, e2e_s: float,
                 stats: SpecStats | None) -> None: ...


class RequestRunner:
    """Admission, submission and streaming of requests over one pipeline's synchroniser."""

    def __init__(self, sync: Synchroniser, model: str, tok: TextTokenizer | None, vocab: int,
                 eos_ids: list[int], limits: GatewayLimits, observer: Observer | None = None):
        self.sync, self.model, self.tok = sync, model, tok
        self.vocab, self.eos_ids, self.limits = vocab, eos_ids, limits
        self.formats = Formats(tok, vocab)  # response_format grammars, compiled once each
        self.observer = observer
        self.waiting = 0
        self.running = 0
        self.lock = threading.Lock()
        # admission in arrival order: a waiter takes a slot only from the queue's head
        self.turn = threading.Condition()
        self.queue: deque[object] = deque()
        self.in_use = 0
        self.submitting = False  # the queue's head holds a slot and waits to be submitted
        # the pipeline as last read (_read_pipeline): stages, the smallest fixed pool of a
        # stage, and the budget in blocks admission holds requests to (0: none)
        self.stages, self.stage_pools, self.kv_budget = 1, 0, 0
        self.owned: set[str] = set()  # requests this gateway streams (and leases)
        # Redis found unreachable since (None: it answered the last call), and last so
        self.down_since: float | None = None
        self.down_seen = 0.0

    # ---- failures ------------------------------------------------------------------------
    def sync_state(self, up: bool, since: float | None = None) -> None:
        """Record whether Redis answered a call (the gateway's health watcher reports too);
        ``since``: when the failed call began (it was unreachable from then on)."""
        now = time.monotonic()
        since = now if since is None else since
        with self.lock:
            back = up and self.down_since is not None
            if up:
                self.down_since = None
            else:
                self.down_seen = now
                self.down_since = since if self.down_since is None else min(self.down_since,
                                                                            since)
        if not up:
            # the other gateways' leases lapse in this outage too while they wait it out
            # (up to their sync_outage_s): reaping one before they could renew would
            # cancel a live gateway's request
            self.sync.hold_reaping(self.limits.sync_outage_s + LEASE_S)
        elif back:
            self._renew_owned()

    def _renew_owned(self) -> None:
        """Renew the lease of every request this gateway streams, first thing after an
        outage: another gateway's reaper may look before their streaming loops run.
        Never raises: the health watcher calls it, and a failure here only leaves the
        renewal to those loops."""
        owned = self.owned.copy()  # one C call: handler threads add and discard
        if not owned:
            return
        try:
            self.sync.renew_leases(owned)
        except redis.RedisError as e:
            log.warning("lease renewal after the outage skipped: %s", e)

    def down_for(self) -> float | None:
        """How long Redis has been unreachable, if a call found it so just now."""
        with self.lock:
            since, seen = self.down_since, self.down_seen
        now = time.monotonic()
        return None if since is None or now - seen > OUTAGE_FRESH_S else now - since

    def _unavailable(self, e: BaseException | None = None) -> RequestError:
        why = f" ({' '.join(str(e).split())})" if e is not None else ""
        return RequestError(grpc.StatusCode.UNAVAILABLE,
                            f"the synchroniser (Redis) has been unreachable for "
                            f"{self.limits.sync_outage_s:.0f} s{why}; the pipeline is paused "
                            f"until it is back: retry in {RETRY_AFTER_S} s",
                            retry_after=RETRY_AFTER_S)

    def _wait_out(self, e: BaseException, since: float) -> None:
        """A call begun at ``since`` found Redis unreachable: UNAVAILABLE once it has been
        for the bound, else a short pause before the next attempt.  Other Redis errors
        are bugs."""
        if not is_lost(e):
            raise e
        self.sync_state(False, since)
        down = self.down_for()
        if down is not None and down >= self.limits.sync_outage_s:
            raise self._unavailable(e) from None
        time.sleep(0.2)  # a refused connection fails at once: no busy loop

    def _quietly(self, what: str, fn: Any, *args: Any) -> None:
        """A Redis call whose failure while Redis is away costs nothing lasting (a cancel
        or a lease renewal: a lapsed lease gets the request reaped).  While Redis is known
        to be away it is not even tried: that would hold the caller a socket timeout."""
        if self.down_for() is not None:
            log.warning("%s skipped: Redis unreachable", what)
            return
        try:
            fn(*args)
        except LOST as e:
            if not is_lost(e):
                raise
            self.sync_state(False)
            log.warning("%s skipped: Redis unreachable (%s)", what, e)

    def internal(self, e: BaseException, rid: str | None = None,
                 count: bool = True) -> RequestError:
        """A bug: logged once, one line with the request id and where it was raised,
        counted as a request finished with reason ``error`` (``count``); the client gets
        INTERNAL naming the id, never the exception's text or a traceback."""
        rid = rid or uuid.uuid4().hex[:16]
        tb = traceback.extract_tb(e.__traceback__)
        where = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "?"
        log.error("request %s: internal error %s: %s (at %s)", rid, type(e).__name__,
                  " ".join(str(e).split()), where)
        if count:
            self._observe("finished", "error", 0, 0, 0.0, None)
        return RequestError(grpc.StatusCode.INTERNAL,
                            f"internal error (request {rid}); this is a bug: the gateway's "
                            f"log names it")

    def validate(self, req: treepipe_pb2.GenerateRequest,
                 default_new: int | None = None) -> Admitted:
        """:func:`validate` against this pipeline's model and limits, and its worst case
        of KV blocks against the stages' budget."""
        try:
            return self._validate(req, default_new)
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug: one line in the log, INTERNAL
            raise self.internal(e) from None

    def _validate(self, req: treepipe_pb2.GenerateRequest,
                  default_new: int | None) -> Admitted:
        adm = validate(req, self.model, self.tok, self.vocab, self.eos_ids, self.limits,
                       self.formats, default_new)
        # one reading for both numbers: handler threads update them concurrently, and a
        # worst case checked against one budget but submitted against a smaller one
        # would wait for ever
        stages, budget = self._read_pipeline()
        if budget:
            adm.kv_blocks, adm.kv_budget = self._kv_blocks(adm, stages, budget), budget
        return adm

    def _read_pipeline(self) -> tuple[int, int]:
        """The stage count and the KV budget in blocks: ``--kv-tokens``, or less where a
        stage (or the draft service's draft model) reports a smaller fixed pool (one
        started with another budget: admitting by the larger would exhaust its pool), or
        that pool alone without ``--kv-tokens``."""
        if self.down_for() is not None:  # no socket timeout's wait for a known outage
            return self.stages, self.kv_budget
        try:
            names = self.sync.participants()
            # None while a participant does not beat with the plan (a restarting stage's
            # pool is unknown, and a worker of the old plan on its way out beats under
            # the same name) and none was saved: the last reading is kept
            pool = self.sync.kv_pool(names, self.sync.layout_id()) if names else None
        except redis.RedisError as e:  # Redis restarting: the last reading (submit waits)
            if is_lost(e):
                self.sync_state(False)
            return self.stages, self.kv_budget
        stages = max(len(names) - 1, 1)  # the draft, then the stages
        if pool is not None:
            self.stage_pools = pool
        budgets = [pool_blocks(self.limits.kv_tokens)] if self.limits.kv_tokens else []
        budget = min(budgets + ([self.stage_pools] if self.stage_pools else []), default=0)
        self.stages, self.kv_budget = stages, budget
        return stages, budget

    def _kv_blocks(self, adm: Admitted, stages: int, budget: int) -> int:
        """The KV blocks ``adm`` holds on each stage at most (Synchroniser.admit prices it again,
        at the stage count when it is submitted); RequestError if even alone it cannot
        fit ``budget`` (it would wait in the queue for ever)."""
        need = request_blocks(len(adm.prompt) + adm.max_new, stages, self.limits.tree_width)
        if need > budget:
            raise self._too_big(adm, need, budget, stages)
        return need

    def _too_big(self, adm: Admitted, need: int, budget: int, stages: int) -> RequestError:
        """The refusal of a request that could not fit a stage's pool even alone."""
        return RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"prompt ({len(adm.prompt)} tokens) + max_tokens ({adm.max_new}) needs "
            f"{need} KV blocks on each stage, more than the {budget} a stage has "
            f"(memory.kvTokens); keep prompt + max_tokens within "
            f"{longest_request(budget, stages, self.limits.tree_width)} tokens", "max_tokens")

    def generate(self, adm: Admitted, call: Call, t0: float | None = None) -> Iterator[Chunk]:
        """Queue for a slot, run the request, yield its chunks; RequestError on refusal
        (INTERNAL for a bug, logged once)."""
        try:
            yield from self._generate(adm, call, t0)
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug: one line in the log, INTERNAL
            raise self.internal(e) from None

    def _generate(self, adm: Admitted, call: Call, t0: float | None) -> Iterator[Chunk]:
        t0 = time.monotonic() if t0 is None else t0
        down = self.down_for()
        if down is not None and down >= self.limits.sync_outage_s:
            raise self._unavailable()  # at once: every call would wait a socket timeout
        with self.lock:
            if self.waiting >= self.limits.max_queue:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{self.waiting} requests already queued; retry in a "
                                   f"second", retry_after=1)
            self.waiting += 1
        self._observe("queued", 1)
        rid = None
        try:
            if self._acquire(call):
                try:  # in arrival order: the next in line waits while this one waits for KV
                    rid = self._submit(adm, call)
                finally:
                    with self.turn:
                        self.submitting = False
                        if rid is None:  # gone, or refused: the slot is free again
                            self.in_use -= 1
                        self.turn.notify_all()
        finally:
            with self.lock:
                self.waiting -= 1
            self._observe("queued", -1)
        if rid is None:
            return
        queue_ms = (time.monotonic() - t0) * 1000
        self._observe("admitted", queue_ms / 1000)
        with self.lock:
            self.running += 1
        held = [len(adm.prompt)]  # tokens the request holds in the KV cache, grown by _run
        self._observe("running", 1, held[0])
        try:
            yield from self._run(rid, adm, call, t0, queue_ms, held)
        finally:
            with self.lock:
                self.running -= 1
            self._observe("running", -1, held[0])
            with self.turn:  # the slot is free at once; the next in line takes it
                self.in_use -= 1
                self.turn.notify_all()

    def _observe(self, what: str, *args: Any) -> None:
        if self.observer is not None:
            getattr(self.observer, what)(*args)

    def _acquire(self, call: Call) -> bool:
        """Wait for a slot in arrival order; False if the caller went away first."""
        me = object()
        with self.turn:
            self.queue.append(me)
        try:
            while call.is_active():
                left = call.time_remaining()
                if left is not None and left <= 0:
                    raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       "deadline passed in the queue")
                with self.turn:
                    if (self.queue[0] is me and self.in_use < self.limits.concurrency
                            and not self.submitting):
                        self.queue.popleft()
                        self.in_use += 1
                        self.submitting = True  # until generate() has submitted it
                        return True
                    self.turn.wait(0.2)
            return False
        finally:
            with self.turn:
                if me in self.queue:  # gone while waiting: let the next one move up
                    self.queue.remove(me)
                    self.turn.notify_all()

    def _submit(self, adm: Admitted, call: Call) -> str | None:
        """Submit ``adm`` once the pipeline has a slot and KV blocks for it; its id, or
        None if the caller went away first."""
        rid = uuid.uuid4().hex[:16]
        checked = time.monotonic()
        while True:
            down = self.down_for()  # it waited in the queue while the outage went on
            if down is not None and down >= self.limits.sync_outage_s:
                raise self._unavailable()
            tried = time.monotonic()
            try:
                self.sync.submit(rid, adm.prompt, adm.params, adm.max_new, adm.stop_ids,
                                 self.limits.concurrency, self.limits.prefill_chunk,
                                 self.limits.tree_width, adm.kv_budget,
                                 pool_blocks(self.limits.kv_tokens)
                                 if self.limits.kv_tokens else 0)
                self.sync_state(True)
                self.owned.add(rid)
                self._quietly("lease renewal", self.sync.renew_lease, rid)
                return rid
            except LOST as e:  # Redis away: wait it out, within the bound
                if not call.is_active():
                    return None
                self._wait_out(e, tried)
                continue
            except TooBig as e:  # the pools now are smaller than this gateway read
                raise self._too_big(adm, e.need, e.budget, e.stages) from None
            # another gateway's requests hold the slots or the KV blocks, or an orphan does
            except Busy:
                if not call.is_active():
                    return None
                left = call.time_remaining()
                if left is not None and left <= 0:
                    raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       "deadline passed waiting for the pipeline's KV blocks"
                                       if adm.kv_blocks else "deadline passed in the queue"
                                       ) from None
                now = time.monotonic()
                if now - checked > 1.0:  # or it runs for a gateway that died
                    checked = now
                    self._quietly("orphan reaping", self.sync.reap_orphan, self.owned)
                time.sleep(0.02)

    def _run(self, rid: str, adm: Admitted, call: Call, t0: float, queue_ms: float,
             held: list[int]) -> Iterator[Chunk]:
        stream = StreamDecoder(self.tok, skip_special_tokens=True) if self.tok else None
        text, sent_chars, n_tokens = "", 0, 0
        piece, last_tok = 0, -1  # the last token, and the characters it added (held back
        # while it may be a stop id: its end event can come in the next read)
        hold = max((len(s) for s in adm.stop), default=1) - 1
        last_id, last_t, last_event = "0", t0, time.monotonic()
        finished, reason = False, "client cancelled"
        leased = time.monotonic()
        try:
            while not finished:
                left = call.time_remaining()
                if not call.is_active():
                    return
                if left is not None and left <= 0:
                    self._quietly("cancel", self.sync.cancel, rid, "deadline")
                    reason = "deadline"
                    raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       "deadline passed while generating")
                tried = time.monotonic()
                try:
                    if time.monotonic() - leased > LEASE_S / 5:
                        self.sync.renew_lease(rid)
                        leased = time.monotonic()
                    block = 200 if left is None else max(1, min(200, int(left * 1000)))
                    events = self._events(rid, last_id, block)
                    self.sync_state(True)
                    idle = time.monotonic() - last_event
                    quiet = not events and idle > self.limits.stall_s / 2
                    if quiet and self.sync.waits_beside_a_batch(rid):
                        # it waits its turn, no stall of its own: its clock starts again,
                        # so at least half the limit is left when it joins (else the first
                        # quiet poll after a long wait would end it)
                        last_event, idle = time.monotonic(), 0.0
                    if not events and idle > self.limits.stall_s:
                        ready = self.sync.ready()
                        if ready or idle > self.limits.recover_s:
                            self.sync.cancel(rid, "stalled")
                            reason = "stalled"
                            why = "made no progress" if ready else "had workers down"
                            raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                               f"the pipeline {why} for {idle:.0f} s")
                except LOST as e:  # Redis away: its log is kept, so wait it out, bounded
                    try:
                        self._wait_out(e, tried)
                    except RequestError:
                        reason = "unavailable"
                        raise
                    continue
                chunk = Chunk(request_id=rid, queue_ms=queue_ms)
                for eid, ev in events:
                    last_id, last_event = eid, time.monotonic()
                    if "tok" in ev:
                        if 0 <= int(ev.get("i", -1)) < n_tokens + len(chunk.token_ids):
                            # sent already: a Redis restarted from its append-only log can
                            # lose its last second of commits, which the resumed request
                            # commits again (the same tokens, by the lossless rule)
                            continue
                        now = time.monotonic()
                        if adm.logprobs is not None:
                            try:
                                chunk.logprobs.append(self._logprobs(ev, adm.logprobs))
                            except RequestError:
                                reason = "error"  # counted once, by the finally below
                                raise
                        chunk.token_ids.append(int(ev["tok"]))
                        chunk.timing.append(((now - t0) * 1000, (now - last_t) * 1000))
                        last_t = now
                        last_tok = int(ev["tok"])
                        if stream:
                            before = len(text)
                            text += stream.push(int(ev["tok"]))
                            piece = len(text) - before
                    elif "end" in ev:
                        if ev.get("reason", "").startswith(FAILED_PREFIX):
                            reason = "failed"
                            raise RequestError(grpc.StatusCode.INTERNAL,
                                               f"the pipeline could not run the request "
                                               f"({ev['reason'][len(FAILED_PREFIX):]})")
                        finished = True
                        chunk.finished = True
                        chunk.finish_reason = ev.get("reason", ev["end"])
                        if (last_tok in adm.stop_token_ids and not adm.include_stop
                                and chunk.finish_reason == "eos"):
                            text = text[:len(text) - piece]
                        if stream:
                            text += stream.flush()
                # vLLM's min_tokens: no stop string ends it before that many tokens either
                early = n_tokens + len(chunk.token_ids) < adm.params.get("min_tokens", 0)
                cut = None if early else self._stop_at(text, adm.stop, sent_chars)
                if cut is not None:
                    text, finished = text[:cut[1] if adm.include_stop else cut[0]], True
                    self._quietly("cancel", self.sync.cancel, rid, "stop")
                    chunk.finished, chunk.finish_reason = True, "stop"
                held_back = max(hold, piece if adm.stop_token_ids else 0)
                upto = len(text) if finished else max(sent_chars, len(text) - held_back)
                chunk.text = text[sent_chars:upto]
                sent_chars = upto
                if chunk.token_ids:
                    self._observe("tokens", chunk.timing, n_tokens == 0)
                    n_tokens += len(chunk.token_ids)
                    held[0] += len(chunk.token_ids)
                if finished:
                    reason = chunk.finish_reason
                    chunk.stats = self._stats(rid, n_tokens, reason)
                    self._observe("finished", reason, len(adm.prompt), n_tokens,
                                  time.monotonic() - t0, chunk.stats)
                if chunk.token_ids or chunk.text or chunk.finished:
                    yield chunk
        except (RequestError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001 - a bug: counted once, by the finally below
            reason = "error"
            raise self.internal(e, rid, count=False) from None
        finally:
            self.owned.discard(rid)
            if not finished:
                self._quietly("cancel", self.sync.cancel, rid, "client cancelled")
                self._observe("finished", "cancelled" if reason == "client cancelled" else reason,
                              len(adm.prompt), n_tokens, time.monotonic() - t0, None)

    def _events(self, rid: str, last_id: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        """Commit / end events of ``rid`` after ``last_id``: one read, which raises while
        Redis is away (``Synchroniser.events`` waits a fixed minute; the runner bounds
        the wait itself, by ``limits.sync_outage_s``)."""
        got = self.sync.r.xread({self.sync.req_key(rid, "ev"): last_id}, block=block_ms,
                                count=256)
        return [(eid.decode(), {k.decode(): v.decode() for k, v in fields.items()})
                for _stream, items in got or [] for eid, fields in items]

    def _logprobs(self, ev: dict[str, str], want: int) -> TokenLogprobs:
        """The checked logprobs of a commit event of a request that asked for ``want``
        alternatives; a missing or malformed entry is the pipeline's fault, reported as
        INTERNAL naming the token, never a traceback."""
        try:
            if "lp" not in ev:
                raise LogprobsError("no logprobs came with it")
            return TokenLogprobs.from_wire(ev["lp"], want, self.vocab)
        except LogprobsError as e:
            raise RequestError(grpc.StatusCode.INTERNAL,
                               f"the pipeline sent bad logprobs for generated token "
                               f"{ev.get('i', '?')}: {e}") from None

    def _stats(self, rid: str, n_tokens: int, reason: str) -> SpecStats:
        """The request's figures; waits briefly for its last step's mark, which the
        barrier appends after the last token was committed (arrive.lua)."""
        deadline = time.monotonic() + 1.0
        while True:
            try:
                st = self.sync.spec_stats(rid)
            except LOST:  # Redis away as the request ends: its tokens count, not its figures
                return SpecStats()
            # each epoch's first token comes from its prefill step ('|'), the rest are marked
            complete = st.verified + st.epochs >= n_tokens
            if complete or reason == "stop" or time.monotonic() > deadline:
                return st
            time.sleep(0.01)

    @staticmethod
    def _stop_at(text: str, stops: list[str], sent: int) -> tuple[int, int] | None:
        """Where the earliest stop string in ``text`` starts and ends (None: none yet)."""
        hits = [(i, i + len(s)) for s in stops
                if (i := text.find(s, max(0, sent - len(s)))) >= 0]
        return min(hits) if hits else None
