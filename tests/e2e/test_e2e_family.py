"""Real servers: the incident replay on the Qwen-VL family, with images and with video.

Each case starts one vLLM CPU server with a tiny weightless model of
:mod:`harness.tiny_models` (Qwen2.5-VL, Qwen3-VL; Qwen2-VL with video) and replays the
incident of ``scripts/e2e`` with one modality: (a) a long prompt with item 0, rejected
with 400 after the item was processed, (b) item 0 again, (c) new items until the 1 MB
cache evicts. A video is 4 PNG frames sent as a ``data:video/jpeg`` URL.

With the plugin: 400, then no 5xx, every new item served, nothing hangs, EngineCore idle.
Without it the figures are printed, and the failure is asserted where it was seen
reliably (:data:`UNPATCHED`).

Selection (environment):

* ``MMCACHE_HARNESS_MODELS``: model names (spaces or commas), default all of :data:`MODELS`;
* ``MMCACHE_HARNESS_MODALITIES``: ``image``/``video``, default both;
* ``MMCACHE_HARNESS_E2E_VERSIONS``: vLLM versions, default :data:`harness.venvs.DEFAULT_VERSIONS`;
* ``MMCACHE_HARNESS_FAMILY_MATRIX``: ``ci`` (default) runs one case of :data:`CI_WITH_PLUGIN`
  with the plugin, chosen by the commit (:func:`harness.rotation.rotate`; successive
  commits walk the four): one server start. ``full`` runs every selected model x
  modality x version, with and without the plugin (the README's family table).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import runner, tiny_models
from harness.programs import incident
from harness.rotation import rotate
from harness.venvs import complete_venv, e2e_versions

MODELS = ["qwen2.5-vl", "qwen3-vl", "qwen2-vl"]
# Qwen2-VL with images is tests/e2e/test_e2e_incident.py.
SKIP = {("qwen2-vl", "image")}
N_ITEMS = 20

# The plugin-on case CI runs per model and modality: the version it prefers.
CI_WITH_PLUGIN = {
    ("qwen2.5-vl", "image"): "0.32.0",
    ("qwen2.5-vl", "video"): "0.23.0",
    ("qwen3-vl", "image"): "0.32.0",
    ("qwen3-vl", "video"): "0.23.0",
}

# Without the plugin, what steps b and c did in every run recorded: "hang" (b answers
# 500, a later new item times out, EngineCore spins) or "error-then-ok" (b answers 500,
# every new item is served). Cases not listed are only printed.
UNPATCHED: dict[tuple[str, str, str], str] = {}


def _env_list(name: str, default: list[str]) -> list[str]:
    text = os.environ.get(name, "").replace(",", " ").split()
    return text or list(default)


def _cases(with_plugin: bool) -> list[tuple[str, str, str]]:
    versions = e2e_versions()
    models = [m for m in _env_list("MMCACHE_HARNESS_MODELS", MODELS) if m in tiny_models.MODELS]
    modalities = _env_list("MMCACHE_HARNESS_MODALITIES", ["image", "video"])
    full = os.environ.get("MMCACHE_HARNESS_FAMILY_MATRIX", "ci") == "full"
    chosen = dict(rotate(sorted(CI_WITH_PLUGIN.items()))) if with_plugin else {}
    cases = []
    for model in models:
        for modality in modalities:
            if (model, modality) in SKIP:
                continue
            if modality == "video" and not tiny_models.supports_video(model):
                continue
            usable = [v for v in versions if tiny_models.supports_version(model, v)]
            if full:
                picked = usable
            elif (model, modality) in chosen:
                want = chosen[(model, modality)]
                picked = [want] if want in usable else usable[:1]
            else:
                picked = []
            cases.extend((v, model, modality) for v in picked)
    # Grouped by version: the plugin is installed or removed once per version.
    return sorted(cases)


def _replay(
    version: str, model: str, modality: str, wheel: Path, *, disable_plugin: bool
) -> incident.RunResult:
    venv = complete_venv(version)
    with runner.plugin_state(venv, wheel, purpose="Qwen-VL family replay") as lock:
        options = incident.IncidentOptions(
            model_name=model, modality=modality, n_images=N_ITEMS, disable_plugin=disable_plugin
        )
        return incident.run_incident(venv, options=options, lock=lock)


def _ids(cases: list[tuple[str, str, str]]) -> list[str]:
    return ["-".join(c) for c in cases]


def _report(result: incident.RunResult) -> str:
    return "\n" + incident.format_result(result)


def _figures(result: incident.RunResult) -> str:
    a, b, _ = incident.step_names(result.modality)
    new = incident.new_item_steps(result)
    sp = result.spin_after

    def cell(name: str) -> str:
        s = result.step(name)
        if s is None:
            return "-"
        return "TIMEOUT" if s.timed_out else str(s.status)

    return (
        f"FIGURES vllm={result.vllm_version} model={result.model_name} "
        f"modality={result.modality} plugin={'off' if result.plugin_disabled else 'on'} "
        f"a={cell(a)} b={cell(b)} new_ok={sum(s.ok for s in new)}/{len(new)} "
        f"new_5xx={sum(1 for s in new if (s.status or 0) >= 500)} "
        f"timeouts={sum(s.timed_out for s in result.steps)} hung={result.hung} "
        f"engine_after_cpu={sp.cpu_percent if sp else None}% "
        f"spinning={sp.spinning if sp else None} markers={result.log_markers}"
    )


def _common(result: incident.RunResult) -> None:
    assert result.started, result.error or _report(result)
    assert not result.error, _report(result)
    # A misread config would serve a pooling model and test nothing.
    assert result.supported_tasks is not None and "generate" in result.supported_tasks
    a = result.step(incident.step_names(result.modality)[0])
    assert a is not None and a.status == 400, _report(result)
    assert "maximum context length" in a.detail, _report(result)


@pytest.mark.parametrize(("version", "model", "modality"), _cases(True), ids=_ids(_cases(True)))
def test_family_incident_with_plugin(
    version: str, model: str, modality: str, plugin_wheel: Path
) -> None:
    result = _replay(version, model, modality, plugin_wheel, disable_plugin=False)
    print(_report(result))
    print(_figures(result))
    _common(result)
    assert result.plugin_installed and result.plugin_lines, _report(result)
    assert not result.hung, _report(result)
    b = result.step(incident.step_names(modality)[1])
    assert b is not None and not b.timed_out, _report(result)
    assert b.status is not None and b.status < 500, _report(result)
    new = incident.new_item_steps(result)
    assert len(new) == N_ITEMS and all(s.ok for s in new), _report(result)
    assert result.spin_after is not None and not result.spin_after.spinning, _report(result)
    assert result.spin_after.cpu_percent < 5.0, _report(result)
    active = {p for p, lines in result.plugin_lines.items() if any("active in" in x for x in lines)}
    assert any("EngineCore" in p for p in active), _report(result)


@pytest.mark.parametrize(("version", "model", "modality"), _cases(False), ids=_ids(_cases(False)))
def test_family_incident_without_plugin(
    version: str, model: str, modality: str, plugin_wheel: Path
) -> None:
    result = _replay(version, model, modality, plugin_wheel, disable_plugin=True)
    print(_report(result))
    if not result.started and not result.plugin_lines:
        # Seen twice on 0.23.0 with Qwen2.5-VL and video allowed: without the plugin the
        # server never became healthy (its multimodal warm-up runs through the same 1 MB
        # cache); with the plugin the same settings start in about 30 s. Not a baseline
        # the replay's figures can be read from.
        pytest.skip(f"without the plugin the server did not start: {result.error}")
    print(_figures(result))
    _common(result)
    assert not result.plugin_lines, _report(result)
    expected = UNPATCHED.get((version, model, modality))
    if expected is None:
        return
    b = result.step(incident.step_names(modality)[1])
    assert b is not None and b.status == 500, _report(result)
    new = incident.new_item_steps(result)
    if expected == "hang":
        assert result.hung and new and new[-1].timed_out, _report(result)
        assert result.spin_after is not None and result.spin_after.spinning, _report(result)
    else:
        assert not result.hung, _report(result)
        assert len(new) == N_ITEMS and all(s.ok for s in new), _report(result)
