"""Every shipped example starts workers that accept their command lines, on both backends.

The rendered pods' and the local launcher's argument lists go through the workers'
own parser (``treepipe``'s) and the checks the worker commands run on parsed
arguments before they load weights (orchestrator/cli/worker_commands.py and gateway_commands.py).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from orchestrator.cli import gateway_commands, worker_commands
from orchestrator.cli.main import build_parser
from orchestrator.deploy.commands import config_of
from orchestrator.deploy.launcher import TREEPIPE, Supervisor
from orchestrator.deploy.manifest import ManifestError
from orchestrator.deploy.planner import Plan, load_planned
from orchestrator.deploy.render import CONFIG_FILE, render
from protocol.config.limits import MAX_CONCURRENCY
from protocol.config.pipeline import PipelineConfig
from tests.pod_config import local_config_args

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "manifests" / "examples")
                  .glob("*.yaml"))
LOCAL = [p for p in EXAMPLES if p.name == "local.yaml"][0]


@pytest.fixture(autouse=True)
def gpus_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    # the pods that ask for --device cuda run on GPU nodes; this machine may have none
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args from the container's env."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                  arg)


def accept(args: list[str], p: Plan) -> argparse.Namespace:
    """Parse ``args`` as ``treepipe`` does and run the worker's pre-load checks on them."""
    ns = build_parser().parse_args(args)
    if ns.func is worker_commands.cmd_stage:
        kwargs = worker_commands.check_stage_args(ns)
        worker_commands.check_stage_layers(ns, p.architecture.layers)
    elif ns.func is worker_commands.cmd_draft_serve:
        kwargs = worker_commands.check_draft_args(ns)
    elif ns.func is gateway_commands.cmd_gateway:
        gateway_commands.check_gateway_args(ns)
        return ns
    else:
        raise AssertionError(f"not a worker command: {args}")
    assert kwargs["layout_id"] == p.layout_id and ns.name in kwargs["participants"]
    return ns


def _check_pipeline(parsed: dict[str, argparse.Namespace], p: Plan) -> None:
    """The parsed workers form the planned pipeline: every stage, the draft, the gateway."""
    assert set(parsed) == {*(f"stage{i}" for i in range(len(p.stages))), "draft", "gateway"}
    for i, st in enumerate(p.stages):
        assert parsed[f"stage{i}"].layers == st.layers
        assert parsed[f"stage{i}"].device == st.device.type
    assert parsed["draft"].device == p.draft.device.type


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_rendered_containers_are_accepted_by_the_workers(path: Path, tmp_path: Path) -> None:
    m, p = load_planned(path)  # what `treepipe render -f` does
    parsed = {}
    objs = render(m, the_plan=p)
    for o in objs:
        tmpl = o.get("spec", {}).get("template")
        if not tmpl or o["metadata"]["labels"]["app.kubernetes.io/component"] == "redis":
            continue
        c = tmpl["spec"]["containers"][0]
        assert c["command"] == ["treepipe"]
        env = {e["name"]: e.get("value", "secret") for e in c["env"]}
        args = local_config_args(c["args"], objs, tmp_path)  # the ConfigMap's mount
        ns = accept([_expand(a, env) for a in args], p)
        parsed[ns.name if c["name"] == "stage" else c["name"]] = ns
    _check_pipeline(parsed, p)


def test_local_launcher_commands_are_accepted_by_the_workers(tmp_path: Path) -> None:
    m, p = load_planned(LOCAL)  # what `treepipe up -f` does
    argv = Supervisor(m, p, tmp_path, LOCAL).commands("redis://127.0.0.1:6379/0", 50151)
    parsed = {}
    for name, cmd in argv.items():
        assert cmd[:len(TREEPIPE)] == TREEPIPE
        parsed[name] = accept(cmd[len(TREEPIPE):], p)
    _check_pipeline(parsed, p)


def _flags(args: list[str]) -> dict[str, str]:
    """Flag -> value of an argument list, without the addresses the backends differ in."""
    out, key = {}, None
    for a in args:
        if a.startswith("--"):
            key = a
            out[key] = ""
        elif key:
            out[key] = a
    # --insecure follows from the address: plaintext gRPC beyond loopback (a pod's 0.0.0.0);
    # --config is where each backend keeps the one config (compared by content below)
    addresses = ("--redis", "--listen", "--http-listen", "--next", "--insecure", "--config")
    return {k: v for k, v in out.items() if k not in addresses}


def test_both_backends_give_the_same_flags(tmp_path: Path) -> None:
    m, p = load_planned(LOCAL)
    local = Supervisor(m, p, tmp_path, LOCAL).commands("redis://127.0.0.1:6379/0",
                                                       m.spec.gateway.port)
    pods = {}
    objs = render(m, the_plan=p)
    for o in objs:
        tmpl = o.get("spec", {}).get("template")
        if tmpl and o["metadata"]["labels"]["app.kubernetes.io/component"] != "redis":
            c = tmpl["spec"]["containers"][0]
            name = c["args"][c["args"].index("--name") + 1] if "--name" in c["args"] else "gateway"
            pods[name] = c["args"]
    assert set(pods) == set(local)
    for name, args in pods.items():
        assert _flags(args) == _flags(local[name][len(TREEPIPE):]), name
    # and one config: the local file every process names is the pods' ConfigMap key
    files = {a[a.index("--config") + 1] for a in local.values()}
    assert len(files) == 1
    pod_file = local_config_args([CONFIG_FILE], objs, tmp_path)[0]
    assert PipelineConfig.from_json(Path(files.pop()).read_text(), "local") == \
        PipelineConfig.from_json(Path(pod_file).read_text(), "pod") == config_of(m, p)


def test_the_manifests_prefill_chunk_reaches_the_gateway(tmp_path: Path) -> None:
    """limits.prefillChunk is the gateway's --prefill-chunk, which it stores with every
    request (the workers and arrive.lua count prefill steps by it)."""
    d = yaml.safe_load(LOCAL.read_text())
    d["spec"]["limits"]["prefillChunk"] = 96
    f = tmp_path / "chunk.yaml"
    f.write_text(yaml.safe_dump(d))
    m, p = load_planned(f)
    gw = Supervisor(m, p, tmp_path, f).commands("redis://127.0.0.1:6379/0", 0)["gateway"]
    assert accept(gw[len(TREEPIPE):], p).prefill_chunk == 96
    d["spec"]["limits"]["prefillChunk"] = 0
    f.write_text(yaml.safe_dump(d))
    cp = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "plan", "-f", str(f)],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode != 0 and "spec.limits.prefillChunk" in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1


def test_the_kv_budget_reaches_every_stage_and_the_gateway(tmp_path: Path) -> None:
    """Each stage's pool (and the draft model's) holds memory.kvTokens rows (its default:
    concurrency requests of a whole context at their worst case) and the gateway admits
    within the same rows,
    pricing the tree rows of the draft's width."""
    from orchestrator.deploy.planner import kv_tokens
    from protocol.scheduling.kv_blocks import pool_blocks, request_blocks

    d = yaml.safe_load(LOCAL.read_text())
    d["spec"]["limits"]["concurrency"] = 3
    f = tmp_path / "kv.yaml"
    f.write_text(yaml.safe_dump(d))
    m, p = load_planned(f)
    lim, stages = m.spec.limits, len(p.stages)
    per = request_blocks(lim.context_length, stages, m.spec.draft.width)
    assert pool_blocks(kv_tokens(m.spec)) == 3 * per  # three whole contexts fit, no more
    parsed = {name: accept(args[len(TREEPIPE):], p) for name, args in Supervisor(
        m, p, tmp_path, f).commands("redis://127.0.0.1:6379/0", 0).items()}
    assert {n: ns.kv_tokens for n, ns in parsed.items()} == dict.fromkeys(
        [*(f"stage{i}" for i in range(stages)), "draft", "gateway"], kv_tokens(m.spec))
    assert parsed["gateway"].draft_width == m.spec.draft.width
    with pytest.raises(SystemExit):  # less than one block: argparse's one-line error
        build_parser().parse_args(["gateway", "--pipeline", "x", "--kv-tokens", "8"])
    d["spec"]["memory"] = {"kvTokens": per * 16}  # one whole context of the three
    f.write_text(yaml.safe_dump(d))
    m, p = load_planned(f)
    assert any("holds 1 request(s) of a whole contextLength" in n for n in p.notes), p.notes
    d["spec"]["memory"] = {"kvTokens": per * 16 - 16}  # not even one: nothing could run
    f.write_text(yaml.safe_dump(d))
    with pytest.raises(ManifestError, match=r"spec.memory.kvTokens: .* raise it to at least"):
        load_planned(f)


@pytest.mark.parametrize("command", ["plan", "render"])
def test_cli_refuses_concurrency_above_the_batch_limit(tmp_path: Path, command: str) -> None:
    d = yaml.safe_load(LOCAL.read_text())
    d["spec"]["limits"]["concurrency"] = MAX_CONCURRENCY + 1
    bad = tmp_path / "big.yaml"
    bad.write_text(yaml.safe_dump(d))
    cp = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", command, "-f", str(bad)],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode != 0 and not cp.stdout
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1, cp.stderr
    assert "spec.limits.concurrency" in lines[0] and str(MAX_CONCURRENCY) in lines[0]


@pytest.mark.parametrize("flags, error", [
    (["--listen", "127.0.0.1:50151"], None),
    (["--listen", "localhost:0"], None),
    (["--listen", "[::1]:50151"], None),
    (["--listen", "0.0.0.0:50151", "--insecure"], None),
    (["--listen", "0.0.0.0:50151", "--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"], None),
    (["--listen", "0.0.0.0:50151"], "refusing to serve gRPC in plaintext on 0.0.0.0:50151"),
    (["--listen", "gw.example:50151"], "pass --insecure"),
    (["--listen", "127.0.0.1:0", "--tls-cert-file", "c.pem"], "--tls-key-file together"),
    (["--concurrency", "8"], None),
    (["--concurrency", "65"], "--concurrency 65 is above 64"),
])
def test_gateway_plaintext_beyond_loopback_needs_insecure(flags: list[str],
                                                           error: str | None) -> None:
    """Plaintext gRPC on loopback is the demo; anywhere else it is TLS or a conscious flag."""
    from protocol.errors import TreepipeError

    ns = build_parser().parse_args(["gateway", "--pipeline", "p", "--redis",
                                    "redis://127.0.0.1:6379/0", *flags])
    if error is None:
        gateway_commands.check_gateway_args(ns)
        return
    with pytest.raises(TreepipeError) as e:
        gateway_commands.check_gateway_args(ns)
    assert error in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_workers_without_link_keys_refuse_unless_insecure_links(
        transport: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from protocol.errors import TreepipeError
    from protocol.links.keys import LINK_KEYS_ENV, write_link_keys

    base = ["--pipeline", "p", "--redis", "redis://127.0.0.1:6379/0", "--transport", transport]
    stage = ["stage", "--name", "stage0", *base, "--layers", "0:2", "--listen",
             "127.0.0.1:5555"]
    draft = ["draft", "serve", "--name", "draft", *base, "--next", "127.0.0.1:5555"]
    monkeypatch.delenv(LINK_KEYS_ENV, raising=False)
    for args, check in ((stage, worker_commands.check_stage_args),
                        (draft, worker_commands.check_draft_args)):
        # before any weights are read: one line naming both fixes
        with pytest.raises(TreepipeError) as e:
            check(build_parser().parse_args(args))
        assert "\n" not in str(e.value)
        assert LINK_KEYS_ENV in str(e.value) and "--insecure-links" in str(e.value)
        check(build_parser().parse_args([*args, "--insecure-links"]))  # the conscious opt-out
        # keys for the other transport only: one line too
        other = "grpc" if transport == "zmq" else "zmq"
        monkeypatch.setenv(LINK_KEYS_ENV, str(write_link_keys(tmp_path / other, (other,))))
        with pytest.raises(TreepipeError, match=f"--transport {transport}"):
            check(build_parser().parse_args(args))
        monkeypatch.setenv(LINK_KEYS_ENV, str(write_link_keys(tmp_path / transport,
                                                              (transport,))))
        check(build_parser().parse_args(args))
        monkeypatch.delenv(LINK_KEYS_ENV)


def test_link_keys_command_writes_private_keys(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    ns = build_parser().parse_args(["link-keys", str(tmp_path / "k"), "--transport", "zmq"])
    assert ns.func(ns) == 0
    assert capsys.readouterr().out.strip() == f"export TREEPIPE_LINK_KEYS={tmp_path / 'k'}"
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == ["curve.public",
                                                                   "curve.secret"]


@pytest.mark.parametrize("execution,quantize", [("eager", "none"), ("tuned", "int8"),
                                                ("compiled", "none")])
def test_the_execution_mode_reaches_every_stage_and_the_draft(tmp_path: Path, execution: str,
                                                              quantize: str) -> None:
    """model.execution and model.quantize reach the workers (their --config) on both
    backends' one builder."""
    d = yaml.safe_load(LOCAL.read_text())
    d["spec"]["model"]["execution"] = execution
    d["spec"]["model"]["quantize"] = quantize
    f = tmp_path / "x.yaml"
    f.write_text(yaml.safe_dump(d))
    m, p = load_planned(f)
    parsed = {name: accept(args[len(TREEPIPE):], p) for name, args in Supervisor(
        m, p, tmp_path, f).commands("redis://127.0.0.1:6379/0", 0).items()}
    workers = {n: (ns.execution, ns.quantize) for n, ns in parsed.items() if n != "gateway"}
    assert workers == dict.fromkeys([*(f"stage{i}" for i in range(len(p.stages))), "draft"],
                                    (execution, quantize))
    stage = ["stage", "--pipeline", "x", "--redis", "redis://h:1/0", "--name", "s",
             "--layers", "0:1", "--listen", "127.0.0.1:1"]
    assert build_parser().parse_args([*stage, "--compile"]).execution == "compiled"
    assert build_parser().parse_args([*stage, "--eager"]).execution == "eager"
    with pytest.raises(SystemExit):  # one mode at a time
        build_parser().parse_args([*stage, "--eager", "--compile"])
