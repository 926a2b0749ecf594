"""Real stores with TLS and authentication switched on, for the security tests.

Nothing here is mocked: :func:`make_pki` writes a throw-away certificate authority and
certificates (made with the ``cryptography`` package), :class:`SecureRedis` runs a redis-server
that only speaks TLS (``--port 0 --tls-port N``, client certificates required) with the
``default`` user switched off, :class:`AclRedis` runs a plain-TCP redis-server with the same ACL
users, and :class:`SecureEtcd` runs one etcd member serving gRPC on an ``https://`` listener
(client certificates required) and on a plain ``http://`` listener, with etcd authentication
enabled.

A second, unrelated authority ("rogue") signs certificates that the servers must refuse and a
server certificate that clients must refuse, to test the untrusted-certificate paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import quote, urlencode

import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from celery_crawl.up import find_redis_server
from tests.servers import etcd_binary, free_port, wait_until

__all__ = [
    "ADMIN_USER",
    "AclRedis",
    "Pki",
    "SecureEtcd",
    "SecureRedis",
    "make_pki",
]

#: Administrative user created on every server (Redis ACL user / etcd ``root``).
ADMIN_USER = "admin"
_DAY = datetime.timedelta(days=1)


# -- certificates ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Pki:
    """Paths of one test PKI.

    Attributes:
        dir: directory holding every file.
        ca: the trusted authority's certificate.
        server_cert/server_key: server certificate for 127.0.0.1 and localhost, by ``ca``.
        client_cert/client_key: client certificate (CN ``crawl-client``), signed by ``ca``.
        rogue_ca: an unrelated authority nobody trusts.
        rogue_server_cert/rogue_server_key: server certificate signed by ``rogue_ca``.
        rogue_client_cert/rogue_client_key: client certificate signed by ``rogue_ca``.
        expired_client_cert/expired_client_key: client certificate by ``ca`` that has expired.
        other_host_cert/other_host_key: server certificate by ``ca`` for ``other.example`` only.
    """

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_server_cert: Path
    rogue_server_key: Path
    rogue_client_cert: Path
    rogue_client_key: Path
    expired_client_cert: Path
    expired_client_key: Path
    other_host_cert: Path
    other_host_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    # P-256 keys are generated in microseconds, unlike RSA; every TLS stack here accepts them.
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "celery-crawl tests"),
        x509.NameAttribute(NameOID.COMMON_NAME, cn),
    ])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _authority(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn)).issuer_name(_name(cn))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - _DAY).not_valid_after(now + 30 * _DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], cn: str, *, server: bool,
    expired: bool = False, names: tuple[str, ...] = ("localhost", "127.0.0.1"),
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert, ca_key = ca
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    start, end = (now - 10 * _DAY, now - 5 * _DAY) if expired else (now - _DAY, now + 30 * _DAY)
    # etcd also dials its own listener as a client (grpc-gateway), so servers get clientAuth too.
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server
              else [ExtendedKeyUsageOID.CLIENT_AUTH])
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn)).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=True,
            data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            ca_key.public_key()), critical=False)
    )
    if server:
        sans: list[x509.GeneralName] = []
        for name in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                sans.append(x509.DNSName(name))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(directory: Path) -> Pki:
    """Write a trusted CA, a rogue CA and their server/client certificates under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _authority("celery-crawl test CA")
    rogue = _authority("rogue CA")
    files: dict[str, Path] = {}

    def save(stem: str, pair: tuple[x509.Certificate, ec.EllipticCurvePrivateKey]) -> None:
        files[f"{stem}_cert"] = directory / f"{stem}.crt"
        files[f"{stem}_key"] = directory / f"{stem}.key"
        _write_cert(files[f"{stem}_cert"], pair[0])
        _write_key(files[f"{stem}_key"], pair[1])

    save("ca", ca)
    save("rogue_ca", rogue)
    save("server", _leaf(ca, "localhost", server=True))
    save("client", _leaf(ca, "crawl-client", server=False))
    save("rogue_server", _leaf(rogue, "localhost", server=True))
    save("rogue_client", _leaf(rogue, "crawl-client", server=False))
    save("expired_client", _leaf(ca, "crawl-client", server=False, expired=True))
    save("other_host", _leaf(ca, "other.example", server=True, names=("other.example",)))
    return Pki(
        dir=directory, ca=files["ca_cert"], server_cert=files["server_cert"],
        server_key=files["server_key"], client_cert=files["client_cert"],
        client_key=files["client_key"], rogue_ca=files["rogue_ca_cert"],
        rogue_server_cert=files["rogue_server_cert"], rogue_server_key=files["rogue_server_key"],
        rogue_client_cert=files["rogue_client_cert"], rogue_client_key=files["rogue_client_key"],
        expired_client_cert=files["expired_client_cert"],
        expired_client_key=files["expired_client_key"],
        other_host_cert=files["other_host_cert"], other_host_key=files["other_host_key"],
    )


# -- process handling --------------------------------------------------------------------------
def _tmp_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _kill_group(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _secret() -> str:
    # Distinctive enough that finding it in any output can only mean it leaked.
    return f"pw-{secrets.token_hex(12)}"


# -- Redis -------------------------------------------------------------------------------------
class _RedisBase:
    """A redis-server whose ``default`` user is off and whose ``admin`` user can do anything."""

    tls: bool = False

    def __init__(self, pki: Pki | None = None) -> None:
        self.pki = pki
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="crawl-sec-redis-", dir=_tmp_root()))
        self.admin_password = _secret()
        self.proc: subprocess.Popen[bytes] | None = None

    # subclasses add their listener options
    def _listen_args(self) -> list[str]:
        raise NotImplementedError

    @property
    def scheme(self) -> str:
        return "rediss" if self.tls else "redis"

    def start(self) -> _RedisBase:
        acl = self.dir / "users.acl"
        acl.write_text(
            "user default off\n"
            f"user {ADMIN_USER} on >{self.admin_password} ~* &* +@all\n")
        args = [
            find_redis_server(), *self._listen_args(),
            "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "", "--appendonly", "no",
            "--logfile", str(self.dir / "redis.log"), "--aclfile", str(acl),
            "--protected-mode", "no",
        ]
        self.proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_until(lambda: self.admin().ping(), 15, what=f"{self.scheme} redis on {self.port}")
        return self

    def client_kwargs(self) -> dict[str, object]:
        """TLS keyword arguments for redis-py (empty for plain TCP)."""
        return {}

    def admin(self) -> redis.Redis:
        """A redis-py client authenticated as the administrative user."""
        return redis.Redis(host="127.0.0.1", port=self.port, username=ADMIN_USER,
                           password=self.admin_password, socket_timeout=5,
                           socket_connect_timeout=5, **self.client_kwargs())  # type: ignore[arg-type]

    def add_user(self, name: str, rules: Iterable[str], password: str | None = None) -> str:
        """Create (or reset) ACL user ``name`` with ``rules``; returns its password."""
        password = password or _secret()
        self.admin().execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}",
                                     *rules)
        return password

    def url(self, user: str | None = None, password: str | None = None, *, db: int = 0,
            **query: str) -> str:
        """A store URL for this server; TLS servers get the CA and client cert by default."""
        auth = ""
        if user is not None or password is not None:
            auth = quote(user or "", safe="")
            if password is not None:
                auth += ":" + quote(password, safe="")
            auth += "@"
        url = f"{self.scheme}://{auth}127.0.0.1:{self.port}/{db}"
        return url + (f"?{urlencode(query)}" if query else "")

    def stop(self) -> None:
        _kill_group(self.proc)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class AclRedis(_RedisBase):
    """Plain-TCP redis-server with ACL users only (``redis://user:pass@``)."""

    def _listen_args(self) -> list[str]:
        return ["--port", str(self.port)]


class SecureRedis(_RedisBase):
    """redis-server speaking only TLS, requiring client certificates signed by ``pki.ca``.

    ``cert``/``key`` replace the server certificate (e.g. one issued for another host name);
    the administrative client skips the host-name check so it can manage such a server.
    """

    tls = True

    def __init__(self, pki: Pki, *, cert: Path | None = None, key: Path | None = None) -> None:
        super().__init__(pki)
        self.cert = cert or pki.server_cert
        self.key = key or pki.server_key

    def _listen_args(self) -> list[str]:
        assert self.pki is not None
        return ["--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.pki.ca), "--tls-auth-clients", "yes"]

    def client_kwargs(self) -> dict[str, object]:
        assert self.pki is not None
        return {"ssl": True, "ssl_ca_certs": str(self.pki.ca), "ssl_check_hostname": False,
                "ssl_certfile": str(self.pki.client_cert),
                "ssl_keyfile": str(self.pki.client_key), "ssl_cert_reqs": "required"}

    def tls_query(self, *, ca: Path | None = None, cert: Path | None = None,
                  key: Path | None = None, client_cert: bool = True) -> dict[str, str]:
        """The ``rediss://`` query options (CA, client certificate) to put in a URL."""
        assert self.pki is not None
        query = {"ssl_ca_certs": str(ca or self.pki.ca), "ssl_cert_reqs": "required"}
        if client_cert:
            query["ssl_certfile"] = str(cert or self.pki.client_cert)
            query["ssl_keyfile"] = str(key or self.pki.client_key)
        return query


# -- etcd --------------------------------------------------------------------------------------
class SecureEtcd:
    """One etcd member with authentication on, serving clients over TLS and over plain TCP.

    ``https_port`` requires a client certificate signed by ``pki.ca``; ``http_port`` is plain.
    The ``root`` user's password is :attr:`root_password`. ``--auth-token-ttl`` is short so that
    a client that does not re-authenticate after an idle period is caught by the tests.
    """

    def __init__(self, pki: Pki, *, auth_token_ttl_s: int = 300) -> None:
        self.pki = pki
        self.https_port = free_port()
        self.http_port = free_port()
        self.peer_port = free_port()
        self.auth_token_ttl_s = auth_token_ttl_s
        self.name = f"crawl-sec-{secrets.token_hex(4)}"
        self.dir = Path(tempfile.mkdtemp(prefix="crawl-sec-etcd-", dir=_tmp_root()))
        self.root_password = _secret()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SecureEtcd:
        binary = etcd_binary()
        assert binary, "etcd binary not found"
        peer = f"http://127.0.0.1:{self.peer_port}"
        clients = f"https://127.0.0.1:{self.https_port},http://127.0.0.1:{self.http_port}"
        args = [
            binary, "--name", self.name, "--data-dir", str(self.dir / "data"),
            "--listen-client-urls", clients, "--advertise-client-urls", clients,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
            "--cert-file", str(self.pki.server_cert), "--key-file", str(self.pki.server_key),
            "--trusted-ca-file", str(self.pki.ca), "--client-cert-auth",
            "--auth-token", "simple", "--auth-token-ttl", str(self.auth_token_ttl_s),
            "--log-level", "error",
        ]
        self._log = open(self.dir / "etcd.log", "ab")  # noqa: SIM115 - closed in cleanup()
        self.proc = subprocess.Popen(args, start_new_session=True, stdout=self._log,
                                     stderr=self._log)
        wait_until(lambda: self.ctl("endpoint", "health", auth=False).returncode == 0, 30,
                   what=f"etcd on {self.https_port}")
        self.ctl_ok("user", "add", f"root:{self.root_password}", auth=False)
        self.ctl_ok("user", "grant-role", "root", "root", auth=False)
        self.ctl_ok("auth", "enable", auth=False)
        return self

    def ctl(self, *args: str, auth: bool = True,
            timeout_s: float = 15) -> subprocess.CompletedProcess[str]:
        """Run ``etcdctl`` against the TLS listener (as ``root`` when ``auth``)."""
        cmd = [shutil.which("etcdctl") or "etcdctl",
               f"--endpoints=https://127.0.0.1:{self.https_port}",
               f"--cacert={self.pki.ca}", f"--cert={self.pki.client_cert}",
               f"--key={self.pki.client_key}", "--dial-timeout=5s", "--command-timeout=10s"]
        if auth:
            cmd.append(f"--user=root:{self.root_password}")
        return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "ETCDCTL_API": "3"})

    def ctl_ok(self, *args: str, auth: bool = True) -> str:
        out = self.ctl(*args, auth=auth)
        if out.returncode != 0:
            raise AssertionError(f"etcdctl {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def add_user(self, name: str, *, prefixes: Iterable[str] = (), password: str | None = None,
                 ) -> str:
        """Create user ``name`` whose only role may read and write keys under ``prefixes``."""
        password = password or _secret()
        role = f"{name}-role"
        self.ctl_ok("user", "add", f"{name}:{password}")
        self.ctl_ok("role", "add", role)
        for prefix in prefixes:
            self.ctl_ok("role", "grant-permission", role, "readwrite", prefix, "--prefix=true")
        self.ctl_ok("user", "grant-role", name, role)
        return password

    def url(self, user: str | None = None, password: str | None = None, *, tls: bool = True,
            **query: str) -> str:
        """A store URL; TLS URLs get ``ca_cert``/``cert_cert``/``cert_key`` unless overridden."""
        auth = ""
        if user is not None or password is not None:
            auth = quote(user or "", safe="")
            if password is not None:
                auth += ":" + quote(password, safe="")
            auth += "@"
        if tls:
            full = {"ca_cert": str(self.pki.ca), "cert_cert": str(self.pki.client_cert),
                    "cert_key": str(self.pki.client_key), **query}
            full = {k: v for k, v in full.items() if v}
            base = f"etcd+https://{auth}127.0.0.1:{self.https_port}"
            return base + (f"?{urlencode(full)}" if full else "")
        base = f"etcd://{auth}127.0.0.1:{self.http_port}"
        return base + (f"?{urlencode(query)}" if query else "")

    def stop(self) -> None:
        _kill_group(self.proc)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        with contextlib.suppress(AttributeError):
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running(server: _RedisBase | SecureEtcd) -> Iterator[_RedisBase | SecureEtcd]:
    """Start ``server`` and always clean it up."""
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
