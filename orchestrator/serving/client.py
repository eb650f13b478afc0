"""A small Python client for a treepipe gateway.

    from orchestrator.serving.client import Client
    with Client("127.0.0.1:50151") as c:
        out = c.generate(prompt="def fib(n):", max_tokens=32)
        print(out.text)

The bearer key comes from ``api_key``, else ``$TREEPIPE_API_KEY_FILE`` /
``$TREEPIPE_API_KEY``; TLS from ``tls_ca_file`` (else ``$TREEPIPE_TLS_CA_FILE``) or
``tls=True`` (gRPC's default roots).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.serving.auth import TLS_CA_FILE_ENV, channel, env_api_key, read_api_key
from protocol import treepipe_pb2, treepipe_pb2_grpc
from protocol.errors import RuntimeFailure, TreepipeError


@dataclass
class Completion:
    """A finished request: tokens, text, why it ended, and per-token timing (ms)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    request_id: str = ""
    queue_ms: float = 0.0
    since_request_ms: list[float] = field(default_factory=list)
    # with logprobs=K: one TokenLogprobs message per token (logprob, top: token_id, logprob)
    logprobs: list[Any] = field(default_factory=list)

    def add(self, chunk: Any) -> None:
        """Fold one GenerateChunk into the completion."""
        self.tokens += list(chunk.token_ids)
        self.text += chunk.text
        self.since_request_ms += [t.since_request_ms for t in chunk.timing]
        self.logprobs += list(chunk.logprobs)
        self.request_id, self.queue_ms = chunk.request_id, chunk.queue_ms
        if chunk.finished:
            self.finish_reason = chunk.finish_reason

    @property
    def ttft_ms(self) -> float:
        return self.since_request_ms[0] if self.since_request_ms else 0.0

    @property
    def tbt_ms(self) -> float:
        """Mean time between tokens after the first."""
        t = self.since_request_ms
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0


class Client:
    """Blocking gRPC client of ``treepipe.v1.Inference``."""

    def __init__(self, endpoint: str, api_key: str | None = None, tls_ca_file: str | None = None,
                 tls: bool = False, tls_server_name: str = ""):
        """``api_key``/``tls_ca_file`` None: from the environment (see the module); "": none."""
        self.endpoint = endpoint
        key = env_api_key() if api_key is None else api_key
        # every call carries it, health too (the gateway leaves health open anyway)
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()
        ca = os.environ.get(TLS_CA_FILE_ENV, "") if tls_ca_file is None else tls_ca_file
        self.channel = channel(endpoint, tls, ca, tls_server_name)
        self.stub = treepipe_pb2_grpc.InferenceStub(self.channel)

    def request(self, prompt: str = "", messages: Sequence[dict[str, str]] = (),
                prompt_ids: Sequence[int] = (), max_tokens: int = 0,
                temperature: float | None = None, top_p: float = 1.0, top_k: int = 0,
                seed: int | None = None,
                stop: Sequence[str] = (), ignore_eos: bool = False,
                model: str = "", presence_penalty: float = 0.0,
                frequency_penalty: float = 0.0, repetition_penalty: float | None = None,
                logit_bias: dict[int, float] | None = None,
                min_tokens: int = 0, logprobs: int | None = None,
                response_format: dict[str, Any] | None = None, min_p: float = 0.0
                ) -> treepipe_pb2.GenerateRequest:
        """Build a GenerateRequest message; ``temperature`` None: the gateway's default,
        1.0 (as over HTTP; 0 is greedy); ``seed`` None: the gateway draws a fresh one
        when sampling (as the HTTP API does), so two unseeded requests differ.  The
        penalties, ``logit_bias``, ``min_tokens`` and ``min_p`` have vLLM's meaning
        (docs/serving.md);
        ``logprobs`` K (0 to 20) reports each token's logprob and K alternatives;
        ``response_format`` is OpenAI's object (``{"type": "json_schema", "json_schema":
        {"schema": ...}}``), sent as JSON text."""
        return treepipe_pb2.GenerateRequest(
            model=model, prompt=prompt, prompt_ids=list(prompt_ids), max_tokens=max_tokens,
            messages=[treepipe_pb2.ChatMessage(role=m["role"], content=m["content"])
                      for m in messages],
            sampling=treepipe_pb2.SamplingParams(
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                repetition_penalty=repetition_penalty, logit_bias=logit_bias or {},
                min_tokens=min_tokens, min_p=min_p),
            stop=list(stop), ignore_eos=ignore_eos, logprobs=logprobs,
            response_format=None if response_format is None else json.dumps(response_format))

    def stream(self, timeout_s: float | None = None, **kw: Any) -> Iterator[Any]:
        """Yield GenerateChunk messages as tokens are verified."""
        return self.stub.Generate(self.request(**kw), timeout=timeout_s, metadata=self.metadata)

    def generate(self, timeout_s: float | None = None, **kw: Any) -> Completion:
        """Run one request to the end."""
        out = Completion()
        for chunk in self.stream(timeout_s, **kw):
            out.add(chunk)
        return out

    def health(self, service: str = "", timeout_s: float = 2.0) -> str:
        """SERVING / NOT_SERVING / UNKNOWN of the gateway's health service."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s,
                          metadata=self.metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# gRPC statuses that say the request itself was wrong (the CLI exits 2 on them, 1 else)
USAGE_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE})


def generate_command(a: Any) -> int:
    """``treepipe generate --endpoint HOST:PORT``: the in-process command's flags, over gRPC."""
    import json
    import sys


    kw: dict[str, Any] = dict(max_tokens=a.max_new_tokens, temperature=a.temperature,
                              top_p=a.top_p, top_k=a.sample_top_k, seed=a.seed, stop=a.stop,
                              ignore_eos=a.ignore_eos, presence_penalty=a.presence_penalty,
                              frequency_penalty=a.frequency_penalty,
                              # absent on the wire is off (treepipe.proto)
                              repetition_penalty=a.repetition_penalty
                              if a.repetition_penalty != 1.0 else None,
                              min_tokens=a.min_tokens, min_p=a.min_p)
    if a.chat:
        kw["messages"] = [{"role": "user", "content": a.prompt}]
    else:
        kw["prompt"] = a.prompt
    out = Completion()
    # the key from a file or the environment, never from the command line (ps shows it)
    with Client(a.endpoint, api_key=read_api_key(a.api_key_file) or "",
                tls_ca_file=a.tls_ca_file, tls=a.tls, tls_server_name=a.tls_server_name) as c:
        try:
            for chunk in c.stream(a.timeout, **kw):
                out.add(chunk)
                if not a.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        except grpc.RpcError as e:
            details = " ".join((e.details() or "").split())
            if e.code() == grpc.StatusCode.UNAVAILABLE and "connect" in details:
                # a TLS mismatch looks like any failed connection: name both causes
                details += ("; is the gateway up, and does it serve TLS (pass --tls-ca-file) "
                            "or plaintext (leave it out)?")
            # the request's own fault is a usage error (2); a gateway that is down, busy
            # or failing is a runtime failure (1), worth a retry
            error = TreepipeError if e.code() in USAGE_CODES else RuntimeFailure
            raise error(f"{e.code().name.lower()}: {details}") from None
    stats = {"endpoint": a.endpoint, "request_id": out.request_id,
             "new_tokens": len(out.tokens), "finish_reason": out.finish_reason,
             "ttft_ms": out.ttft_ms, "tbt_wall_ms": out.tbt_ms}
    if a.json:
        print(json.dumps({**stats, "tokens": out.tokens, "text": out.text}))
    else:
        print(f"\n[{a.endpoint}] {len(out.tokens)} tokens ({out.finish_reason}), "
              f"TTFT {out.ttft_ms:.0f} ms, TBT wall {out.tbt_ms:.1f} ms")
    return 0
