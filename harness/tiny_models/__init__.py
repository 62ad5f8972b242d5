"""Tiny, weightless models built locally, one module per model, chosen by name.

Each model module (``qwen2_vl`` for ``"qwen2-vl"``) provides ``default_out()``,
``build(out, force=...)``, ``is_complete(out)``, ``check(out)`` and ``WORDS`` (the
words its tokenizer was trained on, from which prompts are made). Add a model by
adding a sibling module and a line to ``MODELS``.

Usage (with a Python that has ``tokenizers``, e.g. a vLLM venv)::

    scripts/build-tiny-model [OUT] [--model qwen2-vl] [--force] [--check]
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from harness.paths import REPO_ROOT

DEFAULT = "qwen2-vl"
MODELS: dict[str, tuple[int, ...]] = {
    "qwen2-vl": (0,),
    "qwen2.5-vl": (0,),
    "qwen3-vl": (0, 11),  # Qwen3-VL came with vLLM 0.11
    "qwen3-vl-moe": (0, 11),
}
"""The known models, each with the oldest vLLM release that serves it. A model's module is
its name with ``_`` for ``-`` and ``.`` (``qwen2.5-vl``: ``qwen2_5_vl``)."""
# Models whose tiny directory serves video requests too (``video_url`` items).
VIDEO_MODELS: frozenset[str] = frozenset(MODELS)


def names() -> list[str]:
    """The known model names, the default first."""
    return [DEFAULT] + sorted(n for n in MODELS if n != DEFAULT)


def supports_video(name: str) -> bool:
    return name in VIDEO_MODELS


def supports_version(name: str, vllm_version: str) -> bool:
    """Whether vLLM ``vllm_version`` (e.g. ``"0.23.0"``) serves model ``name``."""
    model_module(name)
    parts = []
    for piece in vllm_version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= MODELS[name]


def model_module(name: str = DEFAULT) -> ModuleType:
    if name not in MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {sorted(MODELS)}")
    return importlib.import_module(f"{__name__}.{name.replace('-', '_').replace('.', '_')}")


def default_out(name: str = DEFAULT) -> Path:
    return model_module(name).default_out()


def is_complete(out: Path, name: str = DEFAULT) -> bool:
    return bool(model_module(name).is_complete(Path(out)))


def build(name: str = DEFAULT, out: Path | None = None, *, force: bool = False) -> Path:
    """Build model ``name`` in this interpreter (it needs ``tokenizers``)."""
    return model_module(name).build(out, force=force)


def ensure_model(venv: Path, name: str = DEFAULT, out: Path | None = None) -> Path:
    """The model's directory, built first with the venv's Python when it is not complete."""
    out = Path(out) if out is not None else default_out(name)
    if is_complete(out, name):
        return out
    python = Path(venv) / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "harness.tiny_models", "--model", name, str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=str(REPO_ROOT),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build a tiny, weightless model directory.")
    ap.add_argument("out", nargs="?", type=Path, default=None)
    ap.add_argument("--model", default=DEFAULT, choices=sorted(MODELS))
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--check", action="store_true", help="load it with transformers")
    args = ap.parse_args(argv)
    out = build(args.model, args.out, force=args.force)
    print(out)
    if args.check:
        json.dump(model_module(args.model).check(out), sys.stdout, indent=2)
        print()
    return 0
