"""deploy/: every metric the dashboard and the alert rules use is one the plugin exports, with
the labels they use; the Kubernetes rules are the Prometheus rules. (promtool checks and tests
the rules themselves: tests/realsrc/test_deploy_promtool.py.)"""

from __future__ import annotations

import json
import re

import pytest

from harness.paths import REPO_ROOT
from vllm_mmcache_fix.metrics import names

DEPLOY = REPO_ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "vllm-mmcache-fix.rules.yml"
CRD = DEPLOY / "kubernetes" / "prometheusrule.yaml"
DASHBOARD = DEPLOY / "grafana" / "vllm-mmcache-fix.json"

SPECS = {spec.name: spec for spec in names.METRICS}
TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every scraped series."""
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _spec(metric: str) -> names.MetricSpec:
    if metric in SPECS:
        return SPECS[metric]
    for suffix in HISTOGRAM_SUFFIXES:
        base = metric.removesuffix(suffix)
        if base != metric and base in SPECS and SPECS[base].kind == "histogram":
            return SPECS[base]
    raise AssertionError(f"{metric} is not in vllm_mmcache_fix/metrics/names.py")


def _labels_of(expr: str) -> set[str]:
    """Labels the series of ``expr``'s plugin metrics can carry."""
    labels = set(TARGET_LABELS)
    for metric in re.findall(r"\bmmcache_fix_[a-z_]+", expr):
        spec = _spec(metric)
        labels |= set(spec.labels)
        if spec.kind == "histogram":
            labels.add("le")
    return labels


def check_expr(expr: str, used_labels: set[str] = frozenset()) -> set[str]:  # type: ignore[assignment]
    """Assert ``expr``'s plugin metrics exist with the labels it uses; return the metrics."""
    metrics = {_spec(m).name for m in re.findall(r"\bmmcache_fix_[a-z_]+", expr)}
    for metric, matchers in re.findall(r"\b(mmcache_fix_[a-z_]+)\{([^}]*)\}", expr):
        spec = _spec(metric)
        for label in re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers):
            assert label in set(spec.labels) | TARGET_LABELS, (metric, label, expr)
    available = _labels_of(expr)
    if "vllm:" in expr:
        available |= {"instance"}
    for group in re.findall(r"\b(?:by|on|ignoring|without)\s*\(([^)]*)\)", expr):
        for label in filter(None, (g.strip() for g in group.split(","))):
            assert label in available, (label, expr)
    for label in used_labels:
        assert label in available, (label, expr)
    return metrics


def rule_blocks() -> list[tuple[str, str, str]]:
    """(alert, expr, annotation text) of each rule in the Prometheus rules file."""
    text = RULES.read_text()
    out = []
    for block in re.split(r"\n      - alert: ", text)[1:]:
        name = block.split("\n", 1)[0].strip()
        expr_match = re.search(
            r"expr: \|\n(.*?)\n        (?:for|labels):", block, re.S
        ) or re.search(r"expr: (.*?)\n", block)
        assert expr_match is not None, name
        annotations = block[block.index("annotations:") :]
        out.append((name, expr_match.group(1), annotations))
    return out


def test_the_rules_use_only_exported_metrics_and_their_labels() -> None:
    used: set[str] = set()
    rules = rule_blocks()
    assert len(rules) == RULES.read_text().count("- alert: ") >= 7
    for name, expr, notes in rules:
        labels = set(re.findall(r"\$labels\.(\w+)", notes))
        used |= check_expr(expr, labels)
        assert "vllm" not in re.sub(r"vllm:num_requests_running", "", expr), name
    assert {names.MM_CACHE_TOO_LARGE, names.MM_CACHE_HITS, names.STUCK_HEALTH_CHECKS} <= used


def test_the_dashboard_uses_only_exported_metrics_and_their_labels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 20
    for target in targets:
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        used |= check_expr(target["expr"], legend)
    # Everything the plugin exports has a panel.
    assert {spec.name for spec in names.METRICS} <= used, {s.name for s in names.METRICS} - used


@pytest.mark.parametrize(
    "bad",
    [
        "mmcache_fix_mm_cache_hits_total{colour='red'}",
        "sum by (modality) (mmcache_fix_mm_cache_bytes)",
        "rate(mmcache_fix_no_such_total[5m])",
    ],
)
def test_the_check_catches_a_wrong_name_or_label(bad: str) -> None:
    with pytest.raises(AssertionError):
        check_expr(bad)


def test_the_kubernetes_rules_are_the_prometheus_rules() -> None:
    rules = RULES.read_text()
    groups = rules[rules.index("groups:\n") :]
    crd = CRD.read_text()
    assert "kind: PrometheusRule" in crd
    spec = crd[crd.index("spec:\n") + len("spec:\n") :]
    assert spec == "".join(
        ("  " + line if line.strip() else line) for line in groups.splitlines(True)
    )


def test_the_readme_points_to_the_rules() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert "deploy/prometheus/vllm-mmcache-fix.rules.yml" in readme
    assert "deploy/grafana/vllm-mmcache-fix.json" in readme
    assert "alert: " not in readme  # the rules live in deploy/ only
