"""Key material of a pipeline's stage links: who may push frames into a stage's inbox.

One set of keys per pipeline, shared by all its participants (stage workers and the
draft service); a process without them cannot deliver a frame:

* ZeroMQ: one CURVE keypair (``curve.public``, ``curve.secret``, Z85 text).  Every inbox
  is a CURVE server with that keypair; every outbox is a CURVE client with the same
  keypair that knows the server's public key.  A ZAP handler in each worker admits
  only clients that prove they hold the pipeline's secret key.  The frames are
  encrypted (CurveZMQ).
* gRPC: TLS with client authentication.  A per-pipeline CA (``ca.crt``; its private key
  is thrown away once it has signed) and one certificate + key (``link.crt``,
  ``link.key``) signed by it, for the name :data:`LINK_SERVER_NAME`, that every
  participant presents as server and as client.

The keys travel by file only: ``$TREEPIPE_LINK_KEYS`` names a directory (mode 0700,
files 0600 locally; a Secret mounted read-only on Kubernetes).  Without it, opening a
link fails in one line unless the worker was started with ``--insecure-links``.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from protocol.errors import TreepipeError

TRANSPORTS = ("zmq", "grpc")  # the stage links' transports (protocol.links.transport)
LINK_KEYS_ENV = "TREEPIPE_LINK_KEYS"
LINK_SERVER_NAME = "treepipe-link"  # the name in link.crt; clients check it, not the host
CURVE_PUBLIC, CURVE_SECRET = "curve.public", "curve.secret"
CA_CERT, LINK_CERT, LINK_KEY = "ca.crt", "link.crt", "link.key"
KEY_FILES = (CURVE_PUBLIC, CURVE_SECRET, CA_CERT, LINK_CERT, LINK_KEY)
CERT_DAYS = 3650  # the keys live as long as the pipeline (local: until the next `up`)


class LinkKeysError(TreepipeError, ValueError):
    """Link keys that are missing, unreadable or of the wrong shape."""


def missing_keys_message() -> str:
    """The one line a worker prints when it has no link keys."""
    return (f"stage links need the pipeline's keys: set ${LINK_KEYS_ENV} to their directory "
            "(treepipe up and the operator do; `treepipe link-keys DIR` makes one), or pass "
            "--insecure-links to run them unauthenticated")


@dataclass(frozen=True)
class LinkKeys:
    """The pipeline's link keys, read from a directory (files absent for a transport that
    the pipeline does not use are None)."""

    curve_public: bytes | None = None
    curve_secret: bytes | None = None
    ca_cert: bytes | None = None
    link_cert: bytes | None = None
    link_key: bytes | None = None

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> LinkKeys:
        """Read the key files under ``folder`` (one line naming the problem otherwise)."""
        d = Path(folder)
        if not d.is_dir():
            raise LinkKeysError(f"${LINK_KEYS_ENV}={d} is not a directory of link keys; "
                                "`treepipe link-keys DIR` makes one")

        def read(name: str) -> bytes | None:
            try:
                return (d / name).read_bytes().strip() or None
            except FileNotFoundError:
                return None
            except OSError as e:
                raise LinkKeysError(f"cannot read link key {d / name}: {e.strerror}") from None

        keys = cls(*(read(n) for n in KEY_FILES))
        if not (keys.curve_secret or keys.link_key):
            raise LinkKeysError(f"{d} holds no link keys ({', '.join(KEY_FILES)}); "
                                "`treepipe link-keys DIR` makes them")
        return keys

    @classmethod
    def from_env(cls) -> LinkKeys | None:
        """The keys named by ``$TREEPIPE_LINK_KEYS``, or None when it is not set."""
        folder = os.environ.get(LINK_KEYS_ENV, "")
        return cls.load(folder) if folder else None

    def curve(self) -> tuple[bytes, bytes]:
        """(public, secret) Z85 CURVE keys, or one line saying what is missing."""
        if not zmq.has("curve"):
            raise LinkKeysError("this libzmq has no CURVE support; install pyzmq's wheel "
                                "(bundled libzmq with libsodium) or use --transport grpc")
        if not (self.curve_public and self.curve_secret):
            raise LinkKeysError(f"the link keys have no {CURVE_PUBLIC}/{CURVE_SECRET} for "
                                "--transport zmq; regenerate them with `treepipe link-keys`")
        if len(self.curve_public) != 40 or len(self.curve_secret) != 40:
            raise LinkKeysError(f"{CURVE_PUBLIC}/{CURVE_SECRET} are not 40-character Z85 "
                                "CURVE keys")
        return self.curve_public, self.curve_secret

    def tls(self) -> tuple[bytes, bytes, bytes]:
        """(CA certificate, link certificate, link key) PEM, or one line saying what is
        missing."""
        if not (self.ca_cert and self.link_cert and self.link_key):
            raise LinkKeysError(f"the link keys have no {CA_CERT}/{LINK_CERT}/{LINK_KEY} for "
                                "--transport grpc; regenerate them with `treepipe link-keys`")
        return self.ca_cert, self.link_cert, self.link_key


def resolve(keys: LinkKeys | None, insecure: bool) -> LinkKeys | None:
    """The keys a link uses: ``keys``, else ``$TREEPIPE_LINK_KEYS``; None (plaintext) only
    with ``insecure``; else one line naming the fix."""
    if keys is None:
        keys = LinkKeys.from_env()
    if keys is None and not insecure:
        raise LinkKeysError(missing_keys_message())
    return keys


# ---- generation -----------------------------------------------------------------------------
def curve_files() -> dict[str, bytes]:
    """A fresh CURVE keypair as key files."""
    if not zmq.has("curve"):
        raise LinkKeysError("this libzmq has no CURVE support; install pyzmq's wheel "
                            "(bundled libzmq with libsodium) or use --transport grpc")
    public, secret = zmq.curve_keypair()
    return {CURVE_PUBLIC: public, CURVE_SECRET: secret}


def tls_files() -> dict[str, bytes]:
    """A fresh CA and a link certificate + key signed by it (the CA's key is discarded)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise LinkKeysError("gRPC link keys need the `cryptography` package: "
                            "pip install cryptography") from None
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=CERT_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "treepipe link CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False),
                         critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        LINK_SERVER_NAME)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(LINK_SERVER_NAME)]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return {CA_CERT: ca.public_bytes(pem), LINK_CERT: cert.public_bytes(pem),
            LINK_KEY: key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())}


def key_files(transports: tuple[str, ...] = TRANSPORTS) -> dict[str, bytes]:
    """Fresh link keys for ``transports`` as {file name: content} (for a Secret or a dir)."""
    files: dict[str, bytes] = {}
    if "zmq" in transports:
        files.update(curve_files())
    if "grpc" in transports:
        files.update(tls_files())
    return files


def write_link_keys(folder: str | os.PathLike[str],
                    transports: tuple[str, ...] = ("zmq", "grpc"), replace: bool = True) -> Path:
    """Write fresh keys to ``folder``: a new or empty folder (made 0700), or one that holds
    only link keys, which are replaced if ``replace`` (each file 0600 from the start); a
    file or another folder with things in it is refused in one line."""
    d = Path(folder)
    if not check_key_folder(d, replace):
        try:
            d.mkdir(mode=0o700, parents=True)
        except OSError as e:
            raise LinkKeysError(f"cannot create the link-key folder {d}: {e.strerror}; "
                                "name a folder that can be created") from None
        os.chmod(d, 0o700)  # mkdir's mode passes through the umask
    try:
        if not any(d.iterdir()):  # an empty folder: nothing else shares its mode
            os.chmod(d, 0o700)
        for name in KEY_FILES:  # an earlier run's keys of another transport go too
            (d / name).unlink(missing_ok=True)
        for name, content in key_files(transports).items():
            write_private(d / name, content)
    except OSError as e:  # another user's folder, a read-only one
        raise LinkKeysError(f"cannot write link keys in {d}: {e.strerror}; name a folder "
                            "of your own") from None
    return d


def check_key_folder(d: Path, replace: bool) -> bool:
    """Whether ``d`` exists and may take fresh keys (empty, or holding only link keys and
    ``replace``); False when it does not exist; one line naming the fix otherwise.  Keys
    are never written among other files, nor a folder's mode changed under them."""
    if not d.exists() and not d.is_symlink():
        return False
    if not d.is_dir():
        raise LinkKeysError(f"{d} exists and is not a folder; name a new folder for the "
                            "link keys")
    try:
        names = {p.name for p in d.iterdir()}
    except OSError as e:
        raise LinkKeysError(f"cannot read the folder {d}: {e.strerror}; name a new folder "
                            "for the link keys") from None
    if names - set(KEY_FILES):
        raise LinkKeysError(f"{d} is a folder with other files in it, not a link-key "
                            "folder; name a new folder for the link keys")
    if names and not replace:
        raise LinkKeysError(f"{d} already holds link keys; pass --force to replace them "
                            "(running pipelines keep the old keys until restarted), or name "
                            "a new folder")
    return True


def write_private(path: Path, content: bytes) -> Path:
    """Write a secret to ``path``, readable by this user only: 0600 from creation, so it
    is never readable by others for an instant (an older file there is replaced)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    return path


# ---- ZeroMQ: CURVE sockets and the ZAP handler ----------------------------------------------
class _OnlyKey:
    """ZAP credentials provider that admits one client public key."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether ``key`` (Z85) is the pipeline's key."""
        return key == self.public


_auth_lock = threading.Lock()
_auth: Any = None  # the process's zmq ThreadAuthenticator, started once


def curve_domain(public: bytes) -> str:
    """The ZAP domain of a pipeline's inboxes (distinct pipelines in one process stay apart)."""
    return "treepipe-" + hashlib.sha256(public).hexdigest()[:16]


def curve_server(sock: zmq.Socket[Any], keys: LinkKeys) -> None:
    """Make ``sock`` (before bind) a CURVE server that admits only the pipeline's clients."""
    global _auth
    public, secret = keys.curve()
    domain = curve_domain(public)
    with _auth_lock:
        if _auth is None:
            from zmq.auth.thread import ThreadAuthenticator

            _auth = ThreadAuthenticator(zmq.Context.instance())
            _auth.start()
        _auth.configure_curve_callback(domain=domain, credentials_provider=_OnlyKey(public))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.zap_domain = domain.encode()
    sock.curve_server = True


def curve_client(sock: zmq.Socket[Any], keys: LinkKeys) -> None:
    """Make ``sock`` (before connect) a CURVE client holding the pipeline's keypair."""
    public, secret = keys.curve()
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = public


# ---- gRPC: mutual TLS -----------------------------------------------------------------------
def grpc_server_credentials(keys: LinkKeys) -> Any:
    """Server credentials that demand a client certificate signed by the pipeline's CA."""
    import grpc

    ca, cert, key = keys.tls()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=True)


def grpc_channel_credentials(keys: LinkKeys) -> Any:
    """Channel credentials that trust only the pipeline's CA and present its link cert
    (dial with ``grpc.ssl_target_name_override`` = :data:`LINK_SERVER_NAME`)."""
    import grpc

    ca, cert, key = keys.tls()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)
