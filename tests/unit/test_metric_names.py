"""Every service's metrics follow the house rules (docs/architecture.md "Metrics"): the
`scalerl_` prefix, base units, `_total` on counters, a `scalerl_build_info`, no ratio gauges
that counters can give; and `promtool check metrics` accepts the exposition where installed."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from curve_service.metrics import CurveMetrics
from learner_service.metrics import LearnerMetrics, WorkerStatsCollector
from rollout_service.metrics import DeltaCollector, RolloutMetrics
from scalerl.obs.metrics import service_registry
from scalerl.state.worker_stats import STATS
from scalerl.weights.receive import LastPayload

# A gauge of a fraction (of samples, groups, tokens) is derivable from counters; the dashboard
# computes rates from them instead.
RATIO_WORDS = re.compile(r"_(rate|ratio|fraction|frac|percent)$")
NON_BASE_UNITS = re.compile(r"_(ms|milliseconds|minutes|hours|kb|mb|gb|kib|mib|gib)(_|$)")


class _Stats:
    def by_worker(self) -> dict:
        row = dict.fromkeys(STATS, 1)
        return {"rollout-0": row}


def _registries() -> dict[str, CollectorRegistry]:
    learner = LearnerMetrics(service_registry("learner")).registry
    learner.register(WorkerStatsCollector(_Stats()))
    rollout = RolloutMetrics(service_registry("rollout")).registry
    rollout.register(DeltaCollector(LastPayload()))
    return {
        "rollout": rollout,
        "learner": learner,
        "curve": CurveMetrics().registry,
    }


@pytest.fixture(scope="module")
def registries() -> dict[str, CollectorRegistry]:
    return _registries()


@pytest.mark.parametrize("service", ["rollout", "learner", "curve"])
def test_names_follow_the_rules(service: str, registries: dict[str, CollectorRegistry]) -> None:
    families = list(registries[service].collect())
    names = {f.name: f.type for f in families}
    assert names.get("scalerl_build_info") == "gauge"
    build = next(f for f in families if f.name == "scalerl_build_info").samples
    assert [s.labels["service"] for s in build] == [service]
    for family in families:
        assert family.name.startswith("scalerl_"), family.name
        assert not NON_BASE_UNITS.search(family.name), f"{family.name}: use base units"
        if family.type == "gauge":
            assert not RATIO_WORDS.search(family.name), f"{family.name}: a ratio gauge"
            assert not family.name.endswith("_total"), f"{family.name}: a gauge named as counter"
        if family.type == "histogram" and "time" in family.name:
            assert family.name.endswith("_seconds"), family.name
    exposed = generate_latest(registries[service]).decode()
    counters = [f.name for f in families if f.type == "counter"]
    for name in counters:
        assert f"# TYPE {name}_total counter" in exposed, name


@pytest.mark.parametrize("service", ["rollout", "learner", "curve"])
def test_promtool_accepts_the_exposition(
    service: str, registries: dict[str, CollectorRegistry]
) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt install prometheus)")
    proc = subprocess.run(
        [promtool, "check", "metrics"],
        input=generate_latest(registries[service]),
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()


def test_each_service_registry_is_its_own() -> None:
    # Two services in one process (tests, the curve CLI's local fit) never collide.
    first, second = _registries(), _registries()
    assert first["rollout"] is not second["rollout"]
