"""`treepipe serve` as vLLM users type it: the flags, and errors in the flags' words.

No pipeline starts here: every case is refused (or resolved) before the launcher runs
(tests/test_serve.py serves for real).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli.main import build_parser
from orchestrator.cli.serve import check_ports, resolve_ports, serve_manifest, use_api_key
from orchestrator.deploy.commands import gateway_command, local_endpoints
from orchestrator.deploy.launcher import check_plaintext_host, client_endpoint
from orchestrator.deploy.manifest import ManifestError, validate_manifest
from orchestrator.deploy.planner import plan_manifest
from orchestrator.deploy.redis_server import port_in_use
from orchestrator.serving.auth import API_KEY_ENV, API_KEY_FILE_ENV, TLS_CERT_FILE_ENV
from protocol.errors import TreepipeError


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser("serve").parse_args(["serve", *argv])


def cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TREEPIPE_CACHE=str(tmp_path / "cache"))
    for k in (API_KEY_ENV, API_KEY_FILE_ENV, TLS_CERT_FILE_ENV):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "serve", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def one_line(cp: subprocess.CompletedProcess[str], *needles: str, absent: str = "spec.") -> str:
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert "Traceback" not in cp.stderr and not cp.stdout, cp.stderr
    lines = [ln for ln in cp.stderr.strip().splitlines() if "warning" not in ln]
    assert len(lines) == 1, cp.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert absent not in lines[0], lines[0]  # the flags' words, not the manifest's
    return lines[0]


# ---- MODEL ---------------------------------------------------------------------------------

@pytest.mark.parametrize("model,needles", [
    ("smollm-135m", ["MODEL smollm-135m: unknown model", "known models: smollm2-135m"]),
    ("meta-llama/Llama-3.1-8B", ["does not download from the Hugging Face hub",
                                 "--local-dir ./Llama-3.1-8B", "treepipe serve ./Llama-3.1-8B"]),
    ("./no/such/folder", ["MODEL ./no/such/folder: no such file or folder"]),
    ("/no/such/model.gguf", ["no such file or folder"]),
])
def test_a_model_that_is_not_here_says_what_it_is_and_how_to_get_it(
        tmp_path: Path, model: str, needles: list[str]) -> None:
    one_line(cli(model, tmp_path=tmp_path), *needles)


def test_a_folder_without_a_config_is_named(tmp_path: Path) -> None:
    one_line(cli(str(tmp_path), tmp_path=tmp_path), f"MODEL {tmp_path}: the folder has no "
             "config.json")


# ---- ports ---------------------------------------------------------------------------------

def test_port_is_http_and_grpc_port_is_grpc() -> None:
    assert resolve_ports(serve_args("m")) == (8000, 50151)
    assert resolve_ports(serve_args("m", "--port", "9000")) == (9000, 50151)
    assert resolve_ports(serve_args("m", "--port", "0", "--grpc-port", "0")) == (0, 0)
    spec = serve_manifest(serve_args("m", "--port", "9000", "--grpc-port", "9001"))["spec"]
    assert (spec["gateway"]["httpPort"], spec["gateway"]["port"]) == (9000, 9001)


def test_http_port_still_works_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    # the README's old command: --http-port is HTTP, and with it --port keeps meaning gRPC
    assert resolve_ports(serve_args("m", "--http-port", "8000")) == (8000, 50151)
    assert resolve_ports(serve_args("m", "--port", "0", "--http-port", "0")) == (0, 0)
    assert resolve_ports(serve_args("m", "--port", "50152", "--http-port", "8001")) == (
        8001, 50152)
    assert "--http-port is deprecated" in capsys.readouterr().err
    with pytest.raises(TreepipeError, match="without --http-port"):
        resolve_ports(serve_args("m", "--port", "1", "--grpc-port", "2", "--http-port", "3"))


@pytest.mark.parametrize("flag", ["--port", "--grpc-port", "--http-port"])
def test_a_busy_port_names_the_flag_typed(tmp_path: Path, busy_port: int, flag: str) -> None:
    one_line(cli("smollm2-135m", flag, str(busy_port), tmp_path=tmp_path),
             f"{flag} {busy_port} is already in use", f"pick another {flag}")


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_host_probes_its_port_with_an_ipv6_socket() -> None:
    """``serve M --host ::1 --port N``: an IPv4 probe cannot bind ::1 and called every
    port busy."""
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    a = serve_args("m", "--host", "::1", "--port", str(port), "--grpc-port", "0")
    assert not port_in_use(port, "::1")
    check_ports(a, port, 0)  # free: no error
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))
        s.listen()
        assert port_in_use(port, "::1")
        with pytest.raises(TreepipeError, match=f"--port {port} is already in use on ::1"):
            check_ports(a, port, 0)


def test_same_http_and_grpc_port_is_refused(tmp_path: Path) -> None:
    one_line(cli("smollm2-135m", "--port", "9000", "--grpc-port", "9000", tmp_path=tmp_path),
             "--port and --grpc-port are both 9000")


def test_a_port_out_of_range_names_the_flag(tmp_path: Path) -> None:
    cp = cli("smollm2-135m", "--port", "70000", tmp_path=tmp_path)
    assert cp.returncode == 2 and "argument --port" in cp.stderr, cp.stderr


# ---- host, TLS and the API key ------------------------------------------------------------

def test_a_public_host_needs_tls_or_insecure(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    one_line(cli("smollm2-135m", "--host", "0.0.0.0", tmp_path=tmp_path),
             "--host 0.0.0.0: refusing to serve the API in plaintext", "--insecure",
             "TREEPIPE_TLS_CERT_FILE")
    monkeypatch.delenv(TLS_CERT_FILE_ENV, raising=False)
    m = validate_manifest(serve_manifest(serve_args("m", "--host", "0.0.0.0", "--insecure")))
    check_plaintext_host(m, "x")
    m = validate_manifest(serve_manifest(serve_args("m", "--host", "0.0.0.0")))
    with pytest.raises(TreepipeError, match="spec.gateway.host 0.0.0.0"):
        check_plaintext_host(m, "x")
    monkeypatch.setenv(TLS_CERT_FILE_ENV, "/etc/cert.pem")  # the gateway serves TLS
    check_plaintext_host(m, "x")
    m = validate_manifest(serve_manifest(serve_args("m", "--host", "localhost")))
    monkeypatch.delenv(TLS_CERT_FILE_ENV)
    check_plaintext_host(m, "x")


@pytest.mark.parametrize("insecure", [False, True])
def test_the_gateway_binds_the_host_and_is_insecure_only_when_asked(insecure: bool) -> None:
    flags = ["--host", "0.0.0.0", "--served-model-name", "llama"] + (
        ["--insecure"] if insecure else [])
    m, p = plan_manifest(serve_manifest(serve_args("smollm2-135m", *flags)))
    at = local_endpoints("redis://127.0.0.1:1/0", [1, 2], 50151, "0.0.0.0", insecure)
    argv = gateway_command(m, p, at)
    assert argv[argv.index("--listen") + 1] == "0.0.0.0:50151"
    assert argv[argv.index("--http-listen") + 1] == "0.0.0.0:8000"
    assert argv[argv.index("--served-model-name") + 1] == "llama"
    # without it the gateway's own check refuses plaintext beyond loopback
    assert ("--insecure" in argv) is insecure
    assert client_endpoint(m, 50151) == "127.0.0.1:50151"  # a wildcard answers on loopback


def test_host_and_insecure_are_local_only() -> None:
    d = serve_manifest(serve_args("m", "--host", "0.0.0.0"))
    d["spec"]["backend"] = "kubernetes"
    with pytest.raises(ManifestError, match="gateway.host/insecure: only for backend local"):
        validate_manifest(d)


def test_api_key_on_the_command_line_is_refused_without_echoing_it(tmp_path: Path) -> None:
    line = one_line(cli("smollm2-135m", "--api-key", "sk-very-secret", tmp_path=tmp_path),
                    "--api-key would put the secret on the command line", "--api-key-file")
    assert "sk-very-secret" not in line


def test_api_key_file_is_checked_and_handed_on_by_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one_line(cli("smollm2-135m", "--api-key-file", str(tmp_path / "none"), tmp_path=tmp_path),
             "cannot read --api-key-file")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    one_line(cli("smollm2-135m", "--api-key-file", str(empty), tmp_path=tmp_path),
             "--api-key-file", "is empty")
    # use_api_key writes os.environ (the pipeline's processes inherit it): a copy here,
    # so that nothing leaks into the tests after this one
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in (
        API_KEY_ENV, API_KEY_FILE_ENV, "VLLM_API_KEY")})
    key = tmp_path / "key"
    key.write_text("abc\n")
    use_api_key(serve_args("m", "--api-key-file", str(key)))
    assert os.environ[API_KEY_FILE_ENV] == str(key.resolve())
    del os.environ[API_KEY_FILE_ENV]
    os.environ["VLLM_API_KEY"] = "from-vllm"  # what `vllm serve` scripts export
    use_api_key(serve_args("m"))
    assert os.environ[API_KEY_ENV] == "from-vllm"


# ---- the rest, in the flags' words --------------------------------------------------------

@pytest.mark.parametrize("flags,needles", [
    (["--max-model-len", "8"], ["--max-model-len: must be >= 16"]),
    (["--context-length", "8"], ["--max-model-len: must be >= 16"]),  # the old name
    (["--concurrency", "65"], ["--concurrency: must be <= 64"]),
    (["--width", "100000"], ["--width:", "lower --width"]),
    (["--draft", "bogus"], ["--draft: unknown draft source 'bogus'"]),
    (["--served-model-name", "two words"], ["--served-model-name"]),
])
def test_errors_name_the_flag(tmp_path: Path, flags: list[str], needles: list[str]) -> None:
    one_line(cli("smollm2-135m", *flags, tmp_path=tmp_path), *needles)


def test_max_model_len_is_the_context_length() -> None:
    spec = serve_manifest(serve_args("m", "--max-model-len", "4096"))["spec"]
    assert spec["limits"]["contextLength"] == 4096 and spec["limits"]["maxNewTokens"] == 1024


def test_a_tls_gateway_is_probed_on_a_plaintext_loopback_health_port(tmp_path: Path) -> None:
    from orchestrator.deploy.launcher import Supervisor

    m, p = plan_manifest(serve_manifest(serve_args("smollm2-135m", "--host", "0.0.0.0")))
    sup = Supervisor(m, p, tmp_path, tmp_path / "serve.yaml")
    sup.health_port = 45678  # what start() picks when $TREEPIPE_TLS_CERT_FILE is set
    argv = sup.commands("redis://127.0.0.1:1/0", 50151)["gateway"]
    assert argv[argv.index("--health-listen") + 1] == "127.0.0.1:45678"
    assert argv[argv.index("--listen") + 1] == "0.0.0.0:50151" and "--insecure" not in argv


@pytest.mark.parametrize("content,needles", [
    (None, ["--chat-template", "no such file"]),
    ("", ["--chat-template", "the file is empty"]),
    ("{% for m in messages %}{{ m.content }", ["--chat-template", "not a valid Jinja template",
                                              "line 1"]),
    (b"\xff\xfe{{ x }}", ["--chat-template", "not UTF-8"]),
], ids=["missing", "empty", "syntax", "binary"])
def test_a_bad_chat_template_is_one_line(tmp_path: Path, content: str | bytes | None,
                                         needles: list[str]) -> None:
    path = tmp_path / "template.jinja"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    one_line(cli("smollm2-135m", "--chat-template", str(path), tmp_path=tmp_path), *needles)


def test_chat_template_reaches_the_gateway(tmp_path: Path) -> None:
    """--chat-template: an absolute path in the manifest, then the gateway's argv; a
    cluster manifest refuses it (the file is on this machine)."""
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        d = serve_manifest(serve_args("smollm2-135m", "--chat-template", "t.jinja"))
    finally:
        os.chdir(cwd)
    assert d["spec"]["gateway"]["chatTemplate"] == str(tmp_path / "t.jinja")
    m, p = plan_manifest(d)
    at = local_endpoints("redis://127.0.0.1:1/0", [1, 2], 50151, "127.0.0.1", False)
    argv = gateway_command(m, p, at)
    assert argv[argv.index("--chat-template") + 1] == str(tmp_path / "t.jinja")
    assert "--chat-template" not in gateway_command(*plan_manifest(serve_manifest(
        serve_args("smollm2-135m"))), at)
    d["spec"]["backend"] = "kubernetes"
    d["spec"]["gateway"].pop("httpPort")
    with pytest.raises(ManifestError, match="gateway.chatTemplate: a file on this machine"):
        validate_manifest(d)
