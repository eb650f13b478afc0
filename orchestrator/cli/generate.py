"""``treepipe generate``: one prompt through a pipelined model in this process, or
through a running gateway with ``--endpoint`` (without torch)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import add_engine_flags, peer_address, positive_int, positive_seconds
from orchestrator.serving.auth import API_KEY_FILE_ENV, TLS_CA_FILE_ENV
from orchestrator.serving.client import generate_command
from orchestrator.serving.runner import fresh_seed
from protocol.errors import TreepipeError
from protocol.requests.sampling_params import SamplingError, SamplingParams
from protocol.scheduling.records import METHODS
from stages.model.execution_modes import resolve_execution
from stages.model.tokenizer import StreamDecoder

# the generate flag of each SamplingParams field, for one-line errors that name the flag
SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p",
                  "top_k": "--sample-top-k", "seed": "--seed",
                  "presence_penalty": "--presence-penalty",
                  "frequency_penalty": "--frequency-penalty",
                  "repetition_penalty": "--repetition-penalty", "min_tokens": "--min-tokens",
                  "min_p": "--min-p"}


def add_generate_parser(sub: Any) -> None:
    """Register ``treepipe generate``."""
    g = sub.add_parser("generate", help=COMMANDS["generate"])
    add_engine_flags(g)
    g.add_argument("--method", default="specpipe", choices=METHODS)
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-new-tokens", type=positive_int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-top-k", type=int, default=0, help="sampling top-k (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p times the most likely one's probability, "
                        "before top-k and top-p (vLLM's; 0 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed; absent: a fresh random one per run, as over HTTP and "
                        "gRPC (in process, printed with the stats to repeat the run)")
    # vLLM's penalties (stages.model.sampling.adjust_logits): every method verifies with
    # them, so the tokens stay ar's under the same flags
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token already generated, in "
                        "[-2, 2] (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit times its count in the generated "
                        "tokens, in [-2, 2] (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides a positive logit (multiplies a negative one) of a token in "
                        "the prompt or the output; > 0 (1 = off)")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="tokens before EOS may end the text (0 = off; at most "
                        "--max-new-tokens)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    g.add_argument("--json", action="store_true", help="print one JSON object instead")
    g.add_argument("--endpoint", default=None, type=peer_address,
                   help="HOST:PORT of a running gateway (treepipe up); the engine flags "
                        "then come from its manifest")
    g.add_argument("--stop", action="append", default=[],
                   help="stop string (repeatable; --endpoint only)")
    g.add_argument("--timeout", type=positive_seconds, default=None,
                   help="request deadline in seconds (--endpoint only)")
    g.add_argument("--api-key-file", default=os.environ.get(API_KEY_FILE_ENV, ""),
                   help="file with the gateway's bearer key (--endpoint only; default "
                        "$TREEPIPE_API_KEY_FILE, or set $TREEPIPE_API_KEY); never the key "
                        "itself on the command line")
    g.add_argument("--tls-ca-file", default=os.environ.get(TLS_CA_FILE_ENV, ""),
                   help="PEM CA certificate to verify the gateway's TLS certificate with; "
                        "given: connect over TLS (--endpoint only; default "
                        "$TREEPIPE_TLS_CA_FILE)")
    g.add_argument("--tls", action="store_true",
                   help="connect over TLS trusting gRPC's default roots (--endpoint only)")
    g.add_argument("--tls-server-name", default="",
                   help="the name the gateway's certificate must carry when it differs from "
                        "the --endpoint host (--endpoint only)")
    g.set_defaults(func=cmd_generate)


def check_in_process(a: argparse.Namespace) -> None:
    """Refuse the flags that only a gateway applies (--endpoint only): in process they
    would be dropped without a word (a --stop that never stops)."""
    given = [flag for flag, on in (
        ("--stop", bool(a.stop)), ("--timeout", a.timeout is not None),
        ("--api-key-file", a.api_key_file != os.environ.get(API_KEY_FILE_ENV, "")),
        ("--tls-ca-file", a.tls_ca_file != os.environ.get(TLS_CA_FILE_ENV, "")),
        ("--tls", a.tls), ("--tls-server-name", bool(a.tls_server_name))) if on]
    if given:
        raise TreepipeError(f"{', '.join(given)} {'works' if len(given) == 1 else 'work'} "
                            f"with --endpoint only (a gateway applies "
                            f"{'it' if len(given) == 1 else 'them'}); pass --endpoint "
                            f"HOST:PORT or leave {'it' if len(given) == 1 else 'them'} out")


def cmd_generate(a: argparse.Namespace) -> int:
    """``treepipe generate``: in process, or through a gateway with --endpoint."""
    if a.seed is None and not a.endpoint:
        # random unless seeded, as the gateway draws for a request without one; with
        # --endpoint the gateway draws it
        a.seed = fresh_seed(a.temperature)
    try:
        sampling = SamplingParams(a.temperature, a.top_p, a.sample_top_k,
                                  0 if a.seed is None else a.seed,
                                  presence_penalty=a.presence_penalty,
                                  frequency_penalty=a.frequency_penalty,
                                  repetition_penalty=a.repetition_penalty,
                                  min_tokens=a.min_tokens, min_p=a.min_p)
    except SamplingError as e:  # argparse's float() takes "nan" and "inf"; this refuses them
        raise TreepipeError(f"{SAMPLING_FLAGS[e.field]}: {e}") from None
    if a.min_tokens > a.max_new_tokens:  # as the gateway refuses min_tokens > max_tokens
        raise TreepipeError(f"--min-tokens: {a.min_tokens} is more than --max-new-tokens "
                            f"{a.max_new_tokens}; lower it")
    if not a.prompt.strip():
        raise TreepipeError("the prompt is empty; pass --prompt TEXT")
    if a.endpoint:
        return generate_command(a)
    check_in_process(a)
    # imported here: the engine needs torch, which --endpoint (a gRPC client) does not
    from orchestrator.models.loading import EngineSpec, build_engine

    spec = EngineSpec(model=a.model, stages=a.stages, draft=a.draft, draft_model=a.draft_model,
                      width=a.width, topk=a.topk, dtype=a.dtype, device=a.device,
                      link_latency_us=a.link_latency_us, link_gbps=a.link_gbps,
                      draft_vocab=a.draft_vocab, execution=a.execution, recovery=a.recovery,
                      quantize=a.quantize)
    engine, tok, _ = build_engine(spec)
    prompt = (tok.chat_ids([{"role": "user", "content": a.prompt}]) if a.chat
              else tok.encode(a.prompt))
    stream = StreamDecoder(tok, skip_special_tokens=True)

    def on_token(t: int) -> None:
        if not a.json:
            sys.stdout.write(stream.push(t))
            sys.stdout.flush()

    stop = [] if a.ignore_eos else tok.eos_token_ids
    res = engine.generate(prompt, a.max_new_tokens, sampling, a.method, stop, on_token)
    st = res.stats()
    execution = resolve_execution(a.execution, a.device)  # what auto ran as
    if a.json:
        out = {**st, "dtype": a.dtype, "execution": execution, "quantize": a.quantize,
               "seed": a.seed,
               "tokens": res.tokens,
               "text": tok.decode(res.tokens, skip_special_tokens=True)}
        print(json.dumps(out))
    else:
        sys.stdout.write(stream.flush() + "\n")
        print(f"[{st['method']} m={st['stages']} w={st['width']} k={st['topk']} "
              f"source={st['source']} {a.dtype} {execution}"
              f"{' int8' if a.quantize == 'int8' else ''}] {st['new_tokens']} tokens, "
              f"{st['steps']} steps, "
              f"{st['tokens_per_step']:.2f} tok/step, hit rate {st['hit_rate']:.2f}, "
              f"{st['flushes']} flushes"
              f"{f', seed {a.seed}' if not sampling.greedy else ''}\n"
              f"  TBT wall clock {st['tbt_wall_ms']:.1f} ms: measured, this one process "
              f"computing every stage in turn\n"
              f"  TBT pipelined  {st['tbt_pipelined_ms']:.1f} ms: modelled, each stage on its "
              f"own device (the stage times measured here, overlapped; link "
              f"{a.link_latency_us:g} µs, {a.link_gbps:g} Gbit/s). Real processes: "
              f"treepipe bench --runtime")
    return 0
