"""``vllm-mmcache-fix patch`` on copies of real released files: concurrent runs, symlinked
installs, durable writes, and the command line that only writes when told to.

The trees are minimal vLLM trees (``vllm/__init__.py`` that refuses to be imported, the
release's ``_version.py`` and its real target file), as in ``test_patches.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from harness import realsrc
from harness.children import plugin_cli
from harness.paths import REPO_ROOT
from vllm_mmcache_fix.tools import source_patch
from vllm_mmcache_fix.tools.source_patch import operation

PATCHES = REPO_ROOT / "patches"
VERSION = "0.23.0"
TOOLS = ["patch", "python"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def entry() -> dict:
    index = json.loads((PATCHES / "index.json").read_text(encoding="utf-8"))
    [found] = [e for e in index["patches"] if VERSION in e["versions"]]
    return found


def _tree(dest: Path, target: str) -> Path:
    src = realsrc.source_root(VERSION)
    (dest / "vllm").mkdir(parents=True)
    (dest / "vllm" / "__init__.py").write_text("raise ImportError('vllm must not be imported')\n")
    (dest / "vllm" / "_version.py").write_bytes((src / "vllm" / "_version.py").read_bytes())
    (dest / target).parent.mkdir(parents=True, exist_ok=True)
    (dest / target).write_bytes((src / target).read_bytes())
    return dest


def _symlinked_tree(tmp_path: Path, target: str) -> tuple[Path, Path, Path]:
    """A tree whose target file is a symlink into a store elsewhere (Nix, Bazel)."""
    root = _tree(tmp_path / "site", target)
    store = tmp_path / "store" / Path(target).name
    store.parent.mkdir(parents=True)
    (root / target).replace(store)
    (root / target).symlink_to(store)
    return root, root / target, store


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return plugin_cli("patch", *args, timeout=120, unset=("MMCACHE_FIX_PATCHES_DIR",))


# --------------------------------------------------------------------------- concurrent runs


def test_a_run_that_loses_the_race_does_not_undo_the_winner(
    entry: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run B is held inside its patch step while run A patches the same file. Without one
    lock over check, patch and verify, B's ``patch --forward`` then fails on A's result and B
    put back the bytes it had read first, undoing A's successful patch."""
    root = _tree(tmp_path / "site", entry["target"])
    target = root / entry["target"]
    b_inside, a_done = threading.Event(), threading.Event()
    real_run = subprocess.run

    def held_run(*args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "B" and not b_inside.is_set():
            b_inside.set()
            a_done.wait(timeout=3.0)  # with the lock, A cannot finish meanwhile
        return real_run(*args, **kwargs)

    monkeypatch.setattr(operation.subprocess, "run", held_run)
    results: dict[str, source_patch.Outcome] = {}

    def run(name: str) -> None:
        results[name] = source_patch.apply(root, patches_dir=PATCHES, tool="patch")
        if name == "A":
            a_done.set()

    b = threading.Thread(target=run, args=("B",), name="B")
    b.start()
    assert b_inside.wait(timeout=30)
    a = threading.Thread(target=run, args=("A",), name="A")
    a.start()
    a.join(timeout=60)
    b.join(timeout=60)
    assert not a.is_alive() and not b.is_alive()
    assert _sha256(target) == entry["patched_sha256"][VERSION], {
        k: v.message for k, v in results.items()
    }
    assert results["A"].exit_code == 0 and results["B"].exit_code == 0, {
        k: v.message for k, v in results.items()
    }


def test_concurrent_command_lines_agree(entry: dict, tmp_path: Path) -> None:
    """Four ``patch apply`` processes at once: all succeed, the file is patched once."""
    root = _tree(tmp_path / "site", entry["target"])
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "vllm_mmcache_fix", "patch", "apply", "--root", str(root)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outputs
    assert _sha256(root / entry["target"]) == entry["patched_sha256"][VERSION]
    assert sum("already applied" in out for out, _ in outputs) == 3, outputs


# --------------------------------------------------------------------------- symlinks


@pytest.mark.parametrize("tool", TOOLS)
def test_a_symlinked_target_is_refused_by_both_appliers(
    entry: dict, tmp_path: Path, tool: str
) -> None:
    root, link, store = _symlinked_tree(tmp_path, entry["target"])
    before = store.read_bytes()
    out = source_patch.apply(root, patches_dir=PATCHES, tool=tool)
    assert out.verdict == "patch_refused" and out.exit_code == 7, out.message
    assert "symlink" in out.message and str(store) in out.message
    assert "--follow-symlinks" in " ".join([out.message, *out.details])
    assert link.is_symlink() and os.readlink(link) == str(store)
    assert store.read_bytes() == before
    checked = source_patch.inspect_tree(root, patches_dir=PATCHES)
    assert checked.state == "unpatched"  # reading through the link is fine
    assert any("symlink" in line for line in checked.details)


@pytest.mark.parametrize("tool", TOOLS)
def test_follow_symlinks_patches_the_file_the_link_points_to(
    entry: dict, tmp_path: Path, tool: str
) -> None:
    root, link, store = _symlinked_tree(tmp_path, entry["target"])
    mode = stat.S_IMODE(store.stat().st_mode)
    done = source_patch.apply(root, patches_dir=PATCHES, tool=tool, follow_symlinks=True)
    assert done.exit_code == 0, done.message
    assert link.is_symlink() and os.readlink(link) == str(store)
    assert _sha256(store) == entry["patched_sha256"][VERSION]
    assert stat.S_IMODE(store.stat().st_mode) == mode
    assert sorted(p.name for p in store.parent.iterdir()) == [store.name]  # no temp left

    refused = source_patch.revert(root, patches_dir=PATCHES, tool=tool)
    assert refused.verdict == "patch_refused" and _sha256(store) == entry["patched_sha256"][VERSION]
    back = source_patch.revert(root, patches_dir=PATCHES, tool=tool, follow_symlinks=True)
    assert back.exit_code == 0, back.message
    assert link.is_symlink() and os.readlink(link) == str(store)
    assert _sha256(store) == entry["original_sha256"][VERSION]


def test_the_command_line_takes_follow_symlinks(entry: dict, tmp_path: Path) -> None:
    root, link, store = _symlinked_tree(tmp_path, entry["target"])
    refused = _cli("apply", "--root", str(root), "--json")
    data = json.loads(refused.stdout)
    assert refused.returncode == 7 and data["verdict"] == "patch_refused", refused.stdout
    done = _cli("apply", "--root", str(root), "--follow-symlinks")
    assert done.returncode == 0, done.stdout + done.stderr
    assert link.is_symlink() and _sha256(store) == entry["patched_sha256"][VERSION]


# --------------------------------------------------------------------------- durable writes


@pytest.mark.parametrize("tool", TOOLS)
def test_the_new_file_and_its_directory_are_synced(
    entry: dict, tmp_path: Path, tool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _tree(tmp_path / "site", entry["target"])
    target = root / entry["target"]
    synced: list[tuple[str, bool]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.append((path, stat.S_ISDIR(os.fstat(fd).st_mode)))
        real_fsync(fd)

    monkeypatch.setattr(operation.os, "fsync", fsync)
    for step in (source_patch.apply, source_patch.revert):
        synced.clear()
        out = step(root, patches_dir=PATCHES, tool=tool)
        assert out.exit_code == 0, out.message
        files = [p for p, is_dir in synced if not is_dir]
        dirs = [p for p, is_dir in synced if is_dir]
        # The data reaches the disk before the rename, the rename after it.
        assert any(Path(p).parent == target.parent for p in files), synced
        assert str(target.parent) in dirs, synced


# --------------------------------------------------------------------------- command line


def test_bare_patch_writes_nothing(entry: dict, tmp_path: Path) -> None:
    root = _tree(tmp_path / "site", entry["target"])
    target = root / entry["target"]
    before = target.read_bytes()
    done = _cli("--root", str(root))
    assert target.read_bytes() == before, done.stdout + done.stderr
    assert done.returncode == 3, done.stdout + done.stderr
    assert "patch apply" in done.stdout
    applied = _cli("apply", "--root", str(root))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert _sha256(target) == entry["patched_sha256"][VERSION]


def test_a_hash_mismatch_says_what_to_do(entry: dict, tmp_path: Path) -> None:
    root = _tree(tmp_path / "site", entry["target"])
    target = root / entry["target"]
    target.write_bytes(target.read_bytes() + b"# local change\n")
    done = _cli("apply", "--root", str(root), "--json")
    data = json.loads(done.stdout)
    assert done.returncode == 7 and data["verdict"] == "patch_refused"
    steps = " ".join(data["details"])
    assert f"vllm=={VERSION}" in steps and "--force-reinstall" in steps, steps
    assert "plugin" in steps


def _farm(tmp_path: Path, target: str, *, own_target: bool) -> tuple[Path, Path]:
    """A tree of symlinks into a store (Bazel runfiles, a Nix profile): every file of
    ``vllm`` is a link, except the target when ``own_target``."""
    store = _tree(tmp_path / "store", target)
    farm = tmp_path / "farm"
    for path in sorted(p for p in (store / "vllm").rglob("*") if p.is_file()):
        link = farm / path.relative_to(store)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
    if own_target:
        (farm / target).unlink()
        (farm / target).write_bytes((store / target).read_bytes())
    return farm, store


@pytest.mark.parametrize("own_target", [True, False], ids=["own-file", "linked-file"])
def test_a_tree_of_symlinks_found_by_import_is_the_root(
    entry: dict, tmp_path: Path, own_target: bool
) -> None:
    """``patch`` finds vLLM where Python imports it, links kept: it changed the store's
    file behind the links when it resolved ``vllm/__init__.py`` to find the root."""
    farm, store = _farm(tmp_path, entry["target"], own_target=own_target)
    stored = (store / entry["target"]).read_bytes()
    env = dict(os.environ, PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{farm}")
    env.pop("MMCACHE_FIX_PATCHES_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", "patch", "apply", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=str(tmp_path),
        check=False,
    )
    data = json.loads(done.stdout)
    assert data["root"] == str(farm), data
    assert (store / entry["target"]).read_bytes() == stored  # the store is never written
    if own_target:
        assert data["verdict"] == "applied", data
        assert _sha256(farm / entry["target"]) == entry["patched_sha256"][VERSION]
    else:
        assert data["verdict"] == "patch_refused" and "symlink" in data["message"], data
        assert (farm / entry["target"]).is_symlink()
