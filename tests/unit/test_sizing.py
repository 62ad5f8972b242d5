"""``check``'s cache sizing: command lines, a fake cgroup tree (v1, v2), the verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_mmcache_fix.tools import sizing
from vllm_mmcache_fix.tools.sizing import (
    CRITICAL,
    OK,
    WARN,
    GiB,
    MemoryLimits,
    assess,
    parse_serve_args,
    read_memory_limits,
    sizing_lines,
)


def tree(tmp_path: Path, cgroup: str, files: dict[str, str], ram_gib: int = 64) -> Path:
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    (tmp_path / "proc" / "meminfo").write_text(
        f"MemTotal:       {ram_gib * 1024 * 1024} kB\nMemFree:        1000 kB\n"
    )
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_cgroup_v2_takes_the_smallest_limit_up_the_tree(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
            "sys/fs/cgroup/kubepods/pod1/memory.max": str(16 * GiB),
            "sys/fs/cgroup/kubepods/memory.max": str(100 * GiB),
        },
    )
    limits = read_memory_limits(root)
    assert (limits.cgroup_version, limits.cgroup_limit) == (2, 16 * GiB)
    assert limits.host_ram == 64 * GiB
    assert limits.effective() == 16 * GiB


def test_cgroup_v1_and_its_unlimited_value(tmp_path: Path) -> None:
    cgroup = "9:name=systemd:/\n4:memory:/docker/abc\n0::/\n"
    limited = tree(
        tmp_path / "a",
        cgroup,
        {"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": str(8 * GiB)},
    )
    limits = read_memory_limits(limited)
    assert (limits.cgroup_version, limits.cgroup_limit) == (1, 8 * GiB)
    # Inside the container the hierarchy is mounted at the group: the root file is read.
    mounted = tree(
        tmp_path / "b", cgroup, {"sys/fs/cgroup/memory/memory.limit_in_bytes": str(4 * GiB)}
    )
    assert read_memory_limits(mounted).cgroup_limit == 4 * GiB
    unlimited = tree(
        tmp_path / "c",
        cgroup,
        {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"},
    )
    limits = read_memory_limits(unlimited)
    assert limits.cgroup_limit is None and limits.effective() == 64 * GiB


def test_unreadable_trees_say_why_and_fall_back_to_the_host(tmp_path: Path) -> None:
    root = tree(tmp_path, "0::/x\n", {"sys/fs/cgroup/x/memory.max": "lots"}, ram_gib=32)
    limits = read_memory_limits(root)
    assert limits.cgroup_limit is None and limits.effective() == 32 * GiB
    assert any("lots" in note for note in limits.notes)
    empty = read_memory_limits(tmp_path / "nothing")
    assert empty.effective() is None and empty.notes


@pytest.mark.parametrize(
    ("cmdline", "cache_type", "api", "engines", "holders_x"),
    [
        ("vllm serve m", "lru", 1, 1, 1),
        ("vllm serve m --mm-processor-cache-gb=2", "lru", 1, 1, 1),
        ("vllm serve m --mm-processor-cache-type shm", "shm", 1, 1, 1),
        ("vllm serve m --api-server-count 4", "processor_only", 4, 1, 4),
        ("vllm serve m --data-parallel-size 2", "processor_only", 2, 2, 2),
        ("vllm serve m -dp 4 --api-server-count 1", "processor_only", 1, 4, 1),
        ("vllm serve m --data-parallel-size 4 --data-parallel-rank 1", "lru", 1, 1, 1),
        ("vllm serve m --mm_processor_cache_gb 0", None, 1, 1, 0),
    ],
)
def test_which_processes_hold_the_items(cmdline, cache_type, api, engines, holders_x) -> None:
    shape = parse_serve_args(cmdline)
    got = assess(shape, MemoryLimits(host_ram=1024 * GiB))
    assert (got.cache_type, got.api_servers, got.engines) == (cache_type, api, engines)
    assert got.bytes_at_full == holders_x * got.budget_bytes
    assert got.vllm_bound_bytes == got.budget_bytes * (api + engines)


def test_an_oversized_budget_in_a_limited_container_warns_with_numbers() -> None:
    limits = MemoryLimits(cgroup_version=2, cgroup_limit=16 * GiB, host_ram=64 * GiB)
    got = assess(parse_serve_args("vllm serve m --mm-processor-cache-gb 4 -asc 2"), limits)
    assert got.level == WARN and got.share == pytest.approx(0.5)
    text = "\n".join(got.messages)
    assert "8.0 GiB = 4 GiB x 2" in text and "16.0 GiB (cgroup v2)" in text, text
    assert "--mm-processor-cache-gb 4 or less" in text, text
    assert "shm is not possible in this shape" in text, text
    over = assess(parse_serve_args("vllm serve m --mm-processor-cache-gb 20"), limits)
    assert over.level == CRITICAL and "killed (OOM)" in "\n".join(over.messages)
    # The shape that allows it gets the shared-memory cache as the alternative to 0.
    assert any("--mm-processor-cache-type shm" in m for m in over.messages), over.messages
    fine = assess(parse_serve_args("vllm serve m"), limits)
    assert fine.level == OK and fine.share == pytest.approx(0.25)


def test_shm_is_offered_only_where_the_release_has_it() -> None:
    limits = MemoryLimits(host_ram=8 * GiB)
    old = assess(parse_serve_args("vllm serve m"), limits, vllm_version="0.10.2")
    new = assess(parse_serve_args("vllm serve m"), limits, vllm_version="0.23.0+empty")
    assert old.level == new.level == WARN
    assert not any("cache-type shm" in m for m in old.messages)
    assert any("cache-type shm" in m for m in new.messages)
    off = assess(parse_serve_args("vllm serve m --mm-processor-cache-gb 0"), limits, "0.32.0")
    assert off.level == OK and any("cache-type shm" in m for m in off.messages)


def test_a_small_dev_shm_is_named_for_the_shm_cache() -> None:
    limits = MemoryLimits(host_ram=64 * GiB, dev_shm=64 << 20)
    got = assess(parse_serve_args("vllm serve m --mm-processor-cache-type=shm"), limits)
    assert any("/dev/shm is 0.1 GiB" in m for m in got.messages), got.messages


def test_bad_values_are_named_and_the_rest_still_read() -> None:
    shape = parse_serve_args("vllm serve m --mm-processor-cache-gb lots --api-server-count 2")
    assert shape.api_servers == 2 and shape.cache_gb == sizing.DEFAULT_CACHE_GB
    got = assess(shape, MemoryLimits(host_ram=64 * GiB))
    assert any("'lots' is not a number" in m for m in got.messages)


def test_check_prints_only_what_matters() -> None:
    assert sizing_lines({"level": OK, "given": False, "messages": ["x"]}) == []
    assert sizing_lines({"level": WARN, "given": False, "messages": ["x"]}) == [
        "cache sizing (warn): x"
    ]
    assert sizing_lines({"level": OK, "given": True, "messages": ["y"]}) == ["cache sizing (ok): y"]
    assert sizing_lines(None) == []


def test_the_cli_reports_sizing_in_json(capsys) -> None:
    import json

    from vllm_mmcache_fix.tools.cli import main

    main(["check", "--json", "--serve-args", "vllm serve m --mm-processor-cache-gb 1"])
    data = json.loads(capsys.readouterr().out)
    assert data["sizing"]["budget_bytes"] == GiB and data["sizing"]["given"] is True
