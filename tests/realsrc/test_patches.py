"""The source patches in ``patches/`` against the real released vLLM files.

What runs where:

* Applying: every release's diff is applied with ``patch -p1`` (dry run, then for real)
  and with ``git apply`` to a copy of that release's real target file, and must give the
  file whose sha256 ``index.json`` records; ``patch -R`` must give the original back.
* Behaviour: the multimodal module itself imports torch and most of vLLM, so it is not
  imported. From the file that ``patch`` produced, the added ``_NO_VICTIM`` sentinel and
  ``_FixedLRUCache`` class are cut out with ``ast`` and executed unchanged on top of the
  release's real ``LRUCache`` (``realsrc.load_lru_module``, run on the installed
  cachetools); ``get_lru_cache`` is cut out the same way, with its annotations removed and
  its sizing helpers stubbed to one unit per item (``GiB_bytes`` = 1), and called to build
  the caches. The unpatched side uses the release's own ``get_lru_cache`` the same way.
  Each scenario (fill a 4-item cache, leave a key in the LRU order without data, insert
  until eviction, ``clear()``) must finish on the patched side; on the unpatched side the
  eviction must still be running when the subprocess is killed, with the cache state
  unchanged over 0.7 s and the data-less key at the LRU end.
* Regeneration, and the applier (``vllm_mmcache_fix.tools.source_patch``) on copies of real
  files: wrong version, modified file, already applied, revert.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import realsrc
from harness.paths import REPO_ROOT
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED as NEWEST
from vllm_mmcache_fix.tools import source_patch
from vllm_mmcache_fix.tools.source_patch import (
    EXIT_MISMATCH,
    EXIT_NO_VLLM,
    EXIT_NOT_APPLIED,
    EXIT_OK,
    EXIT_UNSUPPORTED,
)

PROJECT = REPO_ROOT
PATCHES = PROJECT / "patches"
VERSIONS = realsrc.VERSIONS
# Releases whose own touch() puts a missing key into the LRU order.
TOUCH_GHOST_VERSIONS = frozenset(v for v in VERSIONS if realsrc.version_key(v) <= (0, 23, 0))
HANG_BOUND = 120.0  # at most this long for every watcher of a hanging eviction to report
DONE_TIMEOUT = 60.0  # generous bound for the patched scenarios, which take milliseconds
MIN_SPIN = 1.0  # the eviction must have been running at least this long when killed


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def index() -> dict:
    return json.loads((PATCHES / "index.json").read_text(encoding="utf-8"))


def _entry(index: dict, version: str) -> dict:
    matches = [e for e in index["patches"] if version in e["versions"]]
    assert len(matches) == 1, f"{version} is covered by {len(matches)} patches"
    return matches[0]


def _copy_release(version: str, target: str, dest: Path, *, version_file: bool = True) -> Path:
    """A minimal vLLM tree: vllm/__init__.py, the version file and the real target file."""
    src = realsrc.source_root(version)
    (dest / "vllm").mkdir(parents=True, exist_ok=True)
    # Importing this tree's vllm would be a bug in the applier: make it fail loudly.
    (dest / "vllm" / "__init__.py").write_text("raise ImportError('vllm must not be imported')\n")
    if version_file:
        shutil.copyfile(src / "vllm" / "_version.py", dest / "vllm" / "_version.py")
    (dest / target).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / target, dest / target)
    return dest


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


# --------------------------------------------------------------------------- index and files


def test_index_covers_every_release_once(index: dict) -> None:
    covered = [v for entry in index["patches"] for v in entry["versions"]]
    assert covered == list(VERSIONS)
    diffs = sorted(p.name for p in PATCHES.glob("*.diff"))
    assert diffs == sorted(entry["file"] for entry in index["patches"])
    for entry in index["patches"]:
        assert _sha256(PATCHES / entry["file"]) == entry["sha256"]
        span = (
            entry["first"]
            if entry["first"] == entry["last"]
            else (f"{entry['first']}_{entry['last']}")
        )
        assert entry["file"] == f"vllm-{span}-mm-lru-eviction.diff"
        assert entry["versions"][0] == entry["first"] and entry["versions"][-1] == entry["last"]
        for version in entry["versions"]:
            real = realsrc.source_root(version) / entry["target"]
            assert _sha256(real) == entry["original_sha256"][version], version


def test_regeneration_is_byte_identical(tmp_path: Path) -> None:
    out = tmp_path / "patches"
    cmd = [str(PROJECT / "scripts" / "make-patches"), "--out", str(out)]
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        [*cmd, "--no-fetch"], capture_output=True, text=True, check=False, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr
    committed = {p.name: p.read_bytes() for p in PATCHES.iterdir() if p.is_file()}
    generated = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(generated) == sorted(committed)
    for name, content in generated.items():
        assert content == committed[name], f"{name} differs from a fresh generation"
    check = subprocess.run(
        [*cmd, "--no-fetch", "--check"], capture_output=True, text=True, check=False, env=env
    )
    assert check.returncode == 0, check.stderr


def test_only_the_factory_and_the_new_class_change(index: dict) -> None:
    """Every removed line is the factory's ``return LRUCache(``; nothing else is touched."""
    for entry in index["patches"]:
        text = (PATCHES / entry["file"]).read_text(encoding="utf-8")
        body = text[text.index("--- a/") :].splitlines()
        assert body[0] == f"--- a/{entry['target']}" and body[1] == f"+++ b/{entry['target']}"
        removed = [line for line in body[2:] if line.startswith("-")]
        added = [line for line in body[2:] if line.startswith("+")]
        assert len(removed) == 1 and "return LRUCache(" in removed[0], entry["file"]
        replacement = removed[0][1:].replace("return LRUCache(", "return _FixedLRUCache(")
        assert "+" + replacement in added
        assert "+class _FixedLRUCache(LRUCache):" in added


# --------------------------------------------------------------------------- applying


@pytest.mark.parametrize("version", VERSIONS)
def test_diff_applies_to_the_release(version: str, index: dict, tmp_path: Path) -> None:
    entry = _entry(index, version)
    diff = PATCHES / entry["file"]
    target = entry["target"]

    tree = _copy_release(version, target, tmp_path / "patch")
    base = ["patch", "-p1", "--batch", "--fuzz=0", "--no-backup-if-mismatch", "--forward"]
    base += ["-i", str(diff)]
    dry = _run([*base, "--dry-run"], tree)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert _sha256(tree / target) == entry["original_sha256"][version]
    real = _run(base, tree)
    assert real.returncode == 0, real.stdout + real.stderr
    assert "fuzz" not in real.stdout.lower()
    assert _sha256(tree / target) == entry["patched_sha256"][version]
    assert sorted(p.name for p in (tree / target).parent.iterdir()) == [Path(target).name]
    again = _run([*base, "--dry-run"], tree)
    assert again.returncode != 0 and "previously applied" in again.stdout
    back = _run([*base[:-3], "-R", "-i", str(diff)], tree)
    assert back.returncode == 0, back.stdout + back.stderr
    assert _sha256(tree / target) == entry["original_sha256"][version]

    gtree = _copy_release(version, target, tmp_path / "git")
    check = _run(["git", "apply", "--check", str(diff)], gtree)
    assert check.returncode == 0, check.stderr
    applied = _run(["git", "apply", str(diff)], gtree)
    assert applied.returncode == 0, applied.stderr
    assert _sha256(gtree / target) == entry["patched_sha256"][version]

    # The whole patched module still compiles (it cannot be imported without torch).
    compile((gtree / target).read_text(encoding="utf-8"), str(gtree / target), "exec")
    text = (realsrc.source_root(version) / target).read_text(encoding="utf-8")
    assert source_patch.apply_unified_diff(text, diff.read_text(encoding="utf-8")) == (
        gtree / target
    ).read_text(encoding="utf-8")


# --------------------------------------------------------------------------- behaviour

_CHILD = r'''
import ast, functools, json, logging, sys, threading, time, types
from pathlib import Path

from harness import realsrc
from harness.paths import REPO_ROOT

version, side, scenario, path = sys.argv[1:5]
LRUCache = realsrc.load_lru_module(version).LRUCache
text = Path(path).read_text(encoding="utf-8")
tree = ast.parse(text)

records = []

class Collect(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())

logger = logging.getLogger("vllm.multimodal.patched")
logger.addHandler(Collect())
logger.propagate = False


_out = threading.Lock()


_watched = threading.Semaphore(0)


def say(*parts):
    # One write per line: the scenario threads print concurrently.
    with _out:
        sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
        sys.stdout.flush()


def strip_annotations(node):
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sub.returns = None
            a = sub.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    arg.annotation = None
    return node


def factory_owner():
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "get_lru_cache":
                    return node.name, strip_annotations(item)
    raise LookupError("no get_lru_cache")


def stub_torch():
    torch = types.ModuleType("torch")
    class Tensor: pass
    torch.Tensor = Tensor
    return torch


ns = {
    "__name__": "patched_" + version.replace(".", "_"),
    "LRUCache": LRUCache,
    "logger": logger,
    # Sizing helpers of get_lru_cache: one unit per item, capacity in items.
    "GiB_bytes": 1,
    "sys": types.SimpleNamespace(getsizeof=lambda obj: 1),
    "torch": stub_torch(),
    "MultiModalKwargs": type("MultiModalKwargs", (), {}),
    "MultiModalKwargsItem": type("MultiModalKwargsItem", (), {}),
    "json_map_leaves": lambda fn, value: fn(value),
    "json_reduce_leaves": lambda fn, value: value,
}
added = [
    node for node in tree.body
    if (isinstance(node, ast.ClassDef) and node.name == "_FixedLRUCache")
    or (isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["_NO_VICTIM"])
]
if side == "patched":
    assert len(added) == 2, "patched file lacks the sentinel or the class"
else:
    assert not added, "original file already has the fix"
owner_name, factory = factory_owner()
owner = ast.parse(f"class {owner_name}:\n    pass\n").body[0]
owner.body = [factory]
module = ast.Module(body=[*added, owner], type_ignores=[])
exec(compile(ast.fix_missing_locations(module), path, "exec"), ns)
Owner = ns[owner_name]
Owner.get_item_size = classmethod(lambda cls, value, debug=False: 1)


def new_cache():
    cache = Owner.get_lru_cache(4, object)
    assert isinstance(cache, LRUCache) and cache.maxsize == 4
    if side == "patched":
        assert type(cache).__name__ == "_FixedLRUCache"
        assert type(cache).__mro__[1] is LRUCache
    else:
        assert type(cache) is LRUCache
    for i in range(4):
        cache[f"k{i}"] = i
    return cache


def order(cache):
    return cache._LRUCache__order


def data(cache):
    return cache._Cache__data


def plant(cache, key="ghost"):
    order(cache)[key] = None
    order(cache).move_to_end(key, last=False)


def fill_more(cache, n=8):
    for i in range(4, 4 + n):
        cache[f"k{i}"] = i


def watch(name, cache):
    """Report whether the cache stays frozen while another thread is inside a call."""
    def run():
        # Until the eviction meets the ghost (bounded: a loaded machine may be slow to get
        # there), then whether the cache stays as it is while the call goes on.
        def at_ghost():
            keys = list(order(cache))
            return bool(keys) and keys[0] not in data(cache)
        deadline = time.monotonic() + 20.0
        while not at_ghost() and time.monotonic() < deadline:
            time.sleep(0.01)
        first = (list(order(cache)), list(data(cache)), cache.currsize)
        time.sleep(0.7)
        second = (list(order(cache)), list(data(cache)), cache.currsize)
        frozen = first == second and bool(first[0]) and first[0][0] not in data(cache)
        say("STALLED" if frozen else "MOVING", name, json.dumps(first[:2]))
        _watched.release()
    threading.Thread(target=run, daemon=True).start()


def reached(name, cache, call):
    watch(name, cache)
    say("REACHED", name, time.monotonic())
    call()
    say("RETURNED", name)


def check_empty(cache):
    assert len(cache) == 0 and not data(cache) and not order(cache), (
        list(order(cache)), list(data(cache)))


if side == "unpatched":
    # Each scenario runs in its own thread; the process is killed from outside while they
    # are still inside the eviction call.
    threads = []
    for name in scenario.split(","):
        cache = new_cache()
        if name == "touch":
            cache.touch("ghost")
            if "ghost" not in order(cache):
                say("TOUCH_IGNORED", name)
                continue
            call = functools.partial(fill_more, cache)
        elif name == "planted":
            plant(cache)
            call = functools.partial(fill_more, cache)
        else:
            plant(cache)
            call = cache.clear
        thread = threading.Thread(target=reached, args=(name, cache, call), daemon=True)
        thread.start()
        threads.append(thread)
    for _ in threads:
        _watched.acquire()
    say("WATCHED")  # every watcher has looked; the parent may kill the process now
    for thread in threads:
        thread.join()
    say("ALL_RETURNED")
    sys.exit(0)

results = {}

# The release's trigger: touch() of a missing key, then eviction, then clear().
cache = new_cache()
cache.touch("ghost")
assert "ghost" not in order(cache)
fill_more(cache)
assert sorted(data(cache)) == ["k10", "k11", "k8", "k9"], list(data(cache))
cache.clear()
check_empty(cache)
results["touch"] = "done"

# A data-less key planted at the LRU end, insert until eviction, then clear().
cache = new_cache()
plant(cache)
fill_more(cache)
assert "ghost" not in order(cache) and len(cache) == 4
assert list(order(cache)) == ["k8", "k9", "k10", "k11"]
plant(cache, "ghost2")
cache.clear()
check_empty(cache)
results["planted"] = "done"

# clear() straight after planting.
cache = new_cache()
plant(cache)
cache.clear()
check_empty(cache)
results["planted-clear"] = "done"

# Data without an order entry is still evicted, oldest first.
cache = new_cache()
del order(cache)["k1"]
fill_more(cache)
assert "k11" in data(cache) and len(cache) == 4, list(data(cache))
cache.clear()
check_empty(cache)
results["orphan"] = "done"

# Everything pinned plus a ghost: vLLM's own error, not a stall.
cache = new_cache()
for i in range(4):
    cache.pin(f"k{i}")
plant(cache)
try:
    cache["k9"] = 9
except RuntimeError as exc:
    results["all-pinned"] = str(exc)
cache.clear()
check_empty(cache)

results["warnings"] = records
say("RESULT", json.dumps(results))
'''


def _watched_child(version: str, scenario: str, path: Path, bound: float) -> dict:
    """The unpatched scenarios: killed once every watcher has reported (``WATCHED``) and
    the calls have spun :data:`MIN_SPIN` more, or at ``bound`` seconds; never by a fixed
    timeout that a loaded machine could outrun."""
    cmd, env = realsrc.snippet_command(
        _CHILD, args=(version, "unpatched", scenario, str(path)), env={realsrc.OFFLINE_ENV: "1"}
    )
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    watched = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("WATCHED"):
                watched.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + bound
    while not watched.is_set() and proc.poll() is None and time.monotonic() < deadline:
        watched.wait(0.1)
    if watched.is_set():
        time.sleep(MIN_SPIN)
    timed_out = proc.poll() is None
    ended = time.monotonic()
    proc.kill()
    _, stderr = proc.communicate(timeout=30)
    reader.join(30)
    return {
        "timed_out": timed_out,
        "returncode": proc.returncode,
        "stdout": "".join(lines),
        "stderr": stderr,
        "ended": ended,
    }


def _child(version: str, side: str, scenario: str, path: Path, timeout: float) -> dict:
    if side == "unpatched":
        return _watched_child(version, scenario, path, timeout)
    start = time.monotonic()
    result = realsrc.run_snippet(
        _CHILD,
        timeout=timeout,
        args=(version, side, scenario, str(path)),
        env={realsrc.OFFLINE_ENV: "1"},
    )
    return {
        "timed_out": result.timed_out,
        "returncode": result.returncode,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "ended": start + result.seconds,
    }


UNPATCHED_SCENARIOS = ("touch", "planted", "planted-clear")


@pytest.fixture(scope="module")
def behaviour(index: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every release's scenarios: one patched and one unpatched subprocess per release.

    They run concurrently since the unpatched ones mostly wait for their timeout.
    """
    jobs: list[tuple[str, str, str, Path, float]] = []
    for version in VERSIONS:
        entry = _entry(index, version)
        tree = _copy_release(version, entry["target"], tmp_path_factory.mktemp(version))
        diff = PATCHES / entry["file"]
        proc = _run(["patch", "-p1", "--batch", "--fuzz=0", "-i", str(diff)], tree)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        original = realsrc.source_root(version) / entry["target"]
        jobs.append((version, "patched", "all", tree / entry["target"], DONE_TIMEOUT))
        scenarios = ",".join(UNPATCHED_SCENARIOS)
        jobs.append((version, "unpatched", scenarios, original, HANG_BOUND))
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {job[:2]: pool.submit(_child, *job) for job in jobs}
        return {key: future.result() for key, future in futures.items()}


def _lines(stdout: str, tag: str, name: str | None = None) -> list[list[str]]:
    found = []
    for line in stdout.splitlines():
        words = line.split(" ", 2)
        if words[0] == tag and (name is None or words[1:2] == [name]):
            found.append(words)
    return found


@pytest.mark.parametrize("version", VERSIONS)
def test_patched_cache_never_stalls(version: str, behaviour: dict) -> None:
    run = behaviour[(version, "patched")]
    assert not run["timed_out"], f"patched scenarios hung:\n{run['stdout']}\n{run['stderr']}"
    assert run["returncode"] == 0, run["stdout"] + run["stderr"]
    lines = [line for line in run["stdout"].splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, run["stdout"]
    results = json.loads(lines[0][len("RESULT ") :])
    for scenario in ("touch", "planted", "planted-clear", "orphan"):
        assert results[scenario] == "done"
    assert "pinned" in results["all-pinned"]
    # Many repairs happened; exactly one line reports them, in vLLM's logger.
    assert len(results["warnings"]) == 1, results["warnings"]
    assert results["warnings"][0].startswith("vllm-mmcache-fix: repaired a multimodal")


@pytest.mark.parametrize("version", VERSIONS)
def test_unpatched_release_stalls(version: str, behaviour: dict) -> None:
    run = behaviour[(version, "unpatched")]
    output = run["stdout"] + run["stderr"]
    assert run["timed_out"], f"every eviction returned:\n{output}"
    assert not _lines(run["stdout"], "RETURNED"), output
    for scenario in UNPATCHED_SCENARIOS:
        if scenario == "touch" and version not in TOUCH_GHOST_VERSIONS:
            # From 0.24 touch() ignores missing keys: no ghost, nothing to stall on.
            assert _lines(run["stdout"], "TOUCH_IGNORED", scenario), output
            continue
        assert not _lines(run["stdout"], "TOUCH_IGNORED", scenario), output
        reached = _lines(run["stdout"], "REACHED", scenario)
        assert len(reached) == 1, output
        assert run["ended"] - float(reached[0][2]) >= MIN_SPIN, output
        assert _lines(run["stdout"], "STALLED", scenario), output


# --------------------------------------------------------------------------- the applier


def _tree(tmp_path: Path, version: str, index: dict) -> tuple[Path, Path, dict]:
    entry = _entry(index, version)
    root = _copy_release(version, entry["target"], tmp_path / f"site-{version}")
    return root, root / entry["target"], entry


@pytest.mark.parametrize("tool", ["patch", "python"])
@pytest.mark.parametrize("version", ["0.10.0", "0.23.0", NEWEST])
def test_apply_check_revert_cycle(version: str, tool: str, index: dict, tmp_path: Path) -> None:
    root, target, entry = _tree(tmp_path, version, index)
    original = _sha256(target)

    check = source_patch.inspect_tree(root, patches_dir=PATCHES)
    assert check.exit_code == EXIT_NOT_APPLIED and check.state == "unpatched"
    assert check.patch_file == entry["file"] and check.release == version

    done = source_patch.apply(root, patches_dir=PATCHES, tool=tool)
    assert done.exit_code == EXIT_OK, done.message
    assert _sha256(target) == entry["patched_sha256"][version]
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]

    again = source_patch.apply(root, patches_dir=PATCHES, tool=tool)
    assert again.exit_code == EXIT_OK and "already applied" in again.message
    assert source_patch.inspect_tree(root, patches_dir=PATCHES).state == "applied"

    back = source_patch.revert(root, patches_dir=PATCHES, tool=tool)
    assert back.exit_code == EXIT_OK, back.message
    assert _sha256(target) == original
    noop = source_patch.revert(root, patches_dir=PATCHES, tool=tool)
    assert noop.exit_code == EXIT_OK and "nothing to revert" in noop.message


def test_refuses_modified_file(index: dict, tmp_path: Path) -> None:
    root, target, entry = _tree(tmp_path, "0.23.0", index)
    target.write_text(target.read_text() + "# local change\n")
    before = target.read_bytes()
    out = source_patch.apply(root, patches_dir=PATCHES)
    assert out.exit_code == EXIT_MISMATCH
    assert entry["original_sha256"]["0.23.0"] in out.message
    assert _sha256(target) in out.message
    assert target.read_bytes() == before


def test_refuses_file_patched_then_edited(index: dict, tmp_path: Path) -> None:
    root, target, _ = _tree(tmp_path, "0.23.0", index)
    assert source_patch.apply(root, patches_dir=PATCHES).exit_code == EXIT_OK
    target.write_text(target.read_text() + "\n")
    out = source_patch.apply(root, patches_dir=PATCHES)
    assert out.exit_code == EXIT_MISMATCH
    assert any("already contains vllm-mmcache-fix" in line for line in out.details)


def test_refuses_wrong_version_tree(index: dict, tmp_path: Path) -> None:
    # The newest release's file in a tree that claims 0.31.0 (same target path, another file).
    root, target, _ = _tree(tmp_path, NEWEST, index)
    out = source_patch.apply(root, patches_dir=PATCHES, version="0.31.0")
    assert out.exit_code == EXIT_MISMATCH
    assert _sha256(target) in out.message
    assert _entry(index, "0.31.0")["original_sha256"]["0.31.0"] in out.message
    assert _sha256(target) == _entry(index, NEWEST)["original_sha256"][NEWEST]
    # A 0.23.0 tree claiming 0.10.0: the 0.10.0 target file does not even exist there.
    root, _, _ = _tree(tmp_path, "0.23.0", index)
    out = source_patch.apply(root, patches_dir=PATCHES, version="0.10.0")
    assert out.exit_code == EXIT_MISMATCH and "does not exist" in out.message


def test_unknown_version_needs_a_known_file(index: dict, tmp_path: Path) -> None:
    root, target, entry = _tree(tmp_path, "0.23.0", index)
    dev = source_patch.apply(root, patches_dir=PATCHES, version="0.24.1.dev3+g1234abc")
    assert dev.exit_code == EXIT_OK, dev.message
    assert dev.details and "byte-identical" in dev.details[0]
    assert _sha256(target) in entry["patched_sha256"].values()
    target.write_text(target.read_text() + "# local change\n")
    out = source_patch.inspect_tree(root, patches_dir=PATCHES, version="0.99.0")
    assert out.exit_code == EXIT_UNSUPPORTED and "0.99.0" in out.message


def test_editable_style_version_is_accepted(index: dict, tmp_path: Path) -> None:
    root, target, entry = _tree(tmp_path, "0.23.0", index)
    version_file = root / "vllm" / "_version.py"
    version_file.write_text(version_file.read_text().replace("'0.23.0'", "'0.23.0+empty'"))
    out = source_patch.apply(root, patches_dir=PATCHES)
    assert out.exit_code == EXIT_OK and out.release == "0.23.0", out.message
    assert not out.details  # matched by version, not by hash


def test_dist_info_version_and_missing_tree(index: dict, tmp_path: Path) -> None:
    root, _, _ = _tree(tmp_path, "0.11.1", index)
    (root / "vllm" / "_version.py").unlink()
    meta = root / "vllm-0.11.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.11.1\n")
    assert source_patch.inspect_tree(root, patches_dir=PATCHES).exit_code == EXIT_NOT_APPLIED
    empty = tmp_path / "empty"
    empty.mkdir()
    assert source_patch.inspect_tree(empty, patches_dir=PATCHES).exit_code == EXIT_NO_VLLM


def test_cli_finds_vllm_without_importing_it(index: dict, tmp_path: Path) -> None:
    root, target, entry = _tree(tmp_path, "0.29.0", index)
    # MMCACHE_FIX_MODE=off: a checkout's build metadata may name the plugin's entry point,
    # and `patch check` would then say "not needed" for this Python's vLLM.
    env = dict(os.environ, PYTHONPATH=str(root), PYTHON=sys.executable, MMCACHE_FIX_MODE="off")
    env.pop(source_patch.PATCHES_ENV, None)
    script = [str(PROJECT / "scripts" / "apply-patch")]
    check = subprocess.run(
        [*script, "check", "--json"], env=env, capture_output=True, text=True, check=False
    )
    assert check.returncode == EXIT_NOT_APPLIED, check.stdout + check.stderr
    report = json.loads(check.stdout)
    assert report["root"] == str(root.resolve()) and report["version"] == "0.29.0"
    applied = subprocess.run(
        [*script, "apply"], env=env, capture_output=True, text=True, check=False
    )
    assert applied.returncode == EXIT_OK, applied.stdout + applied.stderr
    assert applied.stdout.startswith("vllm-mmcache-fix: vLLM 0.29.0: applied")
    assert _sha256(target) == entry["patched_sha256"]["0.29.0"]
    reverted = subprocess.run(
        [*script, "revert"], env=env, capture_output=True, text=True, check=False
    )
    assert reverted.returncode == EXIT_OK, reverted.stderr
    assert _sha256(target) == entry["original_sha256"]["0.29.0"]
