"""The topology runs: docs/topologies.md's table is what compat/topologies.json renders, the
records are complete, and the pure logic (verdicts, what to run, rotation, the module
command, the event reader, the fork sitecustomize) does what the runs rely on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from harness.programs.topologies import cli, record, table
from harness.programs.topologies.environment import FORK_SITE, START_METHOD_ENV
from harness.programs.topologies.http_case import module_command
from harness.programs.topologies.program_case import LogEvents
from harness.programs.topologies.shapes import BY_NAME, SHAPES, VERSIONS, shape

# ----------------------------------------------------------------------------- the file


def test_doc_table_is_what_the_file_renders() -> None:
    block = table.doc_block(table.DOC.read_text())
    assert block is not None, "docs/topologies.md has no topologies block"
    assert block == table.render_block(record.load()), "run scripts/topologies --table"


def test_readme_summary_is_what_the_file_renders() -> None:
    block = table.summary_block(table.README.read_text())
    assert block is not None, "README.md has no topologies-summary block"
    assert block == table.render_summary_block(record.load()), "run scripts/topologies --table"


def test_the_summary_claims_protection_only_for_passing_rows() -> None:
    data = {
        "rows": {
            "serve": {"0.32.0": {"runs": [{}], "status": "fail", "runs_passed": 2, "runs_total": 3}}
        }
    }
    line = next(x for x in table.render_summary(data).splitlines() if "`vllm serve` |" in x)
    assert "protected" not in line and "failed" in line, line


def test_the_summary_says_when_a_passing_row_had_a_run_that_did_not_start() -> None:
    runs = [{"status": "unverified"}, {"status": "pass"}, {"status": "pass"}]
    row = {"runs": runs, "status": "pass", "runs_passed": 2, "runs_total": 3}
    line = next(
        x
        for x in table.render_summary({"rows": {"tp2": {"0.23.0": row}}}).splitlines()
        if "tensor-parallel" in x
    )
    assert "**protected** (2/3 runs; 1 did not start, with or without the plugin)" in line


def test_every_shape_and_release_has_a_table_row() -> None:
    rendered = table.render_table(record.load())
    for s in SHAPES:
        for version in VERSIONS:
            assert f"| {s.title} | {version} |" in rendered, (s.name, version)


def test_records_are_complete_and_judged() -> None:
    data = record.load()
    for name, versions in data["rows"].items():
        assert name in BY_NAME, name
        for version, row in versions.items():
            assert row["status"] in record.STATUSES, (name, version)
            if row["status"] != "pass":
                assert row["reasons"], f"{name} {version}: {row['status']} without a reason"
            assert row["runs_total"] == len(row["runs"]), (name, version)
            for run in row["runs"]:
                assert run["shape"] == name and run["vllm"] == version
                assert re.fullmatch(r"[0-9a-f]{40}", run["plugin_commit"]), (name, version)
                assert not run["quick"], "quick runs are never recorded"
                assert record.evaluate_run(shape(name), run)[0] == run["status"], (name, run)
            assert record.summarise(shape(name), row["runs"])["status"] == row["status"]


# ----------------------------------------------------------------------------- verdicts


def _case(statuses: list, **extra: object) -> dict:
    case = {
        "started": True,
        "statuses": statuses,
        "hung": "timeout" in statuses,
        "active_in": ["APIServer pid=1", "EngineCore pid=2"],
        "health": {"polls": 10, "statuses": {"200": 10}},
        "supported_tasks": ["generate"],
    }
    case.update(extra)
    return case


def _run(withp: dict, without: dict | None = None, **extra: object) -> dict:
    run = {
        "without_plugin": without or _case([400, 500] + [200] * 20, active_in=[]),
        "with_plugin": withp,
    }
    run.update(extra)
    return run


GOOD = [400, 200] + [200] * 20


def test_a_clean_run_passes() -> None:
    status, reasons, _ = record.evaluate_run(shape("serve"), _run(_case(GOOD)))
    assert (status, reasons) == ("pass", [])


def test_a_timeout_or_a_500_with_the_plugin_fails() -> None:
    for statuses in ([400, "timeout"], [400, 500] + [200] * 20, [400, 200, 200, "timeout"]):
        status, reasons, _ = record.evaluate_run(shape("tp2"), _run(_case(statuses)))
        assert status == "fail" and reasons, statuses


def test_health_failures_during_the_replay_fail_the_run() -> None:
    withp = _case(GOOD, health={"polls": 10, "statuses": {"200": 8, "503": 2}})
    status, reasons, _ = record.evaluate_run(shape("serve"), _run(withp))
    assert status == "fail" and "/health" in reasons[0]


def test_double_counting_on_metrics_fails() -> None:
    metrics = {
        "status": 200,
        "protected_api_server": 2,
        "protected_engine_core": 2,
        "rollbacks": 1,
    }
    ok = record.evaluate_run(shape("dp2"), _run(_case(GOOD, metrics=metrics)))
    assert ok[0] == "pass", ok
    doubled = record.evaluate_run(shape("api2"), _run(_case(GOOD, metrics=metrics)))
    assert doubled[0] == "fail" and "EngineCores 2, 1 running" in doubled[1][0], doubled


def test_a_shape_that_starts_nowhere_is_unverified_with_its_cause() -> None:
    down = {"started": False, "start_failure": "ValueError: no ray"}
    status, reasons, _ = record.evaluate_run(shape("ray-dp"), _run(down, dict(down)))
    assert status == "unverified" and "no ray" in reasons[0]
    status, reasons, _ = record.evaluate_run(shape("ray-dp"), _run(down, _case(GOOD)))
    assert status == "fail" and "not with it" in reasons[0]


def test_the_plugin_not_kept_out_of_the_run_without_it_fails() -> None:
    run = _run(_case(GOOD), _case([400, 200] + [200] * 20))
    status, reasons, _ = record.evaluate_run(shape("serve"), run)
    assert status == "fail" and "kept out" in reasons[0]


def test_pooling_memory_growth_with_the_plugin_fails() -> None:
    tasks = {"supported_tasks": ["embed"]}
    without = _case(GOOD, active_in=[], pooling_memory={"api_server_growth_mb": 3.0}, **tasks)
    grows = _case(GOOD, pooling_memory={"api_server_growth_mb": 900.0}, **tasks)
    status, reasons, _ = record.evaluate_run(shape("pooling"), _run(grows, without))
    assert status == "fail" and "900 MiB with the plugin" in reasons[0]
    flat = _case(GOOD, pooling_memory={"api_server_growth_mb": 5.0}, **tasks)
    assert record.evaluate_run(shape("pooling"), _run(flat, without))[0] == "pass"


def test_steps_text_compresses_runs() -> None:
    assert record.steps_text([400, 500] + [200] * 7 + ["timeout"]) == "400, 500, 7 × 200, timeout"
    assert record.steps_text([400, 200, 200]) == "400, 200, 200"


def test_a_row_fails_when_any_run_failed() -> None:
    runs = [{"run": 1, "status": "pass"}, {"run": 2, "status": "fail", "reasons": ["x"]}]
    summary = record.summarise(shape("tp2"), runs)
    assert summary["status"] == "fail" and summary["reasons"] == ["run 2: x"]
    assert (summary["runs_passed"], summary["runs_total"]) == (1, 2)


# ----------------------------------------------------------------------------- what to run


def test_runs_wanted_spreads_over_rows_and_skips_what_is_done() -> None:
    done = {"status": "pass", "plugin_commit": "a" * 40, "quick": False}
    data = {
        "rows": {
            "serve": {"0.32.0": {"runs": [done, done]}},
            "tp2": {"0.32.0": {"runs": [dict(done, quick=True)]}},
        }
    }
    todo = record.runs_wanted(data, ["serve", "tp2"], ["0.32.0"], {"0.32.0": 3})
    assert todo == [("serve", "0.32.0"), ("tp2", "0.32.0"), ("tp2", "0.32.0"), ("tp2", "0.32.0")]


def test_a_shape_that_did_not_start_runs_again_only_when_asked() -> None:
    failed = {"status": "unverified", "plugin_commit": "a" * 40, "quick": False}
    data = {"rows": {"tp2": {"0.23.0": {"runs": [failed], "status": "unverified"}}}}
    assert record.runs_wanted(data, ["tp2"], ["0.23.0"], {"0.23.0": 3}) == []
    again = record.runs_wanted(data, ["tp2"], ["0.23.0"], {"0.23.0": 3}, retry_unverified=True)
    assert again == [("tp2", "0.23.0")] * 2


def test_refresh_older_than_redoes_runs_of_an_unknown_or_older_plugin() -> None:
    run = {"status": "pass", "plugin_commit": "f" * 40, "quick": False}
    row = {"runs": [run]}
    assert record.counted_runs(row) == 1
    assert record.counted_runs(row, refresh_older_than="e" * 40) == 0
    assert record.counted_runs(row, refresh_older_than="f" * 12) == 1


def test_rotation_is_stable_and_takes_only_passing_shapes_without_extras() -> None:
    rows = {s.name: {"0.32.0": {"status": "pass"}} for s in SHAPES}
    rows["tp2"]["0.32.0"]["status"] = "fail"
    data = {"rows": rows}
    first = cli.rotating(1, "0" * 40, data, "0.32.0")
    assert first == cli.rotating(1, "0" * 40, data, "0.32.0")
    picks = {cli.rotating(1, f"{i:040x}", data, "0.32.0")[0] for i in range(80)}
    assert "tp2" not in picks and "ray-executor" not in picks and "serve-fork" not in picks
    assert len(picks) > 5
    assert cli.rotating(1, "0" * 40, {"rows": {}}, "0.32.0") == []


# ----------------------------------------------------------------------------- pieces


def test_module_command_replaces_vllm_serve() -> None:
    cmd = ["py", "-m", "vllm.entrypoints.cli.main", "serve", "/m", "--port", "1"]
    assert module_command(cmd) == [
        "py",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/m",
        "--port",
        "1",
    ]


def test_log_events_reads_events_as_the_log_grows(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text('INFO noise\n@@topo {"event": "ready", "t": 1}\n@@topo {"event": "st')
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        events = LogEvents(log)
        assert events.wait(("ready",), 1.0, proc)["t"] == 1
        with open(log, "a") as handle:
            handle.write('ep", "step": "a", "t": 2}\n@@topo {"event": "step", "step": "b"}\n')
        assert events.wait(("step",), 1.0, proc)["step"] == "a"
        assert events.wait(("step",), 1.0, proc)["step"] == "b"
        assert events.wait(("step",), 0.3, proc) is None
    finally:
        proc.kill()
        proc.wait()


FAKE_CPU_PLATFORM = """
import os


class CpuPlatform:
    @classmethod
    def check_and_update_config(cls, vllm_config):
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        return vllm_config
"""


def test_fork_sitecustomize_sets_the_start_method_again_after_the_cpu_hook(
    tmp_path: Path,
) -> None:
    package = tmp_path / "vllm" / "platforms"
    package.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "cpu.py").write_text(textwrap.dedent(FAKE_CPU_PLATFORM))
    code = (
        "import json, os\n"
        "from vllm.platforms.cpu import CpuPlatform\n"
        "assert CpuPlatform.check_and_update_config('cfg') == 'cfg'\n"
        "print(json.dumps(os.environ['VLLM_WORKER_MULTIPROC_METHOD']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    env["PYTHONPATH"] = f"{FORK_SITE}:{tmp_path}"

    def method(wanted: str | None) -> str:
        run_env = dict(env)
        if wanted:
            run_env[START_METHOD_ENV] = wanted
        out = subprocess.run(
            [sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    assert method("fork") == "fork"
    assert method(None) == "spawn"  # without the harness's setting, vLLM's hook stands


def test_start_failure_names_the_root_cause_not_vllms_wrapper(tmp_path: Path) -> None:
    from harness.programs.topologies.http_case import start_failure

    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) WARNING 12-02 06:59:42 [system_utils.py:255] Found ulimit ... "
        "`OSError: [Errno 24] Too many open files`. Consider increasing\n"
        "(EngineCore pid=2) ERROR 12-02 07:00:27 [core.py:1510]     raise ValueError(\n"
        "(EngineCore pid=2) ERROR 12-02 07:00:27 [core.py:1510] ValueError: current "
        "platform cpu does not support ray.\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert start_failure(log) == "ValueError: current platform cpu does not support ray."


def test_rejudge_applies_this_checkouts_rules(tmp_path: Path) -> None:
    run = _run(_case(GOOD))
    run.update(shape="serve", vllm="0.32.0", status="fail", reasons=["old rule"], run=1)
    data = {"rows": {"serve": {"0.32.0": {"runs": [run], "status": "fail"}}}}
    record.rejudge(data)
    row = data["rows"]["serve"]["0.32.0"]
    assert (row["status"], run["status"], run["reasons"]) == ("pass", "pass", [])


def test_the_stuck_engine_case_turns_health_503_while_it_watches(tmp_path: Path) -> None:
    from harness.programs.topologies import environment
    from vllm_mmcache_fix.core.settings import ENV_HEALTH_TIMEOUT, ENV_MODE, MIN_HEALTH_TIMEOUT

    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    stuck = environment.case_env(shape("serve"), venv, "0.23.0", plugin=True, stuck=True)
    assert stuck[ENV_MODE] == "warn"
    assert MIN_HEALTH_TIMEOUT <= float(stuck[ENV_HEALTH_TIMEOUT]) <= 15
    plain = environment.case_env(shape("serve"), venv, "0.23.0", plugin=True)
    assert ENV_MODE not in plain and ENV_HEALTH_TIMEOUT not in plain
