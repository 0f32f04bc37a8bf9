"""Who may call what: the run's secret that signs privileged RPCs, and optional (mutual) TLS.

One `Security` value per process, built from the run config's `security` section
(`from_config`) and installed once at start-up (`configure`); `scalerl.rpc.server.make_server`
and `scalerl.rpc.channel.channel` use it unless given another. The secret (`token`) never
travels: each privileged call is signed for the one server process that proved itself
with it (`scalerl.rpc.request_auth`), and servers answer an unsigned, replayed or stale
call UNAUTHENTICATED without calling the handler.

Privileged are the RPCs that change a run or spend its accelerators: UpdateWeights (replaces
the policy), Interrupt (cuts a request short), Generate (only the learner's evaluator calls
it; anyone else would spend the workers' decode slots and the run's compute), RecordPoint
and TrimRun (write the run's curve), and FetchWeights (the learner's, and a relaying
worker's): it changes nothing, but it hands out the policy itself and spends the server's
network, so only the run's workers may call it.
The other reads stay open, so dashboards and `scalerl curve` need no secret: GetStatus of
both services, Fit / Extrapolate / CompareRuns (pure functions of the request or of stored
points, nothing is written), GetRun, and health and reflection.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from scalerl import private_paths
from scalerl.config import SecurityConfig

TOKEN_ENV = "SCALERL_AUTH_TOKEN"
PRIVILEGED_METHODS = frozenset(
    {
        "/scalerl.v1.RolloutService/Generate",
        "/scalerl.v1.RolloutService/Interrupt",
        "/scalerl.v1.RolloutService/UpdateWeights",
        "/scalerl.v1.RolloutService/JoinWeightGroup",
        "/scalerl.v1.RolloutService/ReceiveWeights",
        "/scalerl.v1.RolloutService/FetchWeights",
        "/scalerl.v1.TeacherService/ScoreTokens",
        "/scalerl.v1.LearnerService/FetchWeights",
        "/scalerl.v1.CurveService/RecordPoint",
        "/scalerl.v1.CurveService/TrimRun",
    }
)


@dataclass(frozen=True)
class Security:
    """token: the run's secret, which signs privileged RPCs ('' = auth off). cert_pem/key_pem: this
    process's certificate (servers present it; clients present it under mutual TLS).
    ca_pem: the CA clients verify servers with (and mTLS servers verify clients with).
    max_concurrent_rpcs: RPCs one server runs at once (`security.max_concurrent_rpcs`).
    server_name: the name in every server's certificate, which a TLS client verifies
    instead of the address it dials (`security.tls_server_name`; "" = the address)."""

    token: str = ""
    cert_pem: bytes = b""
    key_pem: bytes = b""
    ca_pem: bytes = b""
    require_client_cert: bool = False
    max_concurrent_rpcs: int | None = None  # None: the server builder's default
    server_name: str = ""  # the name clients verify instead of the dialed address

    def __repr__(self) -> str:  # never print the secret
        return (
            f"Security(token={'set' if self.token else 'off'}, tls={bool(self.cert_pem)}, "
            f"ca={bool(self.ca_pem)}, require_client_cert={self.require_client_cert})"
        )


def from_config(section: SecurityConfig, environ: Mapping[str, str] | None = None) -> Security:
    """The `Security` of a config section: the token from SCALERL_AUTH_TOKEN, else from
    `token_file` (surrounding whitespace stripped), PEM files read now. Read from this
    process's own environment (environ None), the variable is then removed from it, so
    the processes it starts (verifier workers among them) do not inherit the token.

    Raises ValueError naming the field when a file cannot be read, or the token file or
    a set SCALERL_AUTH_TOKEN is empty (an empty secret never means "no auth")."""
    given = os.environ.pop(TOKEN_ENV, None) if environ is None else environ.get(TOKEN_ENV)
    if given is not None and not given.strip():
        raise ValueError(f"{TOKEN_ENV} is set but empty: unset it, or give the run's token")
    token = (given or "").strip()
    if not token and section.token_file:
        token = read_secret("security.token_file", section.token_file)
    if section.tls_key_file:
        _check_private("security.tls_key_file", section.tls_key_file)
    private_paths.register(section.tls_key_file)
    return Security(
        token=token,
        cert_pem=_read("security.tls_cert_file", section.tls_cert_file),
        key_pem=_read("security.tls_key_file", section.tls_key_file),
        ca_pem=_read("security.tls_ca_file", section.tls_ca_file),
        require_client_cert=section.require_client_cert,
        max_concurrent_rpcs=section.max_concurrent_rpcs,
        server_name=section.tls_server_name,
    )


def read_secret(field: str, path: str) -> str:
    """The secret in the file at `path` (surrounding whitespace stripped), registered as a
    private path (`scalerl.private_paths`: hidden from what model output drives).

    Raises ValueError naming `field` when the file is readable by every user, cannot be
    read, or is empty (an empty secret never means "no auth")."""
    _check_private(field, path)
    secret = _read(field, path).decode().strip()
    private_paths.register(path)
    if not secret:
        raise ValueError(f"{field}: {path} is empty")
    return secret


def _check_private(field: str, path: str) -> None:
    """Raise ValueError naming `field` when the file at `path` is readable by every user
    of the machine (a secret anyone can read is no secret); group-readable is allowed
    (a Kubernetes Secret with fsGroup). A file that cannot be read is `_read`'s error."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return
    if mode & 0o004:
        raise ValueError(
            f"{field}: {path} is readable by every user (mode {mode & 0o777:o}); chmod o-r {path}"
        )


def _read(field: str, path: str) -> bytes:
    if not path:
        return b""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc.strerror}") from exc


def check_bind(
    host: str,
    security: Security,
    allow_insecure: bool,
    allowed_by: str = "security.allow_insecure: true",
    token_by: str = "security.token_file",
) -> None:
    """Refuse a server on a non-loopback `host` without a token: anyone who reaches the
    port could then change the run (its privileged RPCs would be open). Raises ValueError,
    one line naming the settings that allow it (`token_by`, `allowed_by`), unless allowed."""
    if security.token or allow_insecure or _loopback(host):
        return
    raise ValueError(
        f"binding {host} without a token would leave every privileged RPC open to whoever "
        f"reaches the port: give {token_by} (or {TOKEN_ENV}), or set {allowed_by}"
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


_current = Security()


def configure(security: Security) -> None:
    """Install the process's `Security` (once, at start-up, before servers and channels)."""
    global _current
    _current = security


def current() -> Security:
    """The process's `Security`: the one `configure` installed, else the token of
    SCALERL_AUTH_TOKEN alone (a process that never called `from_config`, such as a test)."""
    if _current != Security():
        return _current
    return Security(token=os.environ.get(TOKEN_ENV, "").strip())


# ----- server side -----------------------------------------------------------------------


def server_credentials(security: Security) -> grpc.ServerCredentials | None:
    """TLS credentials of a server, or None for plaintext (no certificate configured)."""
    if not security.cert_pem:
        return None
    return grpc.ssl_server_credentials(
        [(security.key_pem, security.cert_pem)],
        root_certificates=security.ca_pem if security.require_client_cert else None,
        require_client_auth=security.require_client_cert,
    )


# ----- client side -----------------------------------------------------------------------


def channel_credentials(security: Security) -> grpc.ChannelCredentials | None:
    """TLS credentials of a client (verifying servers with the CA; presenting this
    process's certificate when it has one), or None for plaintext (no CA configured)."""
    if not security.ca_pem:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=security.ca_pem,
        private_key=security.key_pem or None,
        certificate_chain=security.cert_pem or None,
    )
