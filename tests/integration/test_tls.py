"""TLS and mutual TLS of `scalerl.rpc.server.make_server` / `scalerl.rpc.channel.channel`,
with a throwaway CA and server and client certificates for 127.0.0.1 and localhost made
here by the `openssl` command line."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from learner_service.server import LearnerStatus
from learner_service.server import serve as serve_learner
from scalerl.config import SecurityConfig
from scalerl.rpc.channel import channel
from scalerl.rpc.probe import main as probe_main
from scalerl.rpc.security import Security, from_config
from scalerl.v1 import learner_pb2, learner_pb2_grpc

TIMEOUT_S = 5.0
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
_EXTENSIONS = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _leaf(name: str, folder: Path) -> None:
    """name.key / name.pem signed by the CA in `folder`."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
             cwd=folder)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-extfile", "ext.cnf", "-out", f"{name}.pem",
             cwd=folder)  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A folder with ca.pem, server.pem/.key, client.pem/.key and other-ca.pem (a CA that
    signed nothing here)."""
    folder = tmp_path_factory.mktemp("tls")
    (folder / "ext.cnf").write_text(_EXTENSIONS)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *key, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1",
                 "-subj", f"/CN={ca}", cwd=folder)  # fmt: skip
    _leaf("server", folder)
    _leaf("client", folder)
    # A certificate for the cluster-wide name only, as deploy/components/tls issues one:
    # no address of any pod in it.
    (folder / "ext.cnf").write_text(
        "subjectAltName=DNS:scalerl.internal\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _leaf("named", folder)
    return folder


def security(
    folder: Path, *, cert: str = "", ca: str = "ca", mutual: bool = False, name: str = ""
) -> Security:
    """The `Security` of a config section naming files in `folder`."""
    return from_config(
        SecurityConfig(
            tls_cert_file=str(folder / f"{cert}.pem") if cert else "",
            tls_key_file=str(folder / f"{cert}.key") if cert else "",
            tls_ca_file=str(folder / f"{ca}.pem") if ca else "",
            require_client_cert=mutual,
            tls_server_name=name,
        ),
        environ={},
    )


def status_step(port: int, client: Security) -> int:
    with channel(f"127.0.0.1:{port}", client) as ch:
        stub = learner_pb2_grpc.LearnerServiceStub(ch)
        return stub.GetStatus(learner_pb2.GetLearnerStatusRequest(), timeout=TIMEOUT_S).step


def refused(port: int, client: Security) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        status_step(port, client)
    return info.value.code()


@pytest.fixture()
def tls_server(certs):
    server, port = serve_learner(LearnerStatus(step=3), security=security(certs, cert="server"))
    yield port
    server.stop(None)


def test_tls_server_answers_a_client_that_trusts_its_ca(tls_server, certs):
    assert status_step(tls_server, security(certs)) == 3


def test_tls_server_refuses_a_plaintext_client(tls_server):
    assert refused(tls_server, Security()) == grpc.StatusCode.UNAVAILABLE


def test_a_client_refuses_a_server_of_another_ca(tls_server, certs):
    assert refused(tls_server, security(certs, ca="other-ca")) == grpc.StatusCode.UNAVAILABLE


@pytest.fixture()
def mtls_server(certs):
    sec = security(certs, cert="server", mutual=True)
    server, port = serve_learner(LearnerStatus(step=4), security=sec)
    yield port
    server.stop(None)


def test_mutual_tls_refuses_a_client_without_a_certificate(mtls_server, certs):
    assert refused(mtls_server, security(certs)) == grpc.StatusCode.UNAVAILABLE
    assert refused(mtls_server, Security()) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_answers_a_client_with_a_certificate_of_the_ca(mtls_server, certs):
    assert status_step(mtls_server, security(certs, cert="client")) == 4


def test_half_a_tls_pair_is_a_config_error():
    with pytest.raises(ValueError, match="tls_cert_file and security.tls_key_file"):
        SecurityConfig(tls_cert_file="server.pem")
    with pytest.raises(ValueError, match="security.tls_ca_file: cannot read"):
        from_config(SecurityConfig(tls_ca_file="/nonexistent/ca.pem"), environ={})


def test_scalerl_curve_server_over_tls(certs, tmp_path, capsys):
    """`scalerl curve fit --server` reaches a TLS curve service with --tls-ca, and is
    refused (one line, exit status 2) without it."""
    from curve_service.server import serve as serve_curve
    from scalerl.rpc.security import configure
    from scalerl_cli import main as cli

    points = tmp_path / "p.csv"
    rows = [f"{2.0**i},{r}" for i, r in enumerate([0.1, 0.2, 0.35, 0.5, 0.6, 0.65])]
    points.write_text("compute,reward\n" + "\n".join(rows) + "\n")
    server, port, _ = serve_curve(security=security(certs, cert="server", ca=""))
    argv = ["curve", "fit", str(points), "--json", "--bootstrap", "0", "--server"]
    try:
        assert cli.main([*argv, f"localhost:{port}", "--tls-ca", str(certs / "ca.pem")]) == 0
        assert '"A"' in capsys.readouterr().out
        configure(Security())
        assert cli.main([*argv, f"127.0.0.1:{port}"]) == 2  # one line, as bad input
        assert "UNAVAILABLE" in capsys.readouterr().err
    finally:
        configure(Security())
        server.stop(None)


def test_a_server_dialed_by_ip_verifies_by_the_cluster_wide_name(certs):
    """Workers are dialed by pod IP; their certificate names scalerl.internal only."""
    server, port = serve_learner(LearnerStatus(step=5), security=security(certs, cert="named"))
    try:
        assert status_step(port, security(certs, name="scalerl.internal")) == 5
        # Without the name the client checks 127.0.0.1 against the certificate: refused.
        assert refused(port, security(certs)) == grpc.StatusCode.UNAVAILABLE
        assert refused(port, security(certs, name="evil.example")) == grpc.StatusCode.UNAVAILABLE
        # The exec probe of deploy/components/tls: TLS health, by the same name.
        tls = ["--tls-ca", str(certs / "ca.pem"), "--server-name", "scalerl.internal"]
        assert probe_main([f"127.0.0.1:{port}", *tls]) == 0
        assert probe_main([f"127.0.0.1:{port}", "--tls-ca", str(certs / "ca.pem")]) == 1
        assert probe_main([f"127.0.0.1:{port}"]) == 1  # plaintext to a TLS port
    finally:
        server.stop(None)
