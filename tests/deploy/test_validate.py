"""Every rendered document validates strictly: the built-in kinds against Kubernetes' own
OpenAPI schemas for one version (kubernetes-validate, strict: unknown fields are errors),
the custom resources (KEDA ScaledObject, ServiceMonitor, PodMonitor) against the schemas
vendored in deploy/schemas; no document escapes both."""

from __future__ import annotations

import copy
import json

import jsonschema
import kubernetes_validate
import pytest
from deploy_manifests import DEPLOY, KUBERNETES_VERSION

SCHEMAS = DEPLOY / "schemas"


def crd_schema(doc: dict) -> dict | None:
    """The vendored schema of doc's apiVersion and kind, or None."""
    path = SCHEMAS / f"{doc['kind'].lower()}-{doc['apiVersion'].replace('/', '-')}.json"
    return json.loads(path.read_text()) if path.exists() else None


def validate(doc: dict) -> None:
    """Raise on the first schema violation of doc (custom resources: vendored schema)."""
    schema = crd_schema(doc)
    if schema is not None:
        jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
        return
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_document_validates_strictly(docs: list[dict]) -> None:
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            validate(doc)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(
                f"{name}: no schema, neither Kubernetes {KUBERNETES_VERSION}'s nor vendored"
            )
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{name}: {exc}")


def test_the_renders_hold_the_custom_resources_the_schemas_cover(rendered: dict) -> None:
    kinds = {d["kind"] for docs in rendered.values() for d in docs if crd_schema(d)}
    assert kinds == {"ScaledObject", "ServiceMonitor", "PodMonitor"}


def _first(rendered: dict, kind: str) -> dict:
    return next(d for docs in rendered.values() for d in docs if d["kind"] == kind)


@pytest.mark.parametrize(
    ("kind", "spoil", "message"),
    [
        # A misspelt field is an error, as the API server's structural schema makes it.
        ("ScaledObject", lambda d: d["spec"].update(minReplicaCont=1), "minReplicaCont"),
        ("ScaledObject", lambda d: d["spec"].pop("scaleTargetRef"), "scaleTargetRef"),
        # KEDA would pass an unknown trigger key through: the schema refuses it.
        (
            "ScaledObject",
            lambda d: d["spec"]["triggers"][0]["metadata"].update(querry="x"),
            "querry",
        ),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(interval="30 s"), "30 s"),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(prot="metrics"), "prot"),
        ("PodMonitor", lambda d: d["spec"].pop("podMetricsEndpoints"), "podMetricsEndpoints"),
    ],
)
def test_the_vendored_schemas_refuse_spoilt_resources(rendered, kind, spoil, message) -> None:
    doc = copy.deepcopy(_first(rendered, kind))
    validate(doc)  # the rendered one passes
    spoil(doc)
    with pytest.raises(jsonschema.ValidationError, match=message):
        validate(doc)


def test_kubernetes_validate_refuses_an_unknown_container_field(rendered: dict) -> None:
    doc = copy.deepcopy(_first(rendered, "Deployment"))
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(doc)
