"""The unit tier under several Python versions, each in its own small venv.

Usage::

    scripts/unit-pythons                          # 3.9 3.10 3.11 3.12 3.13
    scripts/unit-pythons --versions 3.12 -- -k lock   # pytest arguments after --
    scripts/unit-pythons --skip 3.11              # all but one
    scripts/unit-pythons --realsrc --versions 3.9 3.13   # the realsrc subset instead

Interpreters come from pyenv (``$(pyenv root)/versions/X.Y.Z``, the newest patch
release), else from ``pythonX.Y`` on ``PATH``; a missing one is installed with
``pyenv install`` when pyenv is there, or the run fails saying which is missing.
Each venv is ``<cache>/venvs/unit-pyX.Y-<hash of the requirements>`` and is reused while
its marker file matches the requirements. 3.9 is in because the package declares
``requires-python >= 3.9``.
``--optional`` versions are run and reported, but their failure does not fail the run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.installer import install_command
from harness.paths import REPO_ROOT, cache_root

REQUIRED = ("3.9", "3.10", "3.11", "3.12", "3.13")
OPTIONAL: tuple[str, ...] = ()
REQUIREMENTS = ("pytest>=8", "hypothesis", "cachetools", "py-spy", "prometheus_client")
"""What the unit tier and the realsrc subset need (prometheus_client: the metrics and
``status`` tests, which vLLM's own dependency makes real; hypothesis: the property tests)."""

REALSRC_FILES = (
    "tests/realsrc/test_fix_on_releases.py",
    "tests/realsrc/test_races.py",
    "tests/realsrc/test_plugin.py",
    "tests/realsrc/test_fail_open.py",
    "tests/realsrc/test_vllm_layout_on_releases.py",
    "tests/realsrc/test_upgrade_in_place.py",
)
"""``--realsrc``: the eviction fix on the releases' own ``LRUCache`` (fixed and unfixed,
under contention), the plugin patching released modules, the drift guard failing open,
the layout table on the releases: the fix itself under each Python, not only its logic."""

LAYOUT_RELEASES = ("0.10.0", "0.10.2", "0.11.0", "0.13.0", "0.23.0", "0.24.0", "0.33.0")
"""One release per layout of ``vllm_mmcache_fix/vllm_layout.py`` (the realsrc subset's
releases; the main lane runs every release): 0.10.0 the static factory in
``processing``; 0.10.2 the first sender cache, ``LRUCache`` in ``vllm/utils/__init__.py``;
0.11.0 the same file, where the drift guard once did not engage; 0.13.0 ``vllm/utils/cache.py``
with the old ``Processor`` and processor module; 0.23.0 their new homes and the last ``touch``
that adds ghost keys; 0.24.0 the ``touch`` that does not; 0.33.0 the 0.31+ factory and sender
cache. ``tests/unit/test_unit_pythons.py`` checks that every layout row has one."""


OLD_PYTHON_RELEASES = ("0.10.0", "0.10.2", "0.11.0")
"""Under Python 3.9: the layouts of the releases whose own code runs there. From 0.11.1 on,
``vllm/utils/cache.py`` builds ``X | None`` when its class is created (Python 3.10+), so no
newer release can run on 3.9, with the plugin or without."""
OLD_PYTHON_FILES = (
    "tests/realsrc/test_fix_on_releases.py",
    "tests/realsrc/test_vllm_layout_on_releases.py",
    "tests/realsrc/test_upgrade_in_place.py",
)
"""The subset files whose cases are all per release (the others pin 0.23.0 or newer)."""


def realsrc_subset(python: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(files, releases)`` of the realsrc subset under Python ``python`` (``X.Y``)."""
    if tuple(int(p) for p in python.split(".")[:2]) < (3, 10):
        return OLD_PYTHON_FILES, OLD_PYTHON_RELEASES
    return REALSRC_FILES, LAYOUT_RELEASES


def realsrc_deselect(releases: tuple[str, ...]) -> str:
    """A ``-k`` expression leaving out every other release's parametrized cases (tests
    without a release in their id still run)."""
    from harness import sources

    others = [v for v in sources.VLLM_VERSIONS if v not in releases]
    return "not (" + " or ".join(others) + ")"


MARKER_NAME = ".mmcache-fix-unit-venv.json"


class PythonMissing(RuntimeError):
    """No interpreter of a version could be found or installed."""


def _log(line: str) -> None:
    print(f"[unit-pythons] {line}", file=sys.stderr, flush=True)


def pyenv_root() -> Path | None:
    exe = shutil.which("pyenv")
    if exe is not None:
        done = subprocess.run([exe, "root"], capture_output=True, text=True, check=False)
        if done.returncode == 0 and done.stdout.strip():
            return Path(done.stdout.strip())
    env = os.environ.get("PYENV_ROOT")
    if env:
        return Path(env)
    default = Path.home() / ".pyenv"
    return default if default.is_dir() else None


def _patch_key(name: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", name))


def find_python(version: str) -> Path | None:
    """The newest pyenv build of ``version`` (``X.Y``), else ``pythonX.Y`` on PATH."""
    root = pyenv_root()
    if root is not None and (root / "versions").is_dir():
        found = [
            d
            for d in (root / "versions").iterdir()
            if re.fullmatch(re.escape(version) + r"\.\d+", d.name)
            and (d / "bin" / "python").exists()
        ]
        if found:
            return max(found, key=lambda d: _patch_key(d.name)) / "bin" / "python"
    on_path = shutil.which(f"python{version}")
    return Path(on_path) if on_path else None


def ensure_python(version: str) -> Path:
    python = find_python(version)
    if python is not None:
        return python
    exe = shutil.which("pyenv")
    if exe is None:
        raise PythonMissing(
            f"Python {version} not found (no pyenv build, no python{version} on PATH) "
            "and pyenv is not installed to build it"
        )
    _log(f"Python {version} not found: pyenv install --skip-existing {version}")
    done = subprocess.run([exe, "install", "--skip-existing", version], check=False)
    python = find_python(version)
    if done.returncode != 0 or python is None:
        raise PythonMissing(
            f"Python {version} not found and `pyenv install {version}` failed "
            f"(exit {done.returncode}); install it by hand or drop it from --versions"
        )
    return python


def venv_for(version: str, python: Path) -> Path:
    """``<cache>/venvs/unit-pyX.Y-<hash>`` with the unit tier's requirements (built if need be)."""
    # The requirements' hash in the name: a checkout with other requirements builds its own
    # venv beside this one instead of rebuilding one another checkout is using.
    tag = hashlib.sha256("\n".join(REQUIREMENTS).encode()).hexdigest()[:8]
    venv = cache_root() / "venvs" / f"unit-py{version}-{tag}"
    marker = venv / MARKER_NAME
    want = {"python": str(python), "requirements": list(REQUIREMENTS)}
    try:
        if json.loads(marker.read_text()) == want and (venv / "bin" / "python").exists():
            return venv
    except (OSError, ValueError):
        pass
    if venv.exists():
        shutil.rmtree(venv)
    _log(f"creating {venv} with {python}")
    subprocess.run([str(python), "-m", "venv", str(venv)], check=True)
    argv, env = install_command(venv / "bin" / "python", "--quiet", *REQUIREMENTS)
    subprocess.run(argv, env=env, check=True)
    marker.write_text(json.dumps(want) + "\n")
    return venv


def run_unit(
    version: str, pytest_args: list[str], *, realsrc: bool = False, outcomes: Path | None = None
) -> tuple[int, str, float]:
    """``(exit status, pytest's closing line, seconds)`` of the unit tier under ``version``
    (``realsrc``: the realsrc subset instead); ``outcomes``: where its outcomes go."""
    venv = venv_for(version, ensure_python(version))
    start = time.monotonic()
    files, releases = realsrc_subset(version)
    paths = [*files, "-k", realsrc_deselect(releases)] if realsrc else ["tests/unit"]
    if realsrc and "-k" in pytest_args[:-1]:  # both selections: the releases' and the caller's
        at = pytest_args.index("-k")
        paths[-1] = f"({paths[-1]}) and ({pytest_args[at + 1]})"
        pytest_args = pytest_args[:at] + pytest_args[at + 2 :]
    env = dict(os.environ)
    if outcomes is not None:
        env["MMCACHE_HARNESS_OUTCOMES"] = str(outcomes)
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider"]
        + pytest_args,
        cwd=str(REPO_ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    last = ""
    for line in proc.stdout:
        sys.stdout.write(line)
        if line.strip():
            last = line.strip()
    proc.wait()
    return proc.returncode, last, time.monotonic() - start


def skip_check(outcomes: Path, version: str, realsrc: bool, partial: bool) -> int:
    """The skip accounting of one Python's run (:mod:`harness.skips`), lane ``pyX.Y``."""
    from harness import skips

    try:
        doc = json.loads(outcomes.read_text())
    except (OSError, ValueError):
        print(f"skip accounting, py{version}: no outcomes (the run did not finish)")
        return 0 if partial else 1
    verdict = skips.check(
        doc,
        ["realsrc" if realsrc else "unit"],
        f"py{version}",
        skips.load_expected(),
        modules=list(realsrc_subset(version)[0]) if realsrc else None,
    )
    print("\n".join(skips.compact(verdict.lines) if partial else verdict.lines), flush=True)
    return 0 if verdict.ok or partial else 1


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, pytest_args = args[:cut], args[cut + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", default=list(REQUIRED), metavar="X.Y")
    ap.add_argument("--optional", nargs="*", default=list(OPTIONAL), metavar="X.Y")
    ap.add_argument(
        "--skip", nargs="*", default=[], metavar="X.Y", help="versions tested elsewhere"
    )
    ap.add_argument(
        "--realsrc",
        action="store_true",
        help="the realsrc subset (one release per layout) instead of the unit tier",
    )
    ap.add_argument(
        "--skip-check",
        action="store_true",
        help="fail when a test was skipped or deselected without an entry in "
        "tests/expected-skips.toml (harness/skips.py; lane pyX.Y)",
    )
    ap.add_argument("--partial", action="store_true", help="skip check: report only")
    opts = ap.parse_args(args)
    opts.versions = [v for v in opts.versions if v not in opts.skip]
    opts.optional = [v for v in opts.optional if v not in opts.skip]

    rows: list[tuple[str, str, str]] = []
    failed: list[str] = []
    for version in [*opts.versions, *[v for v in opts.optional if v not in opts.versions]]:
        optional = version not in opts.versions
        what = "realsrc subset" if opts.realsrc else "unit tier"
        print(f"\n-- {what} on Python {version}{' (optional)' if optional else ''}", flush=True)
        outcomes = None
        if opts.skip_check:
            fd, name = tempfile.mkstemp(prefix=f"outcomes-py{version}-", suffix=".json")
            os.close(fd)
            outcomes = Path(name)
        try:
            rc, last, seconds = run_unit(
                version, pytest_args, realsrc=opts.realsrc, outcomes=outcomes
            )
        except (PythonMissing, subprocess.CalledProcessError) as exc:
            rc, last, seconds = 1, f"not run: {exc}", 0.0
        if outcomes is not None:
            if seconds and skip_check(outcomes, version, opts.realsrc, opts.partial) and rc == 0:
                rc, last = 1, f"{last}; a required test did not run"
            outcomes.unlink(missing_ok=True)
        state = "ok" if rc == 0 else ("FAILED (optional)" if optional else "FAILED")
        rows.append((version, state, f"{last} ({seconds:.0f} s)" if seconds else last))
        if rc != 0 and not optional:
            failed.append(version)
    print(f"\n{'realsrc subset' if opts.realsrc else 'unit tier'} per Python:")
    for version, state, detail in rows:
        print(f"  {version:<6} {state:<18} {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
