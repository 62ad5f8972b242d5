"""``check``'s verdict (``tools/check.py``): the causes it finds, in the order an operator
fixes them, the verdict and summary they give, ``--strict``, and the run over a vLLM whose
import, probe and trial patch are stand-ins.

The installed classes themselves (a real vLLM's factory, probe and patch):
``tests/installed/test_check_installed.py``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from vllm_mmcache_fix import __version__
from vllm_mmcache_fix.core.settings import ENV_HEALTH_TIMEOUT, ENV_MODE
from vllm_mmcache_fix.core.settings_table import SettingReport
from vllm_mmcache_fix.lru_eviction.probe import Exposure
from vllm_mmcache_fix.tools import check
from vllm_mmcache_fix.tools.check import Cause, CheckReport, Verdict

GHOST = Exposure(touch_creates_ghost=True, eviction_stalls_on_ghost=True)
STALLS = Exposure(touch_creates_ghost=False, eviction_stalls_on_ghost=True)
SAFE = Exposure(touch_creates_ghost=False, eviction_stalls_on_ghost=False)


def report(**fields: Any) -> CheckReport:
    base: dict[str, Any] = {
        "verdict": Verdict.UNPROTECTED,
        "summary": "",
        "entry_point_found": True,
        "plugin_allowed": True,
        "vllm_version": "0.23.0",
        "target": "vllm.multimodal.cache._build_cache",
    }
    return CheckReport(**(base | fields))


def causes(rep: CheckReport) -> list[Cause]:
    return [f.cause for f in rep.findings]


def decided(
    rep: CheckReport,
    allowed: list[str] | None = None,
    trial: Any = check._Trial.WORKS,
    why: str = "",
    exposure: Exposure | None = GHOST,
) -> CheckReport:
    check._find_causes(rep, allowed, trial, why)
    check._decide(rep, exposure)
    return rep


# -- causes and verdicts -------------------------------------------------------------------


def test_protected_names_the_loaded_plugin_and_the_patched_factory() -> None:
    rep = decided(report(plugin_version="9.9"))
    assert rep.verdict is Verdict.PROTECTED and rep.findings == []
    assert rep.cause is None and rep.remedy is None
    assert rep.summary == (
        "vLLM 0.23.0 loads vllm-mmcache-fix 9.9; the multimodal caches it builds cannot "
        "stall (vllm.multimodal.cache._build_cache)"
    )
    rep = decided(report(source_patched=True))
    assert rep.verdict is Verdict.PROTECTED
    assert f"vllm-mmcache-fix {__version__};" in rep.summary
    assert rep.summary.endswith("; the source patch is applied too")


def test_not_installed_is_unprotected_and_says_what_the_cache_risks() -> None:
    rep = decided(report(entry_point_found=False, plugin_allowed=False), allowed=None)
    assert causes(rep) == [Cause.NOT_INSTALLED]
    assert rep.verdict is Verdict.UNPROTECTED
    assert rep.cause == "not_installed" and rep.remedy == rep.findings[0].remedy
    assert "install the vllm-mmcache-fix wheel" in rep.remedy
    assert (
        rep.summary == (rep.findings[0].detail + "; " + check._exposure_text(GHOST))
        and "'mmcache_fix'" in rep.summary
    )


def test_filtered_by_vllm_plugins_is_inactive_with_the_value_to_set() -> None:
    rep = report(plugin_allowed=False, vllm_plugins="ascend, other")
    rep.filtered_out = [
        {"name": "ascend_model", "vllm_ascend": True},
        {"name": "acme", "vllm_ascend": False},
    ]
    decided(rep, allowed=["ascend", " other", ""])
    assert causes(rep) == [Cause.FILTERED_BY_VLLM_PLUGINS]
    assert rep.verdict is Verdict.INACTIVE
    assert rep.remedy == (
        "set VLLM_PLUGINS=ascend,other,ascend_model,mmcache_fix (or unset VLLM_PLUGINS)"
    )
    assert "VLLM_PLUGINS='ascend, other' does not list 'mmcache_fix'" in rep.summary
    # Not filtered when VLLM_PLUGINS is unset, whatever plugin_allowed says.
    assert causes(decided(report(plugin_allowed=False), allowed=None)) == []


def test_the_plugins_value_lists_us_once() -> None:
    rep = report()
    assert check._plugins_with_us(rep, ["mmcache_fix", "a", "a"]) == "mmcache_fix,a"
    assert check._plugins_with_us(rep, []) == "mmcache_fix"


def test_mode_off_and_warn_are_causes_of_their_own() -> None:
    off = decided(report(mode="off"))
    assert causes(off) == [Cause.MODE_OFF] and off.verdict is Verdict.INACTIVE
    assert off.findings[0].detail == f"{ENV_MODE}=off: the plugin does nothing"
    assert off.remedy == f"unset {ENV_MODE} (or set it to on)"
    warn = decided(report(mode="warn"))
    assert causes(warn) == [Cause.MODE_WARN]
    assert warn.findings[0].detail == f"{ENV_MODE}=warn: the plugin only warns"


def test_a_layout_the_plugin_does_not_know_or_a_failing_patch() -> None:
    rep = decided(report(), trial=check._Trial.LAYOUT_NOT_FOUND, why="no factory")
    assert causes(rep) == [Cause.LAYOUT_NOT_FOUND] and rep.verdict is Verdict.INACTIVE
    assert f"vllm-mmcache-fix {__version__} does not know where vLLM 0.23.0" in rep.summary
    assert "(no factory)" in rep.summary and "0.23.0; until then" in rep.remedy
    rep = decided(report(), trial=check._Trial.FAILS, why="hook broke")
    assert causes(rep) == [Cause.PATCH_FAILED] and rep.verdict is Verdict.INACTIVE
    assert rep.findings[0].detail == "the plugin's patch does not work on this vLLM: hook broke"


def test_causes_come_in_the_order_an_operator_fixes_them() -> None:
    rep = decided(
        report(entry_point_found=False, plugin_allowed=False, mode="off"),
        allowed=["other"],
        trial=check._Trial.FAILS,
    )
    # Not installed: whether VLLM_PLUGINS lists it is moot.
    assert causes(rep) == [Cause.NOT_INSTALLED, Cause.MODE_OFF, Cause.PATCH_FAILED]
    assert rep.summary.startswith(rep.findings[0].detail + "; ")
    assert rep.cause == "not_installed" and rep.verdict is Verdict.UNPROTECTED
    assert rep.remedy == rep.findings[0].remedy != rep.findings[1].remedy
    rep = decided(report(plugin_allowed=False, mode="warn"), allowed=["other"])
    assert causes(rep) == [Cause.FILTERED_BY_VLLM_PLUGINS, Cause.MODE_WARN]
    assert rep.cause == "filtered_by_vllm_plugins" and rep.verdict is Verdict.INACTIVE


def test_a_source_patched_vllm_is_protected_by_its_own_files() -> None:
    rep = decided(report(mode="off", source_patched=True), trial=check._Trial.FAILS)
    assert rep.verdict is Verdict.PROTECTED_SOURCE_PATCH
    assert rep.cause == "mode_off" and len(rep.findings) == 2
    assert rep.summary.startswith("vLLM's own files carry the source patch")
    assert rep.summary.endswith(f"({ENV_MODE}=off: the plugin does nothing)")


def test_the_exposure_text_says_what_this_vllm_risks() -> None:
    assert check._exposure_text(None) == "vLLM's LRUCache could not be probed"
    assert "(the known trigger)" in check._exposure_text(GHOST)
    assert "no known trigger), but its eviction still spins" in check._exposure_text(STALLS)
    assert check._exposure_text(SAFE) == "this vLLM's own eviction does not stall on ghost keys"
    ghost_only = Exposure(touch_creates_ghost=True, eviction_stalls_on_ghost=False)
    assert check._exposure_text(ghost_only) == check._exposure_text(SAFE)


# -- strict ----------------------------------------------------------------------------------


def test_strict_fails_a_protected_report_with_problems_and_keeps_its_remedy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[CheckReport] = []

    def fake(environ: dict[str, str] | None = None) -> CheckReport:
        rep = made.pop(0)
        return rep

    monkeypatch.setattr(check, "_run_check", fake)
    for verdict in (Verdict.PROTECTED, Verdict.PROTECTED_SOURCE_PATCH):
        made.append(CheckReport(verdict, "fine", strict_problems=["a", "b"]))
        got = check.run_check({}, strict=True)
        assert got.strict and got.verdict is Verdict.STRICT_FAILED
        assert got.summary == (
            f"2 problem(s) --strict fails on: a; b (without them: {verdict.value}: fine)"
        )
        assert got.remedy == "fix the problems listed, then run the check again"
    made.append(CheckReport(Verdict.PROTECTED_SOURCE_PATCH, "s", strict_problems=["a"]))
    made[0].remedy = "set VLLM_PLUGINS"
    assert check.run_check({}, strict=True).remedy == "set VLLM_PLUGINS"
    # Not protected, or nothing to fail on, or not strict: the verdict stands.
    made.append(CheckReport(Verdict.INACTIVE, "x", strict_problems=["a"]))
    assert check.run_check({}, strict=True).verdict is Verdict.INACTIVE
    made.append(CheckReport(Verdict.PROTECTED, "x"))
    assert check.run_check({}, strict=True).verdict is Verdict.PROTECTED
    made.append(CheckReport(Verdict.PROTECTED, "x", strict_problems=["a"]))
    got = check.run_check({})
    assert got.verdict is Verdict.PROTECTED and not got.strict and got.summary == "x"


# -- settings and metadata ---------------------------------------------------------------------


def test_a_secret_settings_value_is_hidden() -> None:
    def row(name: str, raw: Any, effective: Any) -> dict[str, Any]:
        return check._setting_row(SettingReport(name, raw, effective, "d", "any", None))

    secret = row("MMCACHE_FIX_API_TOKEN", "abc", "abc")
    assert secret["raw"] == secret["effective"] == check.REDACTED
    assert secret["values"] == "any"
    empty = row("MMCACHE_FIX_API_TOKEN", "", None)
    assert empty["raw"] == "" and empty["effective"] is None
    plain = row("MMCACHE_FIX_MODE", "on", "on")
    assert plain["raw"] == "on" and plain["effective"] == "on" and plain["values"] == "any"
    floor = row(ENV_HEALTH_TIMEOUT, None, 60.0)
    assert floor["values"].startswith("0 (off) or seconds >= ")


def test_the_plugin_version_is_the_distribution_with_our_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    versions = {"ours": "1.2", "other": "9"}
    monkeypatch.setattr(check, "_dist_version", lambda name: versions.get(name))
    rows = [
        {"group": "vllm.general_plugins", "name": "acme", "distribution": "other"},
        {"group": "vllm.general_plugins", "name": "other_plugin", "distribution": "other"},
        {"group": "vllm.platform_plugins", "name": "mmcache_fix", "distribution": "other"},
        {"group": "vllm.general_plugins", "name": "mmcache_fix", "distribution": "ours"},
    ]
    assert check._plugin_version(rows) == "1.2"
    assert check._plugin_version(rows[:3]) is None


def test_the_first_installed_name_gives_the_version() -> None:
    assert check._dist_version("no-such-dist-here", "pytest") == check.metadata.version("pytest")
    assert check._dist_version("no-such-dist-here") is None


def _environment(
    monkeypatch: pytest.MonkeyPatch,
    found: bool = True,
    version: str | None = None,
    ascend: str | None = None,
) -> None:
    monkeypatch.setattr(check, "_entry_point_found", lambda: found)
    monkeypatch.setattr(check, "_report_plugins", lambda rep, allowed: None)
    monkeypatch.setattr(check, "_plugin_version", lambda rows: version)
    real = check._dist_version
    monkeypatch.setattr(
        check,
        "_dist_version",
        lambda *names: ascend if names[0] == "vllm-ascend" else real(*names),
    )


def test_reading_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    _environment(monkeypatch)
    rep = report()
    assert check._read_environment(rep, {}) is None
    assert rep.plugin_allowed and rep.mode == "on" and rep.problems == []
    assert rep.ascend_allowed is None and rep.vllm_ascend_version is None
    rep = report()
    assert check._read_environment(rep, {"VLLM_PLUGINS": "a,mmcache_fix"}) == ["a", "mmcache_fix"]
    assert rep.plugin_allowed and rep.vllm_plugins == "a,mmcache_fix"
    rep = report()
    check._read_environment(rep, {"VLLM_PLUGINS": "a", ENV_MODE: "warn"})
    assert not rep.plugin_allowed and rep.mode == "warn"
    _environment(monkeypatch, found=False)
    rep = report()
    check._read_environment(rep, {})
    assert not rep.plugin_allowed and not rep.entry_point_found


def test_reading_the_environment_flags_another_installed_version_and_ascend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _environment(monkeypatch, version="0.0.1", ascend="0.23.0")
    rep = report()
    check._read_environment(rep, {"VLLM_PLUGINS": "mmcache_fix"})
    assert rep.plugin_version == "0.0.1" and rep.vllm_ascend_version == "0.23.0"
    assert rep.ascend_allowed is False
    assert rep.problems == [
        f"this check runs vllm-mmcache-fix {__version__}, but vLLM would load the installed 0.0.1",
        "VLLM_PLUGINS='mmcache_fix' leaves out 'ascend': vLLM will silently not select the "
        "Ascend NPU platform",
    ]
    assert rep.strict_problems == []
    for env in ({}, {"VLLM_PLUGINS": "ascend,mmcache_fix"}):
        same = "".join(list(__version__))  # the same version, read from metadata
        _environment(monkeypatch, version=same, ascend="0.23.0")
        rep = report()
        check._read_environment(rep, env)
        assert rep.ascend_allowed is True and rep.problems == [], env


def test_plugin_loads_says_why_from_metadata_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _environment(monkeypatch, version="1.0")
    assert check.plugin_loads({}) == (
        f"vllm-mmcache-fix 1.0 is installed, VLLM_PLUGINS is unset, {ENV_MODE}=on"
    )
    assert check.plugin_loads({"VLLM_PLUGINS": "mmcache_fix"}) == (
        f"vllm-mmcache-fix 1.0 is installed, VLLM_PLUGINS lists it, {ENV_MODE}=on"
    )
    assert check.plugin_loads({"VLLM_PLUGINS": "other"}) is None
    assert check.plugin_loads({ENV_MODE: "warn"}) is None
    assert check.plugin_loads({ENV_MODE: "off"}) is None
    _environment(monkeypatch)
    assert check.plugin_loads({}) == (
        f"vllm-mmcache-fix {__version__} is installed, VLLM_PLUGINS is unset, {ENV_MODE}=on"
    )
    _environment(monkeypatch, found=False)
    assert check.plugin_loads({}) is None


# -- the run over a stand-in vLLM --------------------------------------------------------------


@pytest.fixture
def vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> types.ModuleType:
    """A ``vllm`` that imports, with the multimodal package; probe and trial are stand-ins."""
    package = tmp_path / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    module = types.ModuleType("vllm")
    module.__file__ = str(package / "__init__.py")
    module.__version__ = "0.23.0"  # type: ignore[attr-defined]
    module.__spec__ = __import__("importlib.machinery").machinery.ModuleSpec(
        "vllm", None, origin=module.__file__
    )
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, check.MM_PACKAGE, types.ModuleType(check.MM_PACKAGE))
    _environment(monkeypatch, version=__version__)
    monkeypatch.setattr(check, "_probe_installed", lambda rep: GHOST)
    monkeypatch.setattr(check, "_trial_patch", lambda rep: (check._Trial.WORKS, ""))
    monkeypatch.setattr(check, "_source_patch_state", lambda rep: None)
    return module


def test_the_run_on_a_vllm_the_plugin_protects(vllm: types.ModuleType) -> None:
    rep = check._run_check({})
    assert rep.verdict is Verdict.PROTECTED and rep.patch_works is True
    assert rep.vllm_version == "0.23.0" and rep.vllm_location == str(Path(vllm.__file__).parent)
    assert rep.exposure == GHOST.as_dict()
    assert rep.verified_up_to == check.release_coverage("0.23.0")
    assert rep.source_patched is None


def test_the_run_reads_the_source_patch_state_when_the_factory_did_not_say(
    vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def state(value: str | None) -> Any:
        return lambda rep: setattr(rep, "source_patch", {"state": value})

    monkeypatch.setattr(check, "_trial_patch", lambda rep: (check._Trial.FAILS, "broken"))
    monkeypatch.setattr(check, "_source_patch_state", state("applied"))
    rep = check._run_check({})
    assert rep.source_patched is True and rep.verdict is Verdict.PROTECTED_SOURCE_PATCH
    assert rep.patch_works is False and rep.cause == "patch_failed"
    for other in ("unpatched", None):
        monkeypatch.setattr(check, "_source_patch_state", state(other))
        assert check._run_check({}).source_patched is False, other

    def trial(rep: CheckReport) -> Any:
        rep.source_patched = False
        return check._Trial.WORKS, ""

    monkeypatch.setattr(check, "_trial_patch", trial)
    monkeypatch.setattr(check, "_source_patch_state", state("applied"))
    assert check._run_check({}).source_patched is False  # the factory's answer stands


def test_the_run_when_vllm_does_not_import(
    vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, check.MM_PACKAGE)
    real = __import__("importlib").import_module

    def refuse(name: str, *args: Any) -> Any:
        if name == check.MM_PACKAGE:
            try:
                try:
                    try:
                        raise OSError("libcuda.so.1: cannot open shared object file")
                    except OSError as exc:
                        raise ImportError("torch._C") from exc
                except ImportError as exc:
                    raise ImportError("torch") from exc
            except ImportError:
                raise SystemExit("no CUDA")  # noqa: B904 - a long traceback
        return real(name, *args)

    monkeypatch.setattr("importlib.import_module", refuse)
    monkeypatch.setattr(check, "_dist_version", lambda *names: "0.23.0")
    rep = check._run_check({})
    assert rep.verdict is Verdict.VLLM_IMPORT_FAILED
    assert rep.vllm_import_error == "SystemExit: no CUDA"
    assert len(rep.vllm_import_traceback) == 12  # its last lines
    assert rep.vllm_import_traceback[-1] == "SystemExit: no CUDA"
    assert rep.summary.startswith("vLLM 0.23.0 is installed but does not import: SystemExit")
    assert rep.remedy.startswith("repair the vLLM installation")
    monkeypatch.setattr(check, "_dist_version", lambda *names: None)
    assert "vLLM (version unknown) is installed" in check._run_check({}).summary


def test_the_run_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    _environment(monkeypatch)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    rep = check._run_check({})
    assert rep.verdict is Verdict.NO_VLLM and "not installed" in rep.summary
    assert rep.remedy == "run `python -m vllm_mmcache_fix check` with vLLM's interpreter"

    def broken(name: str) -> Any:
        raise ValueError("vllm.__spec__ is None")

    monkeypatch.setattr("importlib.util.find_spec", broken)
    assert check._run_check({}).verdict is Verdict.NO_VLLM


# -- the trial patch over a stand-in factory ---------------------------------------------------


class Built:
    """A cache vLLM's factory builds; ``fixed``: the eviction fix's class."""

    def __init__(self, fixed: bool = False) -> None:
        self.fixed = fixed


@pytest.fixture
def factory(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM 0.31+'s ``MultiModalCache.get_lru_cache`` (a classmethod) building ``Built``;
    the eviction fix's class test, compatibility check, upgrade and probe are stand-ins."""
    from vllm_mmcache_fix.lru_eviction import cache as fixed_cache

    module = types.ModuleType("vllm.multimodal.cache.base")

    class MultiModalCache:
        fixed = False
        calls = 0
        fail_at: int | None = None

        @classmethod
        def get_lru_cache(cls, capacity_gb: float, value_type: type) -> Any:
            cls.calls += 1
            if cls.calls == cls.fail_at:
                raise RuntimeError("boom")
            return Built(cls.fixed)

    MultiModalCache.__module__ = module.__name__
    module.MultiModalCache = MultiModalCache  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(fixed_cache, "is_fixed", lambda cache: cache.fixed)
    monkeypatch.setattr(fixed_cache, "check_compatible", lambda cache: None)

    def upgrade(cache: Built) -> Built:
        cache.fixed = True
        return cache

    monkeypatch.setattr(fixed_cache, "upgrade", upgrade)
    monkeypatch.setattr(check, "probe", lambda cls: SAFE)
    return MultiModalCache


def test_the_trial_patch_works_and_is_reverted(factory: Any) -> None:
    from vllm_mmcache_fix.core import registry

    rep = report(target=None)
    assert check._trial_patch(rep) == (check._Trial.WORKS, "")
    assert rep.target == "vllm.multimodal.cache.base.MultiModalCache.get_lru_cache"
    assert rep.source_patched is False  # vLLM's own factory builds the plain class
    assert factory.calls == 2
    assert not registry.is_patched(factory, "get_lru_cache")
    assert factory.get_lru_cache(1.0, object).fixed is False


def test_a_source_patched_factory_is_told_by_what_it_builds(
    factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    factory.fixed = True
    rep = report()
    assert check._trial_patch(rep)[0] is check._Trial.WORKS
    assert rep.source_patched is True
    # A fixed class whose eviction still stalls is not fixed.
    monkeypatch.setattr(check, "probe", lambda cls: STALLS)
    rep = report()
    assert check._trial_patch(rep) == (
        check._Trial.FAILS,
        "the patched factory still builds caches whose eviction can stall",
    )
    assert rep.source_patched is False
    monkeypatch.setattr(check, "probe", lambda cls: GHOST)
    assert check._builds_fixed(Built(True)) is False
    monkeypatch.setattr(check, "probe", lambda cls: SAFE)
    assert check._builds_fixed(Built(True)) is True
    assert check._builds_fixed(Built(False)) is False


def test_the_trial_patch_reports_each_way_it_fails(
    factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_mmcache_fix.core import registry
    from vllm_mmcache_fix.lru_eviction import cache as fixed_cache

    factory.fail_at = 1  # vLLM's own factory
    assert check._trial_patch(report()) == (
        check._Trial.FAILS,
        "vLLM's get_lru_cache failed: RuntimeError('boom')",
    )
    factory.calls, factory.fail_at = 0, 2  # the patched one
    rep = report()
    assert check._trial_patch(rep) == (
        check._Trial.FAILS,
        "vLLM's get_lru_cache failed: RuntimeError('boom')",
    )
    assert rep.source_patched is False and not registry.is_patched(factory, "get_lru_cache")
    factory.fail_at = None
    monkeypatch.setattr(fixed_cache, "check_compatible", lambda cache: "no touch()")
    assert check._trial_patch(report()) == (check._Trial.FAILS, "no touch()")
    monkeypatch.setattr(fixed_cache, "check_compatible", lambda cache: None)

    def broken(cache: Any) -> Any:
        raise ValueError("cannot upgrade")

    monkeypatch.setattr(fixed_cache, "upgrade", broken)
    why = check._trial_patch(report())
    assert why == (check._Trial.FAILS, "the patch's hook failed: ValueError('cannot upgrade')")
    assert not registry.is_patched(factory, "get_lru_cache")


def test_a_factory_the_plugin_patched_already_is_tried_as_it_is(factory: Any) -> None:
    from vllm_mmcache_fix.core import registry
    from vllm_mmcache_fix.lru_eviction.factory import PATCH_FIX, wrap_factory
    from vllm_mmcache_fix.lru_eviction.locate import locate_mm_cache_factory

    located = locate_mm_cache_factory()
    assert wrap_factory(PATCH_FIX, located, lambda cache, gb: cache, lambda exc: None)
    try:
        rep = report()
        # The plugin's wrapper here leaves the cache as built: not fixed.
        assert check._trial_patch(rep)[0] is check._Trial.FAILS
        assert rep.source_patched is None and factory.calls == 1
        assert registry.is_patched(factory, "get_lru_cache")  # left as found
    finally:
        registry.revert(factory, "get_lru_cache")


def test_no_factory_where_vllm_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "vllm.multimodal.cache.base",
        "vllm.multimodal.cache",
        "vllm.multimodal.processing",
    ):
        monkeypatch.setitem(sys.modules, name, None)  # importing it fails
    rep = report(target=None)
    trial, why = check._trial_patch(rep)
    assert trial is check._Trial.LAYOUT_NOT_FOUND and rep.target is None
    assert why.startswith("multimodal cache factory not found: ")
    assert check._probe_installed(rep) is None
    assert rep.problems[0].startswith("vLLM's LRUCache not found: ")


def test_the_source_patch_state_is_read_from_vllms_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vllm_mmcache_fix.tools import source_patch

    rep = report()
    check._source_patch_state(rep)  # no vLLM location: nothing read
    assert rep.source_patch is None
    seen: list[Path] = []

    def inspect(root: Path) -> Any:
        seen.append(root)
        return types.SimpleNamespace(
            state="applied", patch_file="p.patch", release="0.23.0", message="m"
        )

    monkeypatch.setattr(source_patch, "inspect_tree", inspect)
    rep = report(vllm_location=str(tmp_path / "vllm"))
    check._source_patch_state(rep)
    assert seen == [tmp_path]
    assert rep.source_patch == {
        "state": "applied",
        "patch_file": "p.patch",
        "release": "0.23.0",
        "message": "m",
    }

    def unreadable(root: Path) -> Any:
        raise OSError("no patches directory")

    monkeypatch.setattr(source_patch, "inspect_tree", unreadable)
    check._source_patch_state(rep)
    assert rep.source_patch == {"state": None, "message": "OSError: no patches directory"}


def test_the_plugins_own_entry_point_is_not_another_plugin_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = ".".join(["vllm", "general_plugins"])  # as read from metadata: not the constant

    def row(name: str, group: str, loads: bool = False, ascend: bool = False) -> dict[str, Any]:
        return {
            "group": group,
            "name": name,
            "distribution": "d-" + name,
            "loads": loads,
            "vllm_ascend": ascend,
        }

    ours = "".join(["mmcache", "_fix"])  # (as read from metadata: not the constant)
    rows = [
        row(ours, group),
        row("zeta", group),
        row(ours, "vllm.platform_plugins"),
        row(ours, "vllm.endpoint_plugins"),
        row("kept", group, loads=True),
    ]
    monkeypatch.setattr(check, "plugin_entry_points", lambda groups, allowed: rows)
    rep = report(vllm_plugins="kept")
    check._report_plugins(rep, ["kept"])
    names = [r["name"] for r in rep.filtered_out]
    assert names == ["mmcache_fix", "zeta", "mmcache_fix", "mmcache_fix"]
    (problem,) = rep.problems
    assert problem == (
        "VLLM_PLUGINS='kept' leaves out installed plugin(s) zeta (vllm.general_plugins, d-zeta), "
        "mmcache_fix (vllm.platform_plugins, d-mmcache_fix), mmcache_fix "
        "(vllm.endpoint_plugins, d-mmcache_fix): vLLM silently skips them; list them in "
        "VLLM_PLUGINS if the server needs them"
    )
    assert rep.strict_problems == [problem]
    rep = report()
    check._report_plugins(rep, None)  # VLLM_PLUGINS unset: nothing is filtered out
    assert rep.filtered_out == [] and rep.problems == []


def test_vllm_ascend_filtered_out_gets_the_value_that_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def row(name: str, group: str, loads: bool) -> dict[str, Any]:
        return {
            "group": group,
            "name": name,
            "distribution": "vllm_ascend",
            "loads": loads,
            "vllm_ascend": True,
        }

    rows = [
        row("ascend", "vllm.platform_plugins", True),
        row("ascend_model", "vllm.general_plugins", False),
        row("ascend_kv", "vllm.general_plugins", False),
    ]
    monkeypatch.setattr(check, "plugin_entry_points", lambda groups, allowed: rows)
    rep = report(vllm_plugins="ascend,mmcache_fix")
    check._report_plugins(rep, ["ascend", "mmcache_fix"])
    assert rep.ascend_entry_points == ["ascend", "ascend_model", "ascend_kv"]
    (problem,) = rep.problems
    assert problem == (
        "VLLM_PLUGINS='ascend,mmcache_fix' filters out vllm-ascend's ascend_model "
        "(vllm.general_plugins), ascend_kv (vllm.general_plugins): vLLM silently skips them "
        "(and with the general ones vllm-ascend's patches); use "
        "VLLM_PLUGINS=ascend,ascend_kv,ascend_model,mmcache_fix"
    )
    assert rep.strict_problems == [problem]


def test_a_distribution_whose_metadata_cannot_be_read_is_skipped() -> None:
    class Broken:
        @property
        def metadata(self) -> Any:
            raise ValueError("bad METADATA")

    class Fine:
        metadata = {"Name": "acme"}
        entry_points = [
            types.SimpleNamespace(group="vllm.general_plugins", name="acme", value="acme:r")
        ]

    rows = check.plugin_entry_points(["vllm.general_plugins"], None, [Broken(), Fine()])
    assert [(r["name"], r["distribution"], r["loads"]) for r in rows] == [("acme", "acme", True)]


def test_the_entry_point_is_found_by_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def installed(*names: str) -> None:
        eps = [types.SimpleNamespace(name=name) for name in names]
        monkeypatch.setattr(check.metadata, "entry_points", lambda **kw: eps)

    installed("other", "".join(["mmcache", "_fix"]))  # (read from metadata: not the constant)
    assert check._entry_point_found()
    installed("zeta", "acme")
    assert not check._entry_point_found()


def test_the_plugin_version_ignores_our_name_in_other_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(check, "_dist_version", lambda name: {"other": "9", "ours": "1"}[name])
    ours = "".join(["mmcache", "_fix"])  # (as read from metadata: not the constant)
    rows = [
        {"group": "vllm.endpoint_plugins", "name": ours, "distribution": "other"},
        {"group": "vllm.general_plugins", "name": ours, "distribution": "ours"},
    ]
    assert check._plugin_version(rows) == "1"
    assert check._plugin_version(rows[:1]) is None


def test_vllms_location_is_its_files_directory_or_else_where_its_spec_points(
    vllm: types.ModuleType, tmp_path: Path
) -> None:
    from importlib.machinery import ModuleSpec

    vllm.__spec__ = ModuleSpec("vllm", None, origin="namespace")
    assert check._run_check({}).vllm_location == str(tmp_path / "vllm")
    vllm.__spec__ = ModuleSpec("vllm", None, origin=str(tmp_path / "spec" / "__init__.py"))
    del vllm.__file__
    assert check._run_check({}).vllm_location == str(tmp_path / "spec")
    vllm.__spec__ = ModuleSpec("vllm", None, origin="namespace")
    assert check._run_check({}).vllm_location is None


def test_a_name_installed_twice_is_read_once_and_the_rest_still_read() -> None:
    class Dist:
        def __init__(self, name: str, ep: str) -> None:
            self.metadata = {"Name": name}
            self.entry_points = [
                types.SimpleNamespace(group="console_scripts", name=name, value="m:main"),
                types.SimpleNamespace(group="vllm.general_plugins", name=ep, value="m:f"),
            ]

    dists = [Dist("acme", "first"), Dist("Acme", "second"), Dist("zeta", "third")]
    rows = check.plugin_entry_points(["vllm.general_plugins"], None, dists)
    # (a console script before the plugin is not vLLM's: skipped, the plugin still read)
    assert [r["name"] for r in rows] == ["first", "third"]
    assert not any(r["vllm_ascend"] for r in rows)  # ("zeta" sorts after "vllm-ascend")


def test_the_plugin_groups_are_the_known_ones_when_vllms_plugins_file_cannot_be_read(
    tmp_path: Path,
) -> None:
    known = [group for group, _ in check.PLUGIN_GROUPS]
    assert check.vllm_plugin_groups(str(tmp_path / "no-vllm-here")) == known
    assert check.vllm_plugin_groups(None) == known


def test_an_installed_version_newer_than_this_check_is_flagged_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _environment(monkeypatch, version="99.0")
    rep = report()
    check._read_environment(rep, {})
    assert rep.problems == [
        f"this check runs vllm-mmcache-fix {__version__}, but vLLM would load the installed 99.0"
    ]
