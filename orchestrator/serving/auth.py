"""Client-API secrets shared by the gateway and its clients: the bearer key and TLS files.

One scheme for both front ends: the gateway reads one API key (``--api-key-file`` /
``$TREEPIPE_API_KEY_FILE``, else ``$TREEPIPE_API_KEY``; never a command line); the
HTTP API wants it as ``Authorization: Bearer <key>``, gRPC as ``authorization:
Bearer <key>`` call metadata (:class:`BearerAuth`).  gRPC can also run over TLS from
a PEM cert/key pair, and the HTTP API over HTTPS from the same pair; clients trust a
CA file.  Plaintext gRPC or HTTP on an address other than loopback needs
``--insecure`` (:func:`check_plaintext`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import ssl
from collections.abc import Callable
from typing import Any

import grpc

from protocol.errors import TreepipeError

API_KEY_FILE_ENV, API_KEY_ENV = "TREEPIPE_API_KEY_FILE", "TREEPIPE_API_KEY"
TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV = "TREEPIPE_TLS_CERT_FILE", "TREEPIPE_TLS_KEY_FILE"
TLS_CA_FILE_ENV = "TREEPIPE_TLS_CA_FILE"
# probes (kubelet, `treepipe up --detach`) carry no key: health stays open
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
UNAUTHENTICATED = ("missing or wrong API key; send 'authorization: Bearer <key>' metadata "
                   "(treepipe generate --api-key-file FILE, or $TREEPIPE_API_KEY)")


def read_api_key(path: str, flag: str = "--api-key-file") -> str | None:
    """The bearer key from ``path``, else ``$TREEPIPE_API_KEY``; None when neither is set."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise TreepipeError(f"cannot read {flag} {path}: {e.strerror}") from None
        except UnicodeDecodeError:  # a key is text: this is some other file
            raise TreepipeError(f"{flag} {path} is not UTF-8 text; write the key (text) "
                                "into it") from None
        if not key:
            raise TreepipeError(f"{flag} {path} is empty; write the key")
        return key
    return os.environ.get(API_KEY_ENV) or None


def env_api_key() -> str | None:
    """The key a client sends by default: ``$TREEPIPE_API_KEY_FILE``, else ``$TREEPIPE_API_KEY``."""
    return read_api_key(os.environ.get(API_KEY_FILE_ENV, ""), f"${API_KEY_FILE_ENV}")


def read_pem(path: str, flag: str) -> bytes:
    """A PEM file's bytes, or a one-line error naming the flag."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TreepipeError(f"cannot read {flag} {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise TreepipeError(f"{flag} {path} is not a PEM file (no -----BEGIN line)")
    return data


def is_loopback(listen: str) -> bool:
    """Whether ``HOST:PORT`` binds only this machine's loopback interface."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, "" or 0.0.0.0-style wildcard: other machines may reach it
        return False


def check_plaintext(listen: str, tls: bool, insecure: bool, api: str = "gRPC") -> None:
    """Refuse plaintext ``api`` (gRPC, HTTP) on a non-loopback address unless ``--insecure``."""
    if tls or insecure or is_loopback(listen):
        return
    raise TreepipeError(f"refusing to serve {api} in plaintext on {listen}: other machines "
                        f"could read and change requests; pass --tls-cert-file and "
                        f"--tls-key-file, listen on 127.0.0.1, or pass --insecure (e.g. TLS "
                        f"ends at a proxy or mesh in front)")


def _bearer(metadata: Any) -> str:
    """The token of the call's ``authorization: Bearer <token>`` metadata, or ''."""
    for k, v in metadata or ():
        if k == "authorization" and isinstance(v, str):
            scheme, _, token = v.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


class BearerAuth(grpc.ServerInterceptor):
    """Refuse every call but health without the API key, as UNAUTHENTICATED."""

    def __init__(self, key: str):
        self.key = key.encode()

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        if details.method.startswith(OPEN_PREFIXES):
            return continuation(details)
        # constant-time, so the key cannot be guessed byte by byte from response times
        if hmac.compare_digest(_bearer(details.invocation_metadata).encode(), self.key):
            return continuation(details)
        handler = continuation(details)
        return None if handler is None else _deny(handler)


def _deny(handler: Any) -> Any:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""
    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](abort)


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS credentials of the gateway from a PEM certificate (chain) and its private key."""
    cert = read_pem(cert_file, "--tls-cert-file")
    key = read_pem(key_file, "--tls-key-file")
    return grpc.ssl_server_credentials([(key, cert)])


def http_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The HTTP API's TLS context from the same PEM pair as the gRPC API's."""
    read_pem(cert_file, "--tls-cert-file")  # one-line errors for a missing or bad file
    read_pem(key_file, "--tls-key-file")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        raise TreepipeError(f"--tls-cert-file {cert_file} and --tls-key-file {key_file} do not "
                            f"make a TLS identity ({e.reason}); pass a certificate and its own "
                            f"private key") from None
    return ctx


def channel(endpoint: str, tls: bool = False, ca_file: str = "",
            server_name: str = "") -> grpc.Channel:
    """A channel to ``endpoint``: TLS when ``tls`` or ``ca_file`` (trusting that CA, else
    gRPC's default roots), plaintext otherwise."""
    if not (tls or ca_file):
        return grpc.insecure_channel(endpoint)
    roots = read_pem(ca_file, "--tls-ca-file") if ca_file else None
    # a certificate issued for a DNS name, reached through an IP or a tunnel
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(roots), options=options)
