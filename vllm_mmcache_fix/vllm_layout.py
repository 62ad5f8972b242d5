"""Where vLLM keeps what this package touches, release by release.

Every "in which module/file/class does vLLM release X keep Y" answer lives
here, as data. The fixes, ``check``, ``diagnose`` and the source-patch
generator read it; ``tests/unit/test_vllm_layout.py`` checks that nobody else
spells these names, and the realsrc tier checks the table against the released
sources. When a vLLM release moves a file, this is the one module to edit.

Lookups never go by version string: each candidate is tried, newest first, by
feature detection (``0.23.0+empty`` and ``.dev`` builds look like releases).
Importing this module imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

# --------------------------------------------------------------------------- LRU eviction

MM_CACHE_FACTORY = "get_lru_cache"
"""The classmethod (0.10.0: staticmethod) that builds every multimodal LRU cache.

The LoRA and rope caches build ``LRUCache`` directly, so wrapping the factory
reaches the multimodal caches and nothing else."""


@dataclass(frozen=True)
class FactoryLayout:
    module: str
    owner: str
    file: str
    """The module's file relative to site-packages (what ``patches/`` edits)."""
    releases: str
    """The releases that have this layout (documentation; lookups never use it)."""

    @property
    def description(self) -> str:
        return f"{self.file} ({self.releases})"


FACTORY_LAYOUTS: tuple[FactoryLayout, ...] = (
    FactoryLayout(
        "vllm.multimodal.cache.base", "MultiModalCache", "vllm/multimodal/cache/base.py", "0.31+"
    ),
    FactoryLayout(
        "vllm.multimodal.cache", "MultiModalCache", "vllm/multimodal/cache.py", "0.10.1.1-0.30"
    ),
    FactoryLayout(
        "vllm.multimodal.processing",
        "ProcessingCache",
        "vllm/multimodal/processing.py",
        "0.10.0",
    ),
)

FACTORY_WATCHED_MODULES: tuple[str, ...] = ("vllm.multimodal.cache", "vllm.multimodal.processing")
"""Importing any of these means a factory module may have become importable."""

LRU_MODULES: tuple[str, ...] = ("vllm.utils.cache", "vllm.utils")
"""Where ``LRUCache`` is defined: ``vllm/utils/cache.py`` from 0.11.1, ``vllm/utils/__init__.py``
before."""

LRU_FILES: tuple[str, ...] = ("vllm/utils/cache.py", "vllm/utils/__init__.py")

LRU_FIXED_METHODS: tuple[str, ...] = ("touch", "popitem", "clear")
"""The ``LRUCache`` methods the eviction fix replaces."""

EVICTION_FRAMES = frozenset({"popitem"})
"""The function a frozen eviction loops in (top of the stuck stack)."""
EVICTION_CALLERS = frozenset({"__setitem__", "clear", "remove_oldest", "_remove_old_if_needed"})
"""Its callers: cachetools' ``Cache.__setitem__`` and vLLM's ``LRUCache.clear``."""
STACK_FILE_MARKERS: tuple[str, ...] = (*LRU_FILES, "cachetools")
"""Files whose frames in a stack dump mean "inside the multimodal LRU"."""

# --------------------------------------------------------------------------- drift guard


@dataclass(frozen=True)
class ClassLayout:
    module: str
    cls: str
    releases: str


@dataclass(frozen=True)
class DriftTarget:
    name: str
    candidates: tuple[ClassLayout, ...]
    required: tuple[str, ...]
    """Methods the class must define for the target to be patched."""
    optional: tuple[str, ...] = ()
    """Methods patched when present (a release without them is still tracked)."""


DRIFT_TARGETS: tuple[DriftTarget, ...] = (
    DriftTarget(
        "sender",
        (
            ClassLayout("vllm.multimodal.cache.lru", "LruKeyReplicatedSenderCache", "0.31+"),
            ClassLayout("vllm.multimodal.cache", "MultiModalProcessorSenderCache", "0.10.1.1-0.30"),
        ),
        required=("get_and_update_item", "is_cached_item"),
        # touch_sender_cache_item arrived in 0.12.0; invalidate with the miss error in 0.28.0.
        optional=("touch_sender_cache_item", "clear_cache", "invalidate"),
    ),
    DriftTarget(
        "processor",
        (
            ClassLayout("vllm.multimodal.processing.processor", "BaseMultiModalProcessor", "0.15+"),
            ClassLayout("vllm.multimodal.processing", "BaseMultiModalProcessor", "0.10.0-0.14"),
        ),
        required=("_merge_mm_kwargs", "apply"),
    ),
    DriftTarget(
        "process_inputs",
        (
            ClassLayout("vllm.v1.engine.input_processor", "InputProcessor", "0.12+"),
            ClassLayout("vllm.v1.engine.processor", "Processor", "0.10.0-0.13"),
        ),
        required=("process_inputs",),
    ),
    DriftTarget(
        "generate",
        (ClassLayout("vllm.v1.engine.async_llm", "AsyncLLM", "0.10.0+"),),
        required=("generate",),
    ),
)

SENDER_LRU_ATTR = "_cache"
"""The sender cache's ``LRUCache`` attribute (every release with the LRU sender)."""

DRIFT_WATCHED_MODULES: tuple[str, ...] = tuple(
    sorted({c.module for t in DRIFT_TARGETS for c in t.candidates})
)

# --------------------------------------------------------------------------- processes

ENGINE_CORE_PROCESS = "EngineCore"
"""vLLM names EngineCore's process ``EngineCore_DP<N>`` (``/proc/<pid>/comm`` is cut
to ``EngineCor``)."""

# --------------------------------------------------------------------------- plugin groups

PLUGINS_MODULE_FILE = "vllm/plugins/__init__.py"
"""Where vLLM names its entry-point groups (``*_PLUGINS_GROUP = "vllm...."``)."""

PLUGIN_GROUPS: tuple[tuple[str, str], ...] = (
    ("vllm.general_plugins", "every process (API server, EngineCore, workers)"),
    ("vllm.platform_plugins", "every process, to pick the platform"),
    ("vllm.io_processor_plugins", "API server, when --io-processor-plugin names one"),
    ("vllm.stat_logger_plugins", "API server, stat loggers"),
    ("vllm.endpoint_plugins", "API server (0.27+); loaded ONLY when named in VLLM_PLUGINS"),
)
"""The groups ``vllm/plugins/__init__.py`` reads in 0.23.0 (the first four) and 0.27.1 and
0.32.0 (all five); each loader keeps, when ``VLLM_PLUGINS`` is set, only the entry points whose
name is in ``VLLM_PLUGINS.split(",")`` (no stripping of spaces)."""

STRICT_PLUGIN_GROUPS: frozenset[str] = frozenset({"vllm.endpoint_plugins"})
"""Groups whose entry points vLLM skips when ``VLLM_PLUGINS`` is unset."""
