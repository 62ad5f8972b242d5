"""What ``register()`` loads: vLLM calls it in every process, so it imports a fix only where the
fix may act (structure, not timing: ``scripts/bench-register`` measures the time)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

from harness.paths import REPO_ROOT
from vllm_mmcache_fix import plugin, vllm_layout
from vllm_mmcache_fix.core import imports
from vllm_mmcache_fix.core.declaration import Declaration
from vllm_mmcache_fix.core.lifecycle import Fix
from vllm_mmcache_fix.core.records import frozen

HEAVY = (
    "vllm",
    "torch",
    "asyncio",
    "prometheus_client",
    "multiprocessing",
    "importlib.metadata",
    "importlib.abc",
    "logging",
    "json",
    "typing",
    "ctypes",
    "concurrent.futures",
    "vllm_mmcache_fix.core.settings",
    "vllm_mmcache_fix.core.registry",
    "vllm_mmcache_fix.core.lifecycle",
    "vllm_mmcache_fix.lru_eviction",
    "vllm_mmcache_fix.drift_guard",
    "vllm_mmcache_fix.engine_liveness",
    "vllm_mmcache_fix.metrics",
    "vllm_mmcache_fix.stall_sentinel",
    "vllm_mmcache_fix.tools",
    "vllm_mmcache_fix.catalogue",
)
"""Modules that must stay out of a process where vLLM is not imported yet after the entry point
ran (each one is either a fix, the operator tools, or a library a fix needs)."""

FRESH = r"""
import json, sys
before = set(sys.modules)
import vllm_mmcache_fix
from vllm_mmcache_fix import plugin
vllm_mmcache_fix.register()
vllm_mmcache_fix.register()
after_register = sorted(set(sys.modules) - before)
counts = plugin.counts()
print(json.dumps({"new": after_register, "counts": counts,
                  "later": sorted(set(sys.modules) - before)}))
"""


def _fresh(code: str) -> Any:
    """What ``code``, run in a fresh interpreter with this checkout importable, printed last
    (one JSON line)."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_entry_point_imports_no_fix_before_vllm() -> None:
    out = _fresh(FRESH)
    new = set(out["new"])
    assert "vllm_mmcache_fix.plugin" in new and "vllm_mmcache_fix.core.imports" in new
    loaded = sorted(m for m in new if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert loaded == [], f"register() imported {loaded}"
    # counts() (what EngineCore sends with each heartbeat answer) imports no fix either.
    later = set(out["later"])
    assert sorted(m for m in later if any(m == h or m.startswith(h + ".") for h in HEAVY)) == []
    assert set(out["counts"].values()) == {0}


def test_each_fix_is_triggered_by_the_modules_it_patches() -> None:
    fixes = {fix.id: fix for fix in plugin.FIXES}
    assert set(plugin.TRIGGERS) == set(fixes)
    for fix_id in ("mm-lru-eviction", "engine-liveness-answer", "engine-liveness-health"):
        assert set(plugin.TRIGGERS[fix_id]) == set(fixes[fix_id].watches), fix_id
    health = set(fixes["engine-liveness-health"].watches)
    answer = set(fixes["engine-liveness-answer"].watches)
    # The metrics and the sentinel receive the signals of the liveness fixes: they come with them.
    assert set(plugin.TRIGGERS["plugin-metrics"]) == set(fixes["plugin-metrics"].watches) | health
    assert set(plugin.TRIGGERS["stall-sentinel"]) == answer | health
    # The drift guard comes where a sender cache can be built, and with its frontend targets.
    drift = set(plugin.TRIGGERS["mm-drift-guard"])
    assert drift == set(vllm_layout.SENDER_BUILDER_MODULES)
    frontend = {
        c.module
        for t in vllm_layout.DRIFT_TARGETS
        if t.name in ("process_inputs", "generate")
        for c in t.candidates
    }
    assert frontend <= drift
    # Not the modules every worker imports.
    assert not drift & set(vllm_layout.FACTORY_WATCHED_MODULES)


def test_the_mode_setting_name_is_the_settings_one() -> None:
    from vllm_mmcache_fix.core.settings import ENV_MODE

    assert plugin._ENV_MODE == ENV_MODE


class _ProbeFix(Fix):
    id = "probe-fix"
    runs_in = "every process"

    def __init__(self) -> None:
        super().__init__()
        self.installs = 0

    def _install(self) -> None:
        self.installs += 1

    def _uninstall(self) -> None:
        pass


def _write_module(tmp_path: Path, name: str) -> None:
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")


def _owns(monkeypatch: pytest.MonkeyPatch, build: Any) -> str:
    """A throwaway ``owns`` module declaring the probe fix; its ``<module>:<attribute>``."""
    module: Any = types.ModuleType("mmcache_fix_probe_owns")
    module.DECLARATION = Declaration("probe-fix", lambda root: build())
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return f"{module.__name__}:DECLARATION"


def test_a_fix_is_built_and_installed_when_its_trigger_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "mmcache_fix_trigger_probe_a"
    _write_module(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    built: list[_ProbeFix] = []

    def build() -> Fix:
        built.append(_ProbeFix())
        return built[-1]

    monkeypatch.setitem(plugin.TRIGGERS, "probe-fix", (name,))
    slot = plugin._Slot("probe-fix", "PROBE", _owns(monkeypatch, build))
    try:
        slot.install()
        slot.install()  # register() may run several times
        assert built == [] and slot.subscription is not None
        __import__(name)
        assert len(built) == 1 and built[0].installs == 1 and built[0].enabled
        slot.install()
        assert len(built) == 1 and built[0].installs == 1
    finally:
        slot.uninstall()
        sys.modules.pop(name, None)
    assert not built[0].attempted and slot.subscription is None


def test_a_trigger_already_imported_builds_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(plugin.TRIGGERS, "probe-fix", ("json",))  # imported by now
    slot = plugin._Slot("probe-fix", "PROBE", _owns(monkeypatch, _ProbeFix))
    try:
        slot.install()
        assert isinstance(slot.fix, _ProbeFix) and slot.fix.installs == 1
    finally:
        slot.uninstall()


def test_a_fix_that_cannot_load_leaves_the_import_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    name = "mmcache_fix_trigger_probe_b"
    _write_module(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))

    def broken() -> Fix:
        raise ImportError("a module missing from the wheel")

    monkeypatch.setitem(plugin.TRIGGERS, "probe-fix", (name,))
    slot = plugin._Slot("probe-fix", "PROBE", _owns(monkeypatch, broken))
    monkeypatch.setattr(plugin, "_SLOTS", (*plugin._SLOTS, slot))
    errors_before = plugin.counts()["internal_errors"]
    try:
        slot.install()
        with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
            module = __import__(name)
        assert module.VALUE == 1
        assert "cannot load probe-fix" in caplog.text and "missing from the wheel" in caplog.text
        assert plugin.counts()["internal_errors"] == errors_before + 1
    finally:
        slot.uninstall()
        sys.modules.pop(name, None)


# -- core.records: a frozen dataclass without the code generation ---------------------------


@frozen
class _Rec:
    name: str
    size: int = 3
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class _Dc:
    name: str
    size: int = 3
    note: str | None = None


def test_a_record_behaves_as_a_frozen_dataclass() -> None:
    rec, dc = _Rec("a", note="x"), _Dc("a", note="x")
    assert repr(rec) == repr(dc).replace("_Dc", "_Rec")
    assert rec == _Rec("a", 3, "x") and rec != _Rec("b") and hash(rec) == hash(_Rec("a", 3, "x"))
    assert dataclasses.asdict(rec) == dataclasses.asdict(dc)
    assert dataclasses.astuple(rec) == dataclasses.astuple(dc)
    assert [f.name for f in dataclasses.fields(rec)] == ["name", "size", "note"]
    assert dataclasses.is_dataclass(rec)
    assert dataclasses.replace(rec, size=5) == _Rec("a", 5, "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.size = 4  # type: ignore[misc]
    for bad in ((), ("a", 1, "n", "extra")):
        with pytest.raises(TypeError):
            _Rec(*bad)
    with pytest.raises(TypeError):
        _Rec("a", nme="typo")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Rec("a", name="twice")  # type: ignore[misc]


def test_records_replace_the_dataclasses_every_process_loads() -> None:
    """What ``register()`` loads and builds in a worker, EngineCore, the API server and an
    ``LLM(...)`` process (the eviction fix, the drift guard and its state, the engine's
    answer, the sentinel) builds no dataclass."""
    code = textwrap.dedent(
        """
        import dataclasses, json
        made = []
        real = dataclasses.dataclass
        def counting(*args, **kwargs):
            made.append(1)
            return real(*args, **kwargs)
        dataclasses.dataclass = counting
        import vllm_mmcache_fix.lru_eviction.fix
        import vllm_mmcache_fix.vllm_layout
        import vllm_mmcache_fix.engine_liveness.answer
        import vllm_mmcache_fix.stall_sentinel.fix
        from vllm_mmcache_fix.drift_guard.state import GuardState
        GuardState()
        print(json.dumps(len(made)))
        """
    )
    assert _fresh(code) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_gets_fresh_locks() -> None:
    """vLLM forks EngineCore and workers while other threads may hold the plugin's locks (a
    thread importing a trigger module): the child must not inherit them held."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with plugin._lock, imports._lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
            pid = os.fork()
        if pid == 0:
            ok = plugin._lock.acquire(timeout=2) and imports._lock.acquire(timeout=2)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        release.set()
        thread.join(10)
