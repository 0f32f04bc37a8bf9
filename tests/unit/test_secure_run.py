"""`scalerl run` hands its children a token file (never the token itself in an
environment), the Redis password in a file, and the run's weights root."""

from __future__ import annotations

import os
from pathlib import Path

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
from scalerl.state.client import REDIS_PASSWORD_FILE_ENV, REDIS_URL_ENV
from scalerl_cli.launcher import _curve_security_args, redis_env, secure_run
from scalerl_cli.processes import start_child


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    yield
    configure(Security())


def _token(config: RunConfig) -> str:
    return Path(config.security.token_file).read_text()


def test_a_token_per_run_kept_across_its_resumes_and_the_weights_folder_as_root(tmp_path):
    config = secure_run(RunConfig(), tmp_path)
    assert config.security.weights_root == str((tmp_path / "weights").resolve())
    assert config.security.token_file == str((tmp_path / "token").resolve())
    token = _token(config)
    assert len(token) >= 40
    assert current().token == token  # the launcher's own channels send it
    # A resume of the run keeps its token (its checkpoints are signed with it), in a file
    # of this user's only; another run gets its own.
    assert _token(secure_run(RunConfig(), tmp_path)) == token
    assert (tmp_path / "token").stat().st_mode & 0o077 == 0
    other = tmp_path / "other"
    other.mkdir()
    assert _token(secure_run(RunConfig(), other)) != token


def test_a_configured_token_and_root_are_kept(tmp_path, monkeypatch):
    token_file = tmp_path / "mine"
    token_file.write_text("from-the-file\n")
    token_file.chmod(0o640)  # group-readable is fine (a Kubernetes Secret with fsGroup)
    config = RunConfig(security={"token_file": str(token_file), "weights_root": "/shared/w"})
    config = secure_run(config, tmp_path)
    assert config.security.token_file == str(token_file) and current().token == "from-the-file"
    assert config.security.weights_root == "/shared/w"
    monkeypatch.setenv(TOKEN_ENV, "from-the-env")  # wins, and goes to the run's own file
    env_config = secure_run(RunConfig(), tmp_path)
    assert _token(env_config) == "from-the-env" and current().token == "from-the-env"


def test_the_children_get_the_redis_password_in_a_file(tmp_path):
    env = redis_env("redis://rollout:s3cr%40t@127.0.0.1:6379/0", tmp_path)
    assert env == {
        REDIS_URL_ENV: "redis://rollout@127.0.0.1:6379/0",
        REDIS_PASSWORD_FILE_ENV: str((tmp_path / "redis-password").resolve()),
    }
    assert (tmp_path / "redis-password").read_text() == "s3cr@t"
    assert (tmp_path / "redis-password").stat().st_mode & 0o077 == 0
    assert redis_env("redis://127.0.0.1:6379/0", tmp_path) == {
        REDIS_URL_ENV: "redis://127.0.0.1:6379/0"
    }


def test_no_child_inherits_a_secret_from_the_launchers_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "the-launchers-token")
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:pw@127.0.0.1:1/0")
    child = start_child(
        "env", "scalerl_cli.orphan_guard", [], tmp_path, {"SCALERL_EXTRA": "kept"}
    )  # usage error: exits at once; its environment is what counts
    child.proc.wait(timeout=30)
    assert TOKEN_ENV not in child.env and REDIS_URL_ENV not in child.env
    assert child.env["SCALERL_EXTRA"] == "kept"


def test_a_token_file_every_user_can_read_is_refused(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("the-runs-token")
    token_file.chmod(0o644)
    with pytest.raises(ValueError) as refused:
        from_config(SecurityConfig(token_file=str(token_file)), {})
    assert str(refused.value) == (
        f"security.token_file: {token_file} is readable by every user (mode 644); "
        f"chmod o-r {token_file}"
    )


def test_a_new_run_folder_is_this_users_only(tmp_path, monkeypatch):
    from scalerl_cli import launcher

    def stop_here(config, run_dir):
        raise ValueError("stop after the folder is made")

    monkeypatch.setattr(launcher, "secure_run", stop_here)
    monkeypatch.setattr(launcher, "preflight", lambda config: (config, None))
    monkeypatch.setattr(launcher, "planned_config", lambda config: (config, None))
    monkeypatch.setattr(launcher, "describe", lambda plan: "")
    assert launcher.run(RunConfig(), tmp_path / "run") == 2
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700


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
    (tmp_path / "token").chmod(0o600)
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
