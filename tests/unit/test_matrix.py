"""The release matrix: its table in docs/evidence.md is what compat/matrix.json renders, and
its choices."""

from __future__ import annotations

import re

from harness.paths import REPO_ROOT
from harness.programs import matrix
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED


def test_readme_table_is_what_the_matrix_file_renders() -> None:
    text = (REPO_ROOT / "docs" / "evidence.md").read_text()
    block = matrix.readme_block(text)
    assert block is not None, "docs/evidence.md has no matrix block"
    assert block == matrix.render_block(matrix.load()), "run scripts/matrix --readme"


def test_every_claimed_release_has_a_row_or_is_listed_unverified() -> None:
    data = matrix.load()
    table = matrix.render_table(data)
    for version in matrix.RELEASES:
        rec = data["releases"].get(version)
        if rec is None:
            assert re.search(rf"unverified\)?:.*\b{re.escape(version)}\b", table), version
        else:
            assert rec["status"] in ("pass", "fail", "unverified"), version
            if rec["status"] != "pass":
                assert rec["reasons"], f"{version}: {rec['status']} without a reason"


def test_records_name_the_vllm_release_and_plugin_commit() -> None:
    for version, rec in matrix.load()["releases"].items():
        assert rec["vllm"] == version
        assert re.fullmatch(r"[0-9a-f]{40}", rec["plugin_commit"]), version
        if rec.get("with_plugin", {}).get("incident", {}).get("started"):
            tasks = rec["with_plugin"]["incident"]["supported_tasks"]
            assert tasks is not None and matrix.GENERATIVE_TASK in tasks, (version, tasks)


def test_default_releases_cover_every_minor_series_once_newest_patch() -> None:
    minors = [tuple(matrix.version_key(v)[:2]) for v in matrix.RELEASES]
    newest = matrix.version_key(NEWEST_SOURCES_CHECKED)[1]
    assert sorted(set(minors)) == [(0, m) for m in range(10, newest + 1)]
    assert list(matrix.RELEASES) == sorted(matrix.RELEASES, key=matrix.version_key)


def test_rotation_is_stable_for_a_commit_and_takes_only_passing_releases() -> None:
    passing = [v for v in matrix.RELEASES if v not in matrix.SHARED_VENVS][:6]
    data = {"releases": {v: {"status": "pass"} for v in passing}}
    data["releases"][matrix.SHARED_VENVS[0]] = {"status": "pass"}
    data["releases"]["0.10.2"] = {"status": "fail"}
    a = matrix.rotating(2, "0" * 40, data)
    assert a == matrix.rotating(2, "0" * 40, data)
    assert len(set(a)) == 2
    assert set(a) <= set(passing)
    picks = {tuple(matrix.rotating(2, f"{i:040x}", data)) for i in range(50)}
    assert len(picks) > 5
    assert matrix.rotating(2, "0" * 40, {"releases": {}}) == []


def test_a_release_with_a_timeout_with_the_plugin_fails() -> None:
    phase = {
        "incident": {
            "started": True,
            "hung": True,
            "timeouts": 1,
            "server_errors": 0,
            "supported_tasks": ["generate"],
            "active_lines": {"APIServer": ["x"]},
        }
    }
    phase["summary"] = matrix._with_plugin_summary(phase)
    status, reasons = matrix.evaluate({"with_plugin": phase})
    assert status == "fail" and reasons


def test_a_pooling_model_is_not_a_pass() -> None:
    phase = {
        "incident": {
            "started": True,
            "supported_tasks": ["token_embed", "embed"],
            "active_lines": {"APIServer": ["x"]},
        }
    }
    phase["summary"] = matrix._with_plugin_summary(phase)
    status, _ = matrix.evaluate({"with_plugin": phase})
    assert status != "pass"


def test_which_releases_run_again() -> None:
    full = {"plugin_commit": "a" * 40, "status": "pass", "quick": False}
    assert matrix.needs_run(None, "a" * 40)
    assert not matrix.needs_run(full, "a" * 40)
    assert matrix.needs_run(full, "b" * 40)  # recorded for older plugin code
    assert not matrix.needs_run(full, "b" * 40, missing_only=True)
    assert matrix.needs_run({**full, "quick": True}, "a" * 40, missing_only=True)
    assert matrix.needs_run({"plugin_commit": "a" * 40}, "a" * 40, missing_only=True)


def test_supported_tasks_as_each_release_logs_them(tmp_path) -> None:
    from harness.logscan import supported_tasks

    cases = {
        "(APIServer pid=1) INFO [api_server.py:1634] Supported_tasks: ['generate']": [
            "generate"
        ],  # 0.11
        "(APIServer pid=1) INFO [api_server.py:1] Supported tasks: ['token_embed', 'embed']": [
            "token_embed",
            "embed",
        ],
        "\x1b[1;36m(APIServer pid=1)\x1b[0;0m INFO Supported tasks: ('generate',)": ["generate"],
        "INFO Starting vLLM API server": None,
    }
    for i, (line, tasks) in enumerate(cases.items()):
        log = tmp_path / f"{i}.log"
        log.write_text("INFO something\n" + line + "\n")
        assert supported_tasks(log) == tasks, line


def test_a_family_model_failing_with_the_plugin_fails_the_release() -> None:
    ok = {
        "started": True,
        "timeouts": 0,
        "server_errors": 0,
        "supported_tasks": ["generate"],
        "active_lines": {"APIServer": ["x"]},
    }
    phase = {"incident": dict(ok), "family": {"qwen3-vl": dict(ok)}}
    phase["summary"] = matrix._with_plugin_summary(phase)
    assert matrix.evaluate({"with_plugin": phase}) == ("pass", [])
    phase["family"]["qwen3-vl"] = {**ok, "server_errors": 2, "hung": True, "timeouts": 1}
    phase["summary"] = matrix._with_plugin_summary(phase)
    status, reasons = matrix.evaluate({"with_plugin": phase})
    assert status == "fail" and phase["summary"]["server_errors"] == 2
    assert phase["summary"]["freeze"] and phase["summary"]["timeouts"] == 1
    phase["family"]["qwen3-vl"] = {"started": False, "error": "not healthy"}
    phase["summary"] = matrix._with_plugin_summary(phase)
    status, reasons = matrix.evaluate({"with_plugin": phase})
    assert status == "fail" and any("qwen3-vl" in r for r in reasons)


def _program_exit(monkeypatch, tmp_path, status: str, rotate: bool) -> int:  # type: ignore[no-untyped-def]
    """``scripts/matrix`` run to its exit status, with the release's run replaced by a
    record of ``status`` (the program's own bookkeeping around it is what is tested)."""
    from harness import venvs

    passing = [v for v in matrix.RELEASES if v not in matrix.SHARED_VENVS]
    data = {"schema": matrix.SCHEMA, "releases": {v: {"status": "pass"} for v in passing}}
    path = tmp_path / "matrix.json"
    matrix.save(data, path)
    ran: list[str] = []

    def run_release(version: str, **_: object) -> dict[str, object]:
        ran.append(version)
        return {"vllm": version, "status": status, "reasons": [] if status == "pass" else ["x"]}

    monkeypatch.setattr(matrix, "run_release", run_release)
    monkeypatch.setattr(venvs, "build_wheel", lambda out: out / "w.whl")
    args = ["--no-record", "--file", str(path), "--model", str(tmp_path)]
    args += ["--rotate", "1"] if rotate else ["--only", passing[0]]
    rc = matrix.main(args)
    assert len(ran) == 1
    return rc


def test_the_rotation_fails_on_an_unverified_release(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # CI's rotation takes releases with a passing record only: a venv or a server that
    # does not come up there proves nothing, and must not pass as success.
    assert _program_exit(monkeypatch, tmp_path, "unverified", rotate=True) == 1
    assert _program_exit(monkeypatch, tmp_path, "fail", rotate=True) == 1
    assert _program_exit(monkeypatch, tmp_path, "pass", rotate=True) == 0
    # The full matrix records an unverified release and goes on (it is a row, not a failure).
    assert _program_exit(monkeypatch, tmp_path, "unverified", rotate=False) == 0
