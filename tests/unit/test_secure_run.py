"""`scalerl run` hands its children a token and the run's weights root."""

from __future__ import annotations

import os

import pytest

from scalerl.config import RunConfig, SecurityConfig
from scalerl.rpc.security import (
    TOKEN_ENV,
    Security,
    check_bind,
    configure,
    current,
    from_config,
)
from scalerl_cli.launcher import _curve_security_args, secure_run


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    yield
    configure(Security())


def test_a_token_per_run_kept_across_its_resumes_and_the_weights_folder_as_root(tmp_path):
    config, env = secure_run(RunConfig(), tmp_path)
    assert config.security.weights_root == str((tmp_path / "weights").resolve())
    assert len(env[TOKEN_ENV]) >= 40
    assert current().token == env[TOKEN_ENV]  # the launcher's own channels send it
    # A resume of the run keeps its token (its checkpoints are signed with it), in a file
    # of this user's only; another run gets its own.
    assert secure_run(RunConfig(), tmp_path)[1][TOKEN_ENV] == env[TOKEN_ENV]
    assert (tmp_path / "token").stat().st_mode & 0o077 == 0
    other = tmp_path / "other"
    other.mkdir()
    assert secure_run(RunConfig(), other)[1][TOKEN_ENV] != env[TOKEN_ENV]


def test_a_configured_token_and_root_are_kept(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    config = RunConfig(security={"token_file": str(token_file), "weights_root": "/shared/w"})
    config, env = secure_run(config, tmp_path)
    assert env == {TOKEN_ENV: "from-the-file"}
    assert config.security.weights_root == "/shared/w"
    monkeypatch.setenv(TOKEN_ENV, "from-the-env")
    assert secure_run(config, tmp_path)[1] == {TOKEN_ENV: "from-the-env"}


def test_an_unreadable_token_file_is_one_error_naming_the_field(tmp_path):
    config = RunConfig(security={"token_file": str(tmp_path / "absent")})
    with pytest.raises(ValueError, match="security.token_file: cannot read"):
        secure_run(config, tmp_path)


def test_a_service_takes_the_token_out_of_its_environment(monkeypatch):
    """What it starts (verifier workers running model-written code) cannot inherit it."""
    monkeypatch.setenv(TOKEN_ENV, "the-runs-token")
    assert from_config(SecurityConfig()).token == "the-runs-token"
    assert TOKEN_ENV not in os.environ
    # Given an environment of its own (the launcher's children's), it leaves ours alone.
    assert from_config(SecurityConfig(), {TOKEN_ENV: "x"}).token == "x"


@pytest.mark.parametrize("blank", ["", "  \n"])
def test_an_empty_token_fails_loudly(monkeypatch, tmp_path, blank):
    monkeypatch.setenv(TOKEN_ENV, blank)
    with pytest.raises(ValueError, match=f"{TOKEN_ENV} is set but empty"):
        from_config(SecurityConfig())
    (tmp_path / "token").write_text(blank)
    with pytest.raises(ValueError, match="security.token_file: .* is empty"):
        from_config(SecurityConfig(token_file=str(tmp_path / "token")), {})


def test_the_curve_child_gets_the_tls_flags():
    config = RunConfig(
        security={
            "tls_cert_file": "s.pem",
            "tls_key_file": "s.key",
            "tls_ca_file": "ca.pem",
            "require_client_cert": True,
        }
    )
    assert _curve_security_args(config) == [
        "--tls-cert", "s.pem", "--tls-key", "s.key", "--tls-ca", "ca.pem", "--require-client-cert"
    ]  # fmt: skip
    assert _curve_security_args(RunConfig()) == []


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "::", "pod.ns.svc"])
def test_a_server_on_an_open_address_without_a_token_refuses_to_start(host: str) -> None:
    with pytest.raises(ValueError, match="set security.allow_insecure: true$"):
        check_bind(host, Security(), allow_insecure=False)
    check_bind(host, Security(token="t"), allow_insecure=False)  # with a token: fine
    check_bind(host, Security(), allow_insecure=True)  # the operator's explicit choice


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_token(host: str) -> None:
    check_bind(host, Security(), allow_insecure=False)


def test_the_services_refuse_an_open_bind_with_exit_code_2(capsys) -> None:
    from curve_service.main import main as curve_main
    from rollout_service.main import main as rollout_main

    assert curve_main(["--port", "0", "--metrics-port", "0", "--host", "0.0.0.0"]) == 2
    assert capsys.readouterr().err.strip().endswith("or set --allow-insecure")
    argv = ["--config", "tiny", "--redis-url", "redis://127.0.0.1:1/0", "--worker-id", "w0"]
    argv += ["--host", "0.0.0.0"]
    assert rollout_main(argv) == 2
    assert capsys.readouterr().err.strip().endswith("or set security.allow_insecure: true")
