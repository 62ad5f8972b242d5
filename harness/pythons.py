"""The unit tier under several Python versions, each in its own small venv.

Usage::

    scripts/unit-pythons                          # 3.9 3.10 3.11 3.12 3.13
    scripts/unit-pythons --versions 3.12 -- -k lock   # pytest arguments after --
    scripts/unit-pythons --skip 3.11              # all but one

Interpreters come from pyenv (``$(pyenv root)/versions/X.Y.Z``, the newest patch
release), else from ``pythonX.Y`` on ``PATH``; a missing one is installed with
``pyenv install`` when pyenv is there, or the run fails saying which is missing.
Each venv is ``<cache>/venvs/unit-pyX.Y`` and is reused while its marker file matches
the requirements. 3.9 is in because the package declares ``requires-python >= 3.9``.
``--optional`` versions are run and reported, but their failure does not fail the run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness.installer import install_command
from harness.paths import REPO_ROOT, cache_root

REQUIRED = ("3.9", "3.10", "3.11", "3.12", "3.13")
OPTIONAL: tuple[str, ...] = ()
REQUIREMENTS = ("pytest>=8", "cachetools", "py-spy")
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
    """``<cache>/venvs/unit-pyX.Y`` with the unit tier's requirements, (re)built if needed."""
    venv = cache_root() / "venvs" / f"unit-py{version}"
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


def run_unit(version: str, pytest_args: list[str]) -> tuple[int, str, float]:
    """``(exit status, pytest's closing line, seconds)`` of the unit tier under ``version``."""
    venv = venv_for(version, ensure_python(version))
    start = time.monotonic()
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "pytest", "tests/unit", "-q", "-p", "no:cacheprovider"]
        + pytest_args,
        cwd=str(REPO_ROOT),
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
    opts = ap.parse_args(args)
    opts.versions = [v for v in opts.versions if v not in opts.skip]
    opts.optional = [v for v in opts.optional if v not in opts.skip]

    rows: list[tuple[str, str, str]] = []
    failed: list[str] = []
    for version in [*opts.versions, *[v for v in opts.optional if v not in opts.versions]]:
        optional = version not in opts.versions
        print(f"\n-- unit tier on Python {version}{' (optional)' if optional else ''}", flush=True)
        try:
            rc, last, seconds = run_unit(version, pytest_args)
        except (PythonMissing, subprocess.CalledProcessError) as exc:
            rc, last, seconds = 1, f"not run: {exc}", 0.0
        state = "ok" if rc == 0 else ("FAILED (optional)" if optional else "FAILED")
        rows.append((version, state, f"{last} ({seconds:.0f} s)" if seconds else last))
        if rc != 0 and not optional:
            failed.append(version)
    print("\nunit tier per Python:")
    for version, state, detail in rows:
        print(f"  {version:<6} {state:<18} {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
