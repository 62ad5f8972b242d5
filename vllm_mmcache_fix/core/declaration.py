"""What a fix owns, stated once next to its code: one :class:`Declaration` per fix.

Each fix's folder has an ``owns.py`` holding its declaration: the patches it applies (one
catalogue row each), the counts it keeps (and the metric each one feeds), the metrics it
exports, the settings it reads and the text of its "active" log line. The root
(``plugin.py``) lists the fixes and reads their declarations; ``plugin.counts()``, the
exporter's tables, the catalogue, ``check``'s settings table and the metrics table of
``docs/health.md`` are derived from them (``docs/new-fix.md``).

A declaration is data plus small readers: importing an ``owns`` module imports no vLLM and
builds nothing; :attr:`Declaration.build` imports the fix's code when the root needs it.
"""

from __future__ import annotations

from .records import frozen

TYPE_CHECKING = False  # as typing's, without importing typing in every vLLM process
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping
    from typing import Any, Protocol

    from .lifecycle import Fix
    from .settings_table import SettingSpec

    class Root(Protocol):
        """What a fix's builder and readers may ask of the root (``plugin.py``)."""

        def counts(self) -> dict[str, int]: ...

        def built(self, fix_id: str) -> Fix | None: ...

        def internal_errors(self) -> int: ...

        def declarations(self) -> tuple[Declaration, ...]: ...


def lazy_attribute(module: str, name: str, compute: Callable[[], Any]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` answering ``name`` with ``compute()``, on each access: a
    table gathered from the fixes' declarations is never built at import."""

    def __getattr__(attribute: str) -> Any:
        if attribute == name:
            return compute()
        raise AttributeError(f"module {module!r} has no attribute {attribute!r}")

    return __getattr__


ENGINE_NAME_KEY = "engine_name"
"""The key of an engine's name in the counts ``Declaration.engine_counts`` gives."""


@frozen
class MetricSpec:
    """One ``mmcache_fix_*`` metric: its one name, type, labels and description."""

    name: str
    kind: str
    """``counter``, ``gauge`` or ``histogram``."""
    labels: tuple[str, ...]
    help: str
    """The one description of the metric: ``/metrics`` HELP and the docs table say this."""
    multiprocess_mode: str = "livesum"
    """How vLLM's multiprocess collector merges a gauge over API servers (``--api-server-count
    > 1``): counters and histograms are always summed."""
    deprecated_alias: str = ""
    """A former name still exported with the same value for one release (CHANGELOG), or ""."""


@frozen
class PatchSpec:
    """One patch: what it patches, where it acts, why, the upstream threads, and when it can
    be removed (``catalogue.CATALOGUE`` lists every fix's)."""

    id: str
    fix: str
    """The fix (``plugin.FIXES``) that applies this patch."""
    runs_in: str
    """The processes where the patch acts."""
    targets: tuple[str, ...]
    """Where the patch lands, newest layout first (see locate.py)."""
    why: str
    upstream: tuple[str, ...]
    affected: str
    detection: str
    """How the package decides at run time that the target needs it."""
    removal: str
    """When the patch can be deleted."""
    source_patches: bool
    """Whether ``patches/`` carries the same fix as a source diff."""


@frozen
class Count:
    """One number of :func:`plugin.counts` (sent by EngineCore with each heartbeat answer) and
    the series of ``metric`` it feeds."""

    key: str
    read: Callable[[Root], int]
    """Reads the count in this process; imports nothing (a module not imported counted
    nothing)."""
    metric: str = ""
    """The metric it feeds ("" for none)."""
    labels: tuple[tuple[str, str], ...] = ()
    """Fixed labels of its series (besides the process label)."""
    process_label: str = "process"
    """The label naming the process that counted (``api_server``/``engine_core``): the count
    is exported for the API server and, summed, for its EngineCores. "" for a count of the
    API server only (no process label)."""


@frozen
class Declaration:
    """Everything one fix owns (``<fix>/owns.py``)."""

    fix_id: str
    build: Callable[[Root], Fix]
    """Imports the fix's code and returns the process's fix object."""
    patches: tuple[PatchSpec, ...] = ()
    """The patches it applies, one catalogue row each (``catalogue.CATALOGUE``)."""
    counts: tuple[Count, ...] = ()
    more_counts: Callable[[], dict[str, int]] | None = None
    """Counts whose keys are only known at run time (each multimodal cache's figures)."""
    metrics: tuple[MetricSpec, ...] = ()
    """The metrics exported for this fix (by the metrics fix, in the API server)."""
    settings: tuple[SettingSpec, ...] = ()
    """The ``MMCACHE_FIX_*`` settings it reads (``check`` reports each)."""
    active: str = ""
    """The text its log line starts with once it acts in a process (``core.messages``)."""
    engine_counts: Callable[[Root], list[Mapping[str, Any]] | None] | None = None
    """For the fix that hears from EngineCores: the counts each last sent (its answers'
    payload, with the engine's name under ``ENGINE_NAME_KEY``), or None where this API server
    does not export them."""
    engine_ages: Callable[[Root], Mapping[str, float] | None] | None = None
    """For the same fix: seconds since each EngineCore last answered, by engine name."""
    engine_progress: Callable[[Root], list[Mapping[str, Any]] | None] | None = None
    """For the same fix: each EngineCore's progress figures (seconds without net progress,
    empty steps, step durations, verdicts), for ``metrics.liveness``."""


INTERNAL_ERRORS = "mmcache_fix_internal_errors_total"

INTERNAL_ERRORS_COUNT = Count(
    "internal_errors", lambda root: root.internal_errors(), INTERNAL_ERRORS
)
"""The plugin's own count (every fix's guarded errors and every fix that could not load):
the root's, read in every process whichever fixes it loaded."""

INTERNAL_ERRORS_METRIC = MetricSpec(
    INTERNAL_ERRORS,
    "counter",
    ("process",),
    "Errors in the plugin's own code (the part concerned was switched off, vLLM went on).",
)


def patch_ids(declaration: Declaration) -> tuple[str, ...]:
    """The ids of the patches ``declaration``'s fix applies."""
    return tuple(patch.id for patch in declaration.patches)


def read_counts(declarations: Iterable[Declaration], root: Root) -> dict[str, int]:
    """Every declared count of ``declarations``, read now."""
    counts: dict[str, int] = {}
    for declaration in declarations:
        for count in declaration.counts:
            counts[count.key] = count.read(root)
        if declaration.more_counts is not None:
            counts.update(declaration.more_counts())
    return counts
