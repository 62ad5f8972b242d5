"""The stall snapshot and the engine liveness metrics, as pure logic: EngineCore's details
(stand-in scheduler with vLLM's attribute names), the API server's file at the first verdict
of an episode, the metrics' updates on real ``prometheus_client`` objects, and ``diagnose``
reading the file back. Real vLLM classes: tests/installed/test_stall_snapshot_installed.py;
a real server: tests/e2e/test_e2e_liveness.py."""

from __future__ import annotations

import asyncio
import collections
import enum
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import prometheus_client as prom
import pytest

from vllm_mmcache_fix.core.settings import ENV_SNAPSHOT_DIR, read_snapshot_dir
from vllm_mmcache_fix.engine_liveness import snapshot as snap
from vllm_mmcache_fix.engine_liveness.answer import Adopted, progress_snapshot, stall_building
from vllm_mmcache_fix.engine_liveness.busy_loop import STEP, Phase
from vllm_mmcache_fix.engine_liveness.health import EngineHealth
from vllm_mmcache_fix.engine_liveness.heartbeat import (
    ENGINE_NO_PROGRESS,
    NO_PROGRESS,
    VERDICT_CLASS,
    EngineBeat,
    Heartbeat,
    Liveness,
)
from vllm_mmcache_fix.engine_liveness.progress import RECENT_STEPS, STEP_BOUNDS, Progress
from vllm_mmcache_fix.metrics import liveness as lm
from vllm_mmcache_fix.metrics.exporter import Deltas, Exporter
from vllm_mmcache_fix.tools import cli
from vllm_mmcache_fix.tools.diagnose import snapshot as diag


class Status(enum.Enum):  # vLLM's RequestStatus names
    WAITING = 1
    RUNNING = 2
    WAITING_FOR_REMOTE_KVS = 4


class Pause(enum.Enum):
    UNPAUSED = 0


class Request:
    def __init__(self, rid: str, status: Status = Status.WAITING) -> None:
        self.request_id = rid
        self.status = status
        self.num_computed_tokens = 0


class Queue(collections.deque):  # vLLM's FCFSRequestQueue
    def peek_request(self) -> Request:
        if not self:
            raise IndexError("empty")
        return self[0]


class Scheduler:
    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.waiting = Queue()
        self.running: list[Request] = []
        self._pause_state = Pause.UNPAUSED

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)


class Encoder:
    cache_size = 1000
    num_free_slots = 0  # the encoder budget full: the multimodal livelock's signature


class KV:
    usage = 0.25


def stuck_scheduler() -> Scheduler:
    sched = Scheduler()
    running = Request("run-1", Status.RUNNING)
    running.num_computed_tokens = 300
    running.arrival_time = time.time() - 90.0  # type: ignore[attr-defined]
    sched.requests[running.request_id] = running
    sched.running.append(running)
    waiting = Request("img-2")
    waiting.arrival_time = time.time() - 120.0  # type: ignore[attr-defined]
    sched.add(waiting)
    sched.encoder_cache_manager = Encoder()  # type: ignore[attr-defined]
    sched.kv_cache_manager = KV()  # type: ignore[attr-defined]
    return sched


# -- EngineCore ----------------------------------------------------------------------


def test_step_durations_go_to_their_buckets_and_the_ring_keeps_the_last() -> None:
    sched, p = Scheduler(), Progress()
    durations = [0.0005, 0.003, 0.2, 7.0] + [0.01 * i for i in range(1, 20)]
    t = 0.0
    for d in durations:
        p.after_step(sched, t + d, t)
        t += d + 1.0
    assert sum(p.step_counts) == len(durations) == p.timed
    assert p.step_counts[0] == 1  # <= 1 ms
    assert p.step_counts[len(STEP_BOUNDS)] == 1  # past the last bound: 7 s
    assert p.step_sum == pytest.approx(sum(durations))
    assert p.recent_steps() == pytest.approx(durations[-RECENT_STEPS:])
    fresh = Progress()
    fresh.after_step(sched, 2.5, 2.0)
    assert fresh.recent_steps() == [0.5]
    fresh.after_step(sched, 3.0)  # no start given (an old caller): not timed
    assert fresh.timed == 1


def test_details_name_the_stuck_requests_and_the_engine_state() -> None:
    sched = stuck_scheduler()
    sched._pause_state = Pause.UNPAUSED
    engine = type("Engine", (), {})()
    engine.model_executor = type("Executor", (), {"is_sleeping": False})()
    details = snap.engine_details(engine, sched)
    by_id = {r["request_id"]: r for r in details[snap.KEY_REQUESTS]}
    assert by_id["run-1"]["status"] == "RUNNING" and by_id["run-1"]["computed"] == 300
    assert by_id["run-1"]["queue"] == "running" and 89 < by_id["run-1"]["age_s"] < 100
    assert by_id["img-2"]["waiting_reason"] == "not scheduled yet"
    assert details["encoder_cache_usage"] == 1.0 and details["kv_cache_usage"] == 0.25
    assert details["pause_state"] == "UNPAUSED" and details["sleeping"] is False
    assert (details["running"], details["waiting"], details["requests"]) == (1, 1, 2)
    names = {s["thread"] for s in details[snap.KEY_STACKS]}
    assert threading.current_thread().name in names
    assert snap.oldest_request(details)["request_id"] == "img-2"  # type: ignore[index]
    remote = Request("kv", Status.WAITING_FOR_REMOTE_KVS)
    assert snap.request_facts(remote, "waiting", 0.0)["waiting_reason"] == "remote_kvs"


def test_details_are_bounded_and_survive_a_bare_scheduler() -> None:
    sched = Scheduler()
    for i in range(50):
        r = Request(f"r{i}", Status.RUNNING)
        sched.running.append(r)
    details = snap.engine_details(object(), sched)
    assert len(details[snap.KEY_REQUESTS]) == snap.MAX_REQUESTS
    assert "kv_cache_usage" not in details and details["sleeping"] is None
    assert details[snap.KEY_REQUESTS][0]["age_s"] is None  # no arrival_time: not invented
    empty = Scheduler()
    empty.waiting = Queue()
    assert snap.stuck_requests(empty) == []


def test_the_answer_carries_details_only_while_a_stall_builds() -> None:
    record = Adopted()
    sched = stuck_scheduler()
    record.progress.added(time.monotonic() - 5.0)
    assert not stall_building(record, progress_snapshot(record, sched))
    record.progress.since = time.monotonic() - snap.DETAIL_AFTER_S - 1.0
    progress = progress_snapshot(record, sched)
    assert progress["stalled_s"] > snap.DETAIL_AFTER_S and stall_building(record, progress)
    idle = Adopted()
    idle.loop.phase = Phase(STEP, "", time.monotonic() - snap.DETAIL_AFTER_S - 1.0)
    assert stall_building(idle, progress_snapshot(idle, Scheduler()))  # one long step
    assert progress["step_counts"] == [0] * (len(STEP_BOUNDS) + 1)


# -- the API server: the file ----------------------------------------------------------


def reply(stalled: float, details: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "schema": 2,
        "pid": 1,
        "via": "input thread",
        "input_thread": True,
        "loop": {"state": "idle", "detail": "", "for_s": 0.0},
        "progress": {
            "stalled_s": stalled,
            "empty_steps": 40,
            "steps": 50,
            "step_counts": [1] * (len(STEP_BOUNDS) + 1),
            "step_sum": 3.0,
            "recent_steps_s": [0.01, 0.02],
        },
        "counts": {},
    }
    if details is not None:
        out[snap.KEY_DETAILS] = details
    return out


class Client:
    def __init__(self) -> None:
        self.core_engines = [(0).to_bytes(2, "little")]
        self.client_index = 0
        self.answer: Any = reply(0.0)

    async def _call_utility_async(self, method: str, *args: Any, engine: Any) -> Any:
        return self.answer


def _health(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> EngineHealth:
    monkeypatch.setenv(ENV_SNAPSHOT_DIR, str(tmp_path))
    health = EngineHealth()
    health.attempted = health.enabled = True
    health.timeout, health.step_timeout, health.progress_timeout = 10.0, 300.0, 30.0
    health.snapshots = snap.SnapshotWriter()
    return health


def _drive(beat: Heartbeat, client: Client, stalls: list[float], details: Any) -> None:
    async def go() -> None:
        for i, stalled in enumerate(stalls):
            client.answer = reply(stalled, details if stalled else None)
            beat.tick(client, 2.0 * i, responsive=True)
            for _ in range(5):
                await asyncio.sleep(0)

    asyncio.run(go())


def _wait_files(directory: Path, count: int) -> list[Path]:
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        files = sorted(directory.glob(f"{snap.FILE_PREFIX}*.json"))
        if len(files) >= count:
            return files
        time.sleep(0.01)
    return sorted(directory.glob(f"{snap.FILE_PREFIX}*.json"))


def test_one_snapshot_per_episode_named_in_the_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    health = _health(tmp_path, monkeypatch)
    details = snap.engine_details(object(), stuck_scheduler())
    client = Client()
    beat = Heartbeat(client, 10.0, progress_timeout=30.0, on_verdict=health.on_verdict)
    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        # An episode of four failing answers, recovery, then a second episode.
        _drive(beat, client, [31.0, 33.0, 35.0, 37.0, 0.0, 31.0, 33.0, 35.0], details)
    files = _wait_files(tmp_path, 2)
    assert len(files) == 2, files
    warnings = [r.getMessage() for r in caplog.records if ENGINE_NO_PROGRESS in r.getMessage()]
    assert len(warnings) == 2
    assert f"{VERDICT_CLASS} {NO_PROGRESS}" in warnings[0]
    assert "oldest stuck request: img-2 (WAITING" in warnings[0]
    assert {w.split("snapshot: ")[1].split(";")[0].split(". Run")[0] for w in warnings} == {
        str(f) for f in files
    }
    data = json.loads(files[0].read_text())
    assert data[snap.KEY_VERDICT]["class"] == NO_PROGRESS
    assert data["oldest_stuck_request"]["request_id"] == "img-2"
    assert {r["request_id"] for r in data[snap.KEY_DETAILS][snap.KEY_REQUESTS]} == {
        "run-1",
        "img-2",
    }
    assert data["last_answer"]["progress"]["recent_steps_s"] == [0.01, 0.02]
    assert beat.beats[0].verdicts == {NO_PROGRESS: 2}


def test_a_snapshot_is_bounded(tmp_path: Path) -> None:
    huge = {snap.KEY_STACKS: [{"thread": "t", "frames": ["x" * 1000] * 1000}]}
    data = {snap.KEY_SCHEMA: 1, snap.KEY_KIND: snap.KIND_VALUE, snap.KEY_DETAILS: huge}
    text = snap.bounded_json(data)
    assert len(text) <= snap.MAX_BYTES and json.loads(text)["truncated"] is True
    writer = snap.SnapshotWriter({ENV_SNAPSHOT_DIR: str(tmp_path)})
    for i in range(snap.KEEP_FILES + 5):
        writer.write(data, tmp_path / f"{snap.FILE_PREFIX}e-1-{i:04d}.json").join(10)
    assert len(list(tmp_path.glob("*.json"))) == snap.KEEP_FILES


def test_an_unwritable_directory_is_reported_once_and_the_verdict_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    health = _health(tmp_path / "file" / "sub", monkeypatch)
    client = Client()
    beat = Heartbeat(client, 10.0, progress_timeout=30.0, on_verdict=health.on_verdict)
    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        _drive(beat, client, [31.0, 33.0], None)
        deadline = time.monotonic() + 10
        while health.snapshots and not health.snapshots.failed and time.monotonic() < deadline:
            time.sleep(0.01)
    assert beat.verdict() and health.snapshots is not None and health.snapshots.failed == 1
    assert sum("could not be written" in r.getMessage() for r in caplog.records) == 1
    verdicts = [r.getMessage() for r in caplog.records if VERDICT_CLASS in r.getMessage()]
    assert len(verdicts) == 1 and "oldest stuck request: not known" in verdicts[0]


def test_an_internal_error_turns_snapshots_off_not_health(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    health = _health(tmp_path, monkeypatch)

    class Broken(snap.SnapshotWriter):
        def path_for(self, engine: str, when: float) -> Path:
            raise OSError("boom")

    health.snapshots = Broken()
    client = Client()
    beat = Heartbeat(client, 10.0, progress_timeout=30.0, on_verdict=health.on_verdict)
    _drive(beat, client, [31.0, 33.0], None)
    assert beat.verdict()  # /health fails as it must
    assert health.snapshots is None and health.switched_off is None
    assert health.errors.counts == {"engine_health.snapshot": 1}


def test_a_bad_directory_setting_falls_back_with_a_message(tmp_path: Path) -> None:
    blocker = tmp_path / "f"
    blocker.write_text("")
    path, problem = read_snapshot_dir({ENV_SNAPSHOT_DIR: str(blocker)})
    assert problem and ENV_SNAPSHOT_DIR in problem and path != str(blocker)
    assert read_snapshot_dir({ENV_SNAPSHOT_DIR: str(tmp_path)}) == (str(tmp_path), None)


# -- metrics ---------------------------------------------------------------------------


def test_liveness_plan_counts_increases_once() -> None:
    deltas = Deltas()
    figure = {"engine": "EngineCore", **reply(40.0)["progress"], "verdicts": {NO_PROGRESS: 1}}
    updates, hist = lm.plan(deltas.increase, [figure])
    as_dict = {(m, lbl): (op, v) for m, lbl, op, v in updates}
    engine = (("engine", "EngineCore"),)
    assert as_dict[(lm.STALLED_SECONDS, engine)] == ("set", 40.0)
    assert as_dict[(lm.EMPTY_STEPS, engine)] == ("inc", 40.0)
    assert as_dict[(lm.VERDICTS, (*engine, ("class", NO_PROGRESS)))] == ("inc", 1.0)
    assert hist == [(engine, [1.0] * (len(STEP_BOUNDS) + 1), 3.0)]
    figure["empty_steps"] = 45
    updates, hist = lm.plan(deltas.increase, [figure])
    assert (lm.EMPTY_STEPS, engine, "inc", 5.0) in updates
    assert hist == [(engine, [0.0] * (len(STEP_BOUNDS) + 1), 0.0)]
    assert lm.plan(deltas.increase, [{"engine": 3}, {"engine": "x", "step_counts": [1]}]) == (
        [],
        [],
    )


def test_the_exporter_shows_the_liveness_series() -> None:
    figures: list[Mapping[str, Any]] = [
        {"engine": "EngineCore", **reply(40.0)["progress"], "verdicts": {NO_PROGRESS: 1}}
    ]
    exporter = Exporter(lambda: {}, lambda: None, lambda exc: None, progress=lambda: figures)
    exporter.start()
    try:
        exporter.sync()
        figures[0] = {**figures[0], "step_counts": [2] * (len(STEP_BOUNDS) + 1), "step_sum": 5.0}
        exporter.sync()
        value = prom.REGISTRY.get_sample_value
        labels = {"engine": "EngineCore"}
        assert value(lm.STALLED_SECONDS, labels) == 40.0
        assert value(lm.EMPTY_STEPS, labels) == 40.0
        assert value(lm.VERDICTS, {**labels, "class": NO_PROGRESS}) == 1.0
        assert value(f"{lm.STEP_SECONDS}_count", labels) == 2 * (len(STEP_BOUNDS) + 1)
        assert value(f"{lm.STEP_SECONDS}_sum", labels) == 5.0
        first = value(f"{lm.STEP_SECONDS}_bucket", {**labels, "le": str(STEP_BOUNDS[0])})
        assert first == 2.0
        assert exporter.failed_syncs == 0
    finally:
        exporter.unregister()


def test_progress_figures_come_from_the_first_api_server_only() -> None:
    liveness = Liveness(10.0)
    client = Client()
    beat = Heartbeat(client, 10.0)
    beat.beats[0].progress = {"stalled_s": 3.0}
    beat.beats[0].verdicts = {NO_PROGRESS: 1}
    liveness.heartbeats[client] = beat
    assert liveness.progress_figures() == [
        {"engine": "EngineCore", "stalled_s": 3.0, "verdicts": {NO_PROGRESS: 1}}
    ]
    client.client_index = beat.client_index = 1
    assert liveness.progress_figures() is None


# -- diagnose --------------------------------------------------------------------------


def _written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    health = _health(tmp_path, monkeypatch)
    details = snap.engine_details(object(), stuck_scheduler())
    details[snap.KEY_REQUESTS][0]["request_id"] = "chatcmpl-1 api_key=sk-SECRET"
    beat = EngineBeat("EngineCore", b"\0\0", 0.0, details=details, progress=reply(40)["progress"])
    health.on_verdict(beat, NO_PROGRESS, "EngineCore has made no net progress for 40.0 s")
    [path] = _wait_files(tmp_path, 1)
    return path


def test_diagnose_shows_a_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _written(tmp_path, monkeypatch)
    assert cli.main(["diagnose", "--snapshot", str(path)]) == 0
    text = capsys.readouterr().out
    assert "stall class no_progress" in text and "img-2: waiting WAITING" in text
    assert "encoder cache usage 1.0" in text and "sk-SECRET" not in text
    assert "input queue" not in text  # nothing waited there
    assert cli.main(["diagnose", "--snapshot", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["stall_snapshot"]
    assert data[snap.KEY_VERDICT]["class"] == NO_PROGRESS and "sk-SECRET" not in str(data)
    pid = int(path.name.split("-")[2])
    assert diag.find_snapshot([pid], tmp_path) == path
    assert diag.find_snapshot([pid + 1], tmp_path) is None


def test_diagnose_says_a_request_waited_in_the_input_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    health = _health(tmp_path, monkeypatch)
    progress = {**reply(40)["progress"], "queued_s": 40.0}
    beat = EngineBeat("EngineCore", b"\0\0", 0.0, details={}, progress=progress)
    beat.loop = {"state": "idle", "detail": "", "for_s": 41.0}
    health.on_verdict(beat, NO_PROGRESS, "EngineCore has made no net progress for 40.0 s")
    [path] = _wait_files(tmp_path, 1)
    assert cli.main(["diagnose", "--snapshot", str(path)]) == 0
    text = capsys.readouterr().out
    assert "a request has waited 40 s in EngineCore's input queue" in text, text


def test_diagnose_refuses_a_file_that_is_no_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "x.json"
    other.write_text('{"a": 1}')
    assert cli.main(["diagnose", "--snapshot", str(other), "--json"]) != 0
    assert "not a vllm-mmcache-fix stall snapshot" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["diagnose", "--json"])
    assert exit_.value.code == 2 and "--snapshot" in capsys.readouterr().out


def test_an_error_in_the_details_leaves_the_answer_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_mmcache_fix.engine_liveness import answer as answer_mod

    fix = answer_mod.EngineLivenessAnswer(lambda: {"protected": 1})
    fix.attempted = fix.enabled = True
    engine = type("Engine", (), {})()
    record = Adopted()
    record.hooked = True
    engine.__dict__[answer_mod.ENGINE_ATTR] = record
    engine.scheduler = stuck_scheduler()
    record.progress.added(time.monotonic() - snap.DETAIL_AFTER_S - 5.0)
    assert snap.KEY_DETAILS in fix.answer(engine)

    def broken(engine: Any, scheduler: Any) -> dict[str, Any]:
        raise RuntimeError("a scheduler without the expected shape")

    monkeypatch.setattr(answer_mod, "engine_details", broken)
    for _ in range(2):
        reply = fix.answer(engine)
        assert snap.KEY_DETAILS not in reply and reply["progress"]["stalled_s"] > 15
        assert reply["input_thread"] is True and reply["counts"] == {"protected": 1}
    assert fix.detailing is False and fix.errors.counts == {"engine_liveness.snapshot_details": 1}
    assert fix.progressing and fix.stamping and fix.input_thread  # the rest goes on


def test_two_episodes_in_one_millisecond_get_two_files_diagnose_finds(tmp_path: Path) -> None:
    writer = snap.SnapshotWriter({ENV_SNAPSHOT_DIR: str(tmp_path)})
    when = 1_800_000_000.123
    first, second = writer.path_for("EngineCore", when), writer.path_for("EngineCore", when)
    assert first != second
    data = {snap.KEY_SCHEMA: 1, snap.KEY_KIND: snap.KIND_VALUE}
    for path in (first, second):
        writer.write(data, path).join(10)
    assert sorted(tmp_path.glob(f"{snap.FILE_PREFIX}*.json")) == sorted([first, second])
    assert diag.find_snapshot([os.getpid()], tmp_path) in {first, second}
    assert diag.find_snapshot([os.getpid() + 1], tmp_path) is None


# --------------------------------------------------------------------------- diagnose's reading

_IDLE_CHILD = "import time\nprint('ready', flush=True)\ntime.sleep(300)\n"


def _snapshot_name(pid: int, when: float) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(when))
    return f"{snap.FILE_PREFIX}EngineCore-{pid}-{stamp}-{int(when * 1000) % 1000:03d}-1.json"


def _fake_proc(root: Path, pid: int, boot: int, started_ticks: int) -> Path:
    (root / str(pid)).mkdir(parents=True)
    (root / "stat").write_text(f"cpu  1 2 3 4\nbtime {boot}\nprocesses 9\n")
    fields = ["S", "1"] + ["0"] * 17 + [str(started_ticks)] + ["0"] * 10
    (root / str(pid) / "stat").write_text(f"{pid} (python3) {' '.join(fields)}\n")
    return root


def test_a_snapshot_an_earlier_process_with_the_same_pid_wrote_is_not_shown(
    tmp_path: Path,
) -> None:
    """A container's API server is PID 1 after every restart: the snapshot of the one before
    was shown as this one's."""
    tick = os.sysconf("SC_CLK_TCK")
    proc = _fake_proc(tmp_path / "proc", 1, boot=1_700_000_000, started_ticks=600 * tick)
    started = 1_700_000_600
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    before = snapshots / _snapshot_name(1, started - 60)
    before.write_text("{}")
    assert diag.process_started(1, proc) == started
    assert diag.find_snapshot([1], snapshots, proc_root=proc) is None
    since = snapshots / _snapshot_name(1, started + 5)
    since.write_text("{}")
    assert diag.find_snapshot([1], snapshots, proc_root=proc) == since
    # An unknown start (the process gone, /proc unreadable) ties no snapshot to the pid.
    assert diag.find_snapshot([2], snapshots, proc_root=proc) is None
    # The real /proc: this process's own start.
    mine = snapshots / _snapshot_name(os.getpid(), time.time() - 10 * 365 * 86400)
    mine.write_text("{}")
    assert diag.find_snapshot([os.getpid()], snapshots) is None


def _diagnose(*args: str, env: dict[str, str] | None = None) -> Any:
    import subprocess
    import sys

    from harness.paths import REPO_ROOT

    return subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", "diagnose", *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=str(REPO_ROOT),
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
    )


def test_diagnose_reads_only_a_regular_file_of_bounded_size(tmp_path: Path) -> None:
    """A FIFO hung ``diagnose --snapshot``, /dev/zero was read without end."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero", str(tmp_path)):
        done = _diagnose("--snapshot", path, "--json")
        assert done.returncode == 1, done.stdout + done.stderr
        data = json.loads(done.stdout)
        assert data["verdict"] == "error" and "not a regular file" in data["error"], data
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (diag.MAX_FILE_BYTES + 1))
    with pytest.raises(diag.SnapshotError, match="more than"):
        diag.load_snapshot(big)


MALFORMED = {
    "verdict": {snap.KEY_KIND: snap.KIND_VALUE, "verdict": "silent"},
    "details": {snap.KEY_KIND: snap.KIND_VALUE, "details": [1]},
    "progress": {snap.KEY_KIND: snap.KIND_VALUE, "last_answer": {"progress": 5}},
    "requests": {snap.KEY_KIND: snap.KIND_VALUE, "details": {snap.KEY_REQUESTS: "img-1"}},
    "frames": {snap.KEY_KIND: snap.KIND_VALUE, "details": {snap.KEY_STACKS: [{"frames": "f"}]}},
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_snapshot_given_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(MALFORMED[kind]))
    assert cli.main(["diagnose", "--snapshot", str(path)]) == 1
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert "not a well-formed stall snapshot" in line and "Error:" not in line, line
    assert cli.main(["diagnose", "--snapshot", str(path), "--json"]) == 1
    assert "not a well-formed stall snapshot" in json.loads(capsys.readouterr().out)["error"]


def test_a_malformed_snapshot_found_under_pid_is_a_note(tmp_path: Path, children: Any) -> None:
    """It raised AttributeError in place of the whole diagnosis (exit 1)."""
    proc = children.start(_IDLE_CHILD)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.05)
    (tmp_path / _snapshot_name(proc.pid, time.time())).write_text(json.dumps(MALFORMED["verdict"]))
    env = {ENV_SNAPSHOT_DIR: str(tmp_path)}
    args = ("--pid", str(proc.pid), "--interval", "0.3", "--no-py-spy")
    done = _diagnose(*args, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"PID {proc.pid}" in done.stdout and "verdict" in done.stdout.lower(), done.stdout
    assert "stall snapshot not shown:" in done.stdout, done.stdout
    assert "not a well-formed stall snapshot (verdict is str" in done.stdout
    data = json.loads(_diagnose(*args, "--json", env=env).stdout)
    assert data["exit_code"] == 0 and "stall_snapshot" not in data
    assert "not a well-formed stall snapshot" in data["stall_snapshot_error"]
