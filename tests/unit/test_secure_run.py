"""`scalerl run` hands its children a token and the run's weights root."""

from __future__ import annotations

import pytest

from scalerl.config import RunConfig
from scalerl.rpc.security import TOKEN_ENV, Security, configure, current
from scalerl_cli.launcher import _curve_security_args, secure_run


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    yield
    configure(Security())


def test_a_fresh_token_per_run_and_the_weights_folder_as_root(tmp_path):
    config, env = secure_run(RunConfig(), tmp_path)
    assert config.security.weights_root == str((tmp_path / "weights").resolve())
    assert len(env[TOKEN_ENV]) >= 40
    assert current().token == env[TOKEN_ENV]  # the launcher's own channels send it
    _, again = secure_run(RunConfig(), tmp_path)
    assert again[TOKEN_ENV] != env[TOKEN_ENV]


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
