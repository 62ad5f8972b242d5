"""deploy/'s alert rules and dashboard queries, checked by the real ``promtool``.

In this tier because it needs a downloaded tool (``scripts/run-tests`` unpacks Debian's
``prometheus`` package into the cache root, see harness/promtool.py). Without promtool the
tests fail and say so: they are never skipped.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness import promtool
from harness.paths import REPO_ROOT

PROM = REPO_ROOT / "deploy" / "prometheus"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "vllm-mmcache-fix.json"


@pytest.fixture(scope="module")
def tool() -> str:
    found = promtool.find()
    if found is None:
        pytest.fail(
            "promtool not found: scripts/run-tests unpacks it from Debian's prometheus package "
            f"into {promtool.unpacked()} (apt-get download prometheus); set "
            f"{promtool.ENV} or put promtool on PATH"
        )
    return found


def _run(tool: str, *args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_promtool_checks_the_rules(tool: str) -> None:
    out = _run(tool, "check", "rules", "vllm-mmcache-fix.rules.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 7 rules found" in out.stdout, out.stdout


def test_promtool_tests_the_rules_fire_and_stay_silent(tool: str) -> None:
    out = _run(tool, "test", "rules", "vllm-mmcache-fix.rules.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


def test_promtool_fails_a_rule_test_that_expects_the_wrong_thing(tool: str, tmp_path: Path) -> None:
    """The rule tests can fail: a healthy series expected to fire does not pass."""
    (tmp_path / "rules.yml").write_text((PROM / "vllm-mmcache-fix.rules.yml").read_text())
    (tmp_path / "wrong.test.yml").write_text(
        """rule_files: [rules.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'mmcache_fix_engine_stuck_health_checks_total{instance="a",engine="EngineCore"}'
        values: "0x30"
    alert_rule_test:
      - eval_time: 20m
        alertname: VllmEngineNotAnswering
        exp_alerts:
          - exp_labels: {severity: critical, instance: a, engine: EngineCore}
"""
    )
    out = _run(tool, "test", "rules", "wrong.test.yml", cwd=tmp_path)
    assert out.returncode != 0, out.stdout


def test_every_dashboard_query_parses(tool: str, tmp_path: Path) -> None:
    """Each panel's query, with Grafana's variables filled in, as a recording rule."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for index, expr in enumerate(exprs):
        filled = expr.replace("$__rate_interval", "5m").replace("$instance", ".*")
        lines += [f"      - record: dashboard:query_{index}", f"        expr: {json.dumps(filled)}"]
    (tmp_path / "dashboard.rules.yml").write_text("\n".join(lines) + "\n")
    out = _run(tool, "check", "rules", "dashboard.rules.yml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout, out.stdout
