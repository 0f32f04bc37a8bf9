"""The Grafana dashboard of deploy/grafana and the KEDA trigger query only use metrics the
services export (names as Prometheus sees them: counters with _total, histograms with
_bucket/_sum/_count)."""

from __future__ import annotations

import json
import re

import pytest
from deploy_manifests import DEPLOY, find
from prometheus_client import CollectorRegistry

from curve_service.metrics import CurveMetrics
from learner_service.metrics import LearnerMetrics, WorkerStatsCollector
from rollout_service.metrics import RolloutMetrics
from scalerl.obs.metrics import service_registry

DASHBOARD = DEPLOY / "grafana" / "scalerl-dashboard.json"
METRIC = re.compile(r"\bscalerl_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


class _NoStats:
    def by_worker(self) -> dict:
        return {}


def exposed_names() -> set[str]:
    """Every series name the learner, the workers and the curve service expose."""
    learner = LearnerMetrics(service_registry("learner")).registry
    learner.register(WorkerStatsCollector(_NoStats()))
    registries: list[CollectorRegistry] = [
        learner,
        RolloutMetrics(service_registry("rollout")).registry,
        CurveMetrics().registry,
    ]
    return {
        family.name + suffix
        for registry in registries
        for family in registry.collect()
        for suffix in SUFFIXES[family.type]
    }


@pytest.fixture(scope="module")
def names() -> set[str]:
    return exposed_names()


def _expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_dashboard_uses_exported_metrics(names: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {m for expr in _expressions(dashboard) for m in METRIC.findall(expr)}
    assert len(used) >= 15
    assert used <= names, sorted(used - names)


def test_a_misspelt_metric_would_be_caught(names: set[str]) -> None:
    assert "scalerl_learner_mean_reward" in names
    assert "scalerl_learner_mean_rewards" not in names
    assert "scalerl_replay_groups_total" in names and "scalerl_curve_fits_total" in names


def test_the_dashboard_is_one_prometheus_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace"}
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all('namespace="$namespace"' in t["expr"] for t in panel["targets"])


def test_the_keda_query_uses_an_exported_gauge(rendered: dict, names: set[str]) -> None:
    queries = [
        trigger["metadata"]["query"]
        for docs in rendered.values()
        for scaled in find(docs, "ScaledObject")
        for trigger in scaled["spec"]["triggers"]
    ]
    assert queries
    for query in queries:
        assert set(METRIC.findall(query)) <= names, query
