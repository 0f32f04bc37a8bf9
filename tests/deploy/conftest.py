"""Every overlay of deploy/ (and every component no overlay uses) rendered once per session
with `kubectl kustomize`, from a copy of deploy/ that holds test secrets."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_manifests import COMPOSITIONS, OVERLAYS, KubectlMissing, compose, copy_deploy, render

RENDERS = (*OVERLAYS, *COMPOSITIONS)


@pytest.fixture(scope="session")
def deploy_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/ copied with a secrets.env in each overlay that needs one."""
    return copy_deploy(tmp_path_factory.mktemp("deploy"))


@pytest.fixture(scope="session")
def rendered(deploy_copy: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    """Render name (overlay or composition) -> its documents."""
    out = {}
    try:
        for name in OVERLAYS:
            out[name] = render(deploy_copy / "overlays" / name)
        for name, components in COMPOSITIONS.items():
            folder = compose(tmp_path_factory.mktemp("composed"), deploy_copy, components)
            out[name] = render(folder)
    except KubectlMissing as exc:
        pytest.skip(f"cannot render deploy/ without kubectl: {exc}")
    return out


@pytest.fixture(params=RENDERS)
def docs(request: pytest.FixtureRequest, rendered: dict[str, list]) -> list[dict]:
    """The documents of one render (the tests run once per overlay and composition)."""
    return rendered[request.param]
