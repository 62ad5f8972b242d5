"""The harness's own variables are not named like the plugin's settings: ``check`` reports
every unknown ``MMCACHE_FIX_*`` variable as a misspelt setting (``--strict`` fails on it),
so a developer's or CI's environment must not hold harness variables under that prefix."""

from __future__ import annotations

import re
import subprocess

from harness.paths import REPO_ROOT
from vllm_mmcache_fix import plugin

HARNESS_PREFIX = "MMCACHE_HARNESS_"


def _tracked(*paths: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", *paths], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [p for p in out.splitlines() if (REPO_ROOT / p).is_file()]


def test_every_mmcache_fix_name_the_harness_uses_is_a_plugin_setting() -> None:
    settings = {spec.name for spec in plugin.settings()}
    named: dict[str, set[str]] = {}
    for path in _tracked("harness", "scripts", ".ci"):
        text = (REPO_ROOT / path).read_text(errors="replace")
        for name in re.findall(r"\bMMCACHE_FIX_[A-Z0-9_]*[A-Z0-9]\b", text):
            named.setdefault(name, set()).add(path)
    unknown = {n: sorted(p) for n, p in named.items() if n not in settings}
    # The cache root's earlier name is still read, and named for that reason only.
    unknown.pop("MMCACHE_FIX_CACHE", None)
    assert not unknown, f"harness variables under the plugin's prefix: {unknown}"
    assert len(named) >= 5  # the harness does set the plugin's settings for its servers


def test_the_harness_variables_are_not_reported_as_settings() -> None:
    from vllm_mmcache_fix.core import settings_table as s

    env = {f"{HARNESS_PREFIX}CACHE": "/tmp/x", f"{HARNESS_PREFIX}E2E_VERSIONS": "0.23.0"}
    rows = s.report_settings(env)
    assert not [r for r in rows if r.name.startswith(HARNESS_PREFIX)]
