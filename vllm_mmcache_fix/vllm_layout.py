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

from .core.records import frozen

# --------------------------------------------------------------------------- LRU eviction

MM_CACHE_FACTORY = "get_lru_cache"
"""The classmethod (0.10.0: staticmethod) that builds every multimodal LRU cache.

The LoRA and rope caches build ``LRUCache`` directly, so wrapping the factory
reaches the multimodal caches and nothing else."""


@frozen
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

MM_PACKAGE = "vllm.multimodal"
"""Imported by every multimodal server (0.10.0+); ``check`` imports it to tell a broken vLLM
install (it raises) from a layout the plugin does not know (it imports, the factory is
missing)."""

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


@frozen
class ClassLayout:
    module: str
    cls: str
    releases: str


@frozen
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
            ClassLayout("vllm.multimodal.cache", "MultiModalProcessorSenderCache", "0.10.2-0.30"),
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
        # The cache lookup that fails an item sent without data (its UUID only): 0.11.0+.
        optional=("_get_cache_missing_items",),
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

SENDER_READ_METHODS: tuple[str, ...] = ("get_cached_item",)
"""Sender-cache methods the drift guard leaves unwrapped on purpose: they read without
changing membership or order (0.34.0's ``get_cached_item``, ``LRUCache.peek`` underneath;
the LRU sender keeps no payload and answers None). ``_merge_mm_kwargs`` calls it for every
item before the first insert, inside the journal the drift guard opens there."""

SENDER_LRU_ATTR = "_cache"
"""The sender cache's ``LRUCache`` attribute (every release with the LRU sender)."""

DRIFT_WATCHED_MODULES: tuple[str, ...] = tuple(
    sorted({c.module for t in DRIFT_TARGETS for c in t.candidates})
)

SENDER_BUILDER_MODULES: tuple[str, ...] = (
    "vllm.v1.engine.processor",
    "vllm.v1.engine.input_processor",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.llm_engine",
    "vllm.inputs.preprocess",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.launchers.api_server.app_state",
    "vllm.entrypoints.launchers.render.app_state",
)
"""The modules that build a sender cache: they call ``processor_cache_from_config``
(``v1/engine/processor.py`` 0.10.2-0.11, ``input_processor.py`` 0.12-0.16) or
``renderer_from_config``, whose renderer builds it (0.17+: ``input_processor``, ``async_llm``,
``llm_engine``, ``inputs/preprocess`` and ``entrypoints/openai/api_server`` up to 0.2x,
``entrypoints/launchers/*/app_state`` in 0.3x). 0.10.0 and 0.10.1.1 have no sender cache.
One of them is imported before any sender cache exists; workers and EngineCore import none
(they import ``vllm.multimodal.cache`` and ``vllm.renderers.base``), so the plugin loads the
drift guard where these are imported. Checked against installed vLLM by the installed tier."""

# --------------------------------------------------------------------------- processes

ENGINE_CORE_PROCESS = "EngineCore"
"""vLLM names EngineCore's process ``EngineCore_DP<N>`` (``/proc/<pid>/comm`` is cut
to ``EngineCor``)."""

ENGINE_INPUT_THREAD = "process_input_sockets"
"""The function EngineCore's input thread runs (``EngineCoreProc.process_input_sockets``,
0.10.0+): it reads every request from the API server. Up to 0.13.0 a request that fails its
preprocessing (the multimodal cache's ``Expected a cached item`` assertion) raises out of it
and ends the thread; EngineCore then sits idle and never reads another request."""
ENGINE_OUTPUT_THREAD = "process_output_sockets"
"""The function EngineCore's output thread runs (0.10.0+); present whenever the input
thread should be."""

# --------------------------------------------------------------------------- engine liveness

ENGINE_CORE_CLASS = ClassLayout("vllm.v1.engine.core", "EngineCore", "0.10.0+")
"""EngineCore runs utility calls (``EngineCoreRequestType.UTILITY``) by name on this class:
``_handle_client_request`` does ``getattr(self, method_name)(*args)`` in its busy loop,
after the input thread has read the message (0.23.0, 0.27.1, 0.32.0)."""

ENGINE_PING_METHOD = "mmcache_fix_ping"
"""The utility method the plugin adds to EngineCore (every process: a forked EngineCore inherits
the class). EngineCore's input thread answers it (see ``ENGINE_PROC_CLASS``); the busy loop
answers it too, when a ping reaches it before the input thread is hooked."""

ENGINE_PROC_CLASS = ClassLayout("vllm.v1.engine.core", "EngineCoreProc", "0.10.0+")
"""The EngineCore that runs in its own process (a busy loop fed by an input thread). Every
process model builds one: spawned and forked ``EngineCore``/``EngineCore_DP<N>`` processes
(``DPEngineCoreProc`` subclasses it) and Ray's ``EngineCoreActor``/``DPMoEEngineCoreActor``
(mixins over it); the in-process engine (``InprocClient``) never does. Checked on every
release's ``core.py`` (0.10.0-0.34.0) by the realsrc tier."""

BUSY_LOOP_INPUT = "_process_input_queue"
"""``EngineCoreProc._process_input_queue()``: called by the busy loop (``run_busy_loop``, and
``DPEngineCoreProc.run_busy_loop``) before every step; defined on ``EngineCoreProc`` only. The
plugin adopts the engine at its first call: in a spawned EngineCore the plugin is loaded only
inside ``EngineCore.__init__``, so a wrapper of ``__init__`` would miss the running one."""
BUSY_LOOP_STEP = "_process_engine_step"
"""``EngineCoreProc._process_engine_step()``: one engine step (schedule, execute, outputs)."""
DP_ENGINE_PROC_CLASS = ClassLayout("vllm.v1.engine.core", "DPEngineCoreProc", "0.10.0+")
"""The busy loop of a data-parallel rank (``EngineCoreProc``'s subclass): after each step it
runs a dummy batch when it had nothing to run and its peers are running, then
:data:`DP_SYNC` with them."""
DP_SYNC = "_has_global_unfinished_reqs"
"""``DPEngineCoreProc._has_global_unfinished_reqs(local_unfinished)``: called at every turn of
the DP busy loop; every few calls (32, or ``dp_sync_interval``) it runs one of
:data:`DP_COLLECTIVES`, an all-reduce over the DP group that waits for every rank to finish
its current step."""
PARALLEL_CONFIG = "ParallelConfig"
"""The name under which ``vllm.v1.engine.core`` imports vLLM's ``ParallelConfig`` (from
``vllm.config``): the owner of :data:`DP_COLLECTIVES`, found through the engine module so that
its own module's path (``vllm/config.py`` or ``vllm/config/parallel.py``) does not matter."""
DP_COLLECTIVES = ("has_unfinished_dp", "sync_dp_state")
"""``ParallelConfig``'s static methods that all-reduce the DP state: ``has_unfinished_dp``
(0.10.0-0.20.x), ``sync_dp_state`` (0.21.0-0.34.0, with the pause consensus)."""
DP_DUMMY_BATCH = "execute_dummy_batch"
"""``EngineCore.execute_dummy_batch()``: a forward pass with no requests, run by an idle DP
rank while its peers run (a MoE model's collectives wait for the peers' step)."""
IDLE_CALLBACKS = "_notify_idle_state_callbacks"
"""``EngineCoreProc._notify_idle_state_callbacks()`` (0.17.0+): ``_process_input_queue`` runs it
while the loop has no work. It runs what waited for the in-flight requests to finish: a
``pause_scheduler(mode="wait")``'s completion and a sleep's executor work (level 1+: the
weights offloaded), which may take long; requests the input thread queues meanwhile wait
behind it. Runs the callbacks of ``EngineCore._idle_state_callbacks``."""
IDLE_CALLBACK_LIST = "_idle_state_callbacks"
"""``EngineCore._idle_state_callbacks`` (0.17.0+): the callbacks :data:`IDLE_CALLBACKS`
runs (empty on almost every call)."""
ENGINE_ABORT = "abort_requests"
"""``EngineCore.abort_requests(request_ids)``: every abort of a client's request goes through
it, between steps (the ABORT request, through ``_handle_client_request``) and, from 0.13.0,
inside a step too (``_process_aborts_queue``: what the input thread put on ``aborts_queue``
while the step ran, aborted before the step's outputs). Called only when there is something
to abort (0.10.0-0.34.0)."""
BUSY_LOOP_DISPATCH = "_handle_client_request"
"""``EngineCoreProc._handle_client_request(request_type, request)``: the busy loop runs one
request from the input queue (``DPEngineCoreProc`` overrides it and calls it for everything
but ``START_DP_WAVE``). For a utility call it looks the method up by name, runs it, and puts the
reply on the thread-safe output queue."""
ENGINE_INPUT_QUEUE = "input_queue"
"""``EngineCoreProc.input_queue`` (a ``queue.Queue``): the input thread
(``process_input_sockets``) hands every request to the busy loop with
``self.input_queue.put_nowait((request_type, request))``."""
REQUEST_TYPE_ADD = "ADD"
REQUEST_TYPE_ABORT = "ABORT"
REQUEST_TYPE_UTILITY = "UTILITY"
"""Names of ``EngineCoreRequestType`` members (their values are one byte each)."""
UTILITY_METHOD_INDEX = 2
"""A utility request is ``(client_index, call_id, method_name, args)``."""

HEALTH_TARGET = ClassLayout("vllm.v1.engine.async_llm", "AsyncLLM", "0.10.0+")
"""``/health`` (``vllm/entrypoints/serve/instrumentator/health.py`` in 0.23.0-0.32.0) awaits
``engine_client.check_health()``, which is ``AsyncLLM.check_health``: it raises only once
EngineCore is dead (``errored``), and the handler answers 503 for ``EngineDeadError``."""

HEALTH_METHOD = "check_health"
CLIENT_OWNER_INIT = "__init__"
"""``AsyncLLM.__init__`` builds the engine client (``self.engine_core``); inside a running event
loop (``vllm serve`` builds it in uvicorn's loop) the heartbeat starts there."""

ENGINE_DEAD_ERROR = ("vllm.v1.engine.exceptions", "EngineDeadError")
"""The exception ``/health`` turns into 503 (any other one becomes a 500)."""

ENGINE_CLIENT_ATTR = "engine_core"
"""``AsyncLLM.engine_core``: the client (``AsyncMPClient`` and its DP subclasses)."""
ASYNC_CLIENT_CLASS = ClassLayout("vllm.v1.engine.core_client", "AsyncMPClient", "0.10.0+")
"""The async engine client; its ``_call_utility_async`` is checked for ``engine=`` at patch
time (imported with ``async_llm``)."""
CLIENT_CALL_UTILITY = "_call_utility_async"
"""``AsyncMPClient._call_utility_async(method, *args, engine=identity)``: one engine's utility
call (the public ``call_utility_async`` of the DP-LB client goes to every engine)."""
CLIENT_ENGINES = "core_engines"
"""``MPClient.core_engines``: the engine identities, DP rank order."""
CLIENT_INDEX = "client_index"
"""``AsyncMPClient.client_index``: which API server this is (0 with one API server)."""
CLIENT_ENGINE_PARAM = "engine"
"""The keyword of ``_call_utility_async`` that picks one engine (0.10.2-0.32.0)."""
UTILITY_SHUTDOWN_REPLY = "Server shutting down"
"""The failure reply of a utility call EngineCore rejects while it shuts down gracefully
(0.18.0+, ``_reject_utility_in_shutdown``): the heartbeat stops quietly on it."""
CLIENT_RESOURCES = ("resources", "engine_dead")
"""``MPClient.resources.engine_dead``: True once vLLM saw EngineCore die (0.10.2-0.32.0)."""

METRICS_ROUTE_MODULES: tuple[str, ...] = ("vllm.entrypoints.serve.instrumentator.metrics",)
"""Imported when the API server attaches ``/metrics`` (0.23.0, 0.27.1, 0.32.0): the plugin's
metrics start there, in serving processes only (and at the first ``/health`` otherwise)."""
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
