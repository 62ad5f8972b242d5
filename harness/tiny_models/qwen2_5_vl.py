"""A tiny, weightless Qwen2.5-VL model directory, built offline and reproducibly.

Same tokenizer, special tokens and chat template as :mod:`harness.tiny_models.qwen2_vl`;
the config names ``Qwen2_5_VLForConditionalGeneration`` with a Qwen2.5-VL vision tower
(windowed attention, SiLU MLP, ``out_hidden_size``) and the processor files name the
Qwen2.5-VL processor. One 112 x 112 image is 16 tokens; a video of 4 such frames is
2 x 16 = 32 tokens (2 frames per temporal patch). Serve it with ``--load-format dummy``.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from harness.paths import cache_root
from harness.tiny_models import qwen2_vl as base

NAME = "qwen2.5-vl"
DIR_NAME = "tiny-qwen2.5-vl"
ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
WORDS = base.WORDS
SPECIAL_TOKENS = base.SPECIAL_TOKENS
PATCH = base.PATCH
MERGE = base.MERGE


def default_out() -> Path:
    return cache_root() / "models" / DIR_NAME


def model_config(ids: dict[str, int]) -> dict[str, object]:
    cfg = base.model_config(ids)
    cfg["architectures"] = [ARCHITECTURE]
    cfg["model_type"] = "qwen2_5_vl"
    text = dict(cast("dict[str, object]", cfg["text_config"]))
    text["model_type"] = "qwen2_5_vl_text"
    cfg["text_config"] = text
    cfg["vision_config"] = {
        "model_type": "qwen2_5_vl",
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "num_heads": 2,
        "in_channels": 3,
        "in_chans": 3,
        "patch_size": PATCH,
        "spatial_patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
        "out_hidden_size": base.TEXT_HIDDEN,
    }
    return cfg


def processor_configs() -> dict[str, dict[str, object]]:
    files = base.processor_configs()
    for data in files.values():
        data["processor_class"] = "Qwen2_5_VLProcessor"
    return files


def is_complete(out: Path) -> bool:
    return base.is_complete(out)


def check(out: Path) -> dict[str, object]:
    return base.check(out)


def build(out: Path | None = None, *, force: bool = False) -> Path:
    out = Path(out) if out is not None else default_out()
    return base.build_dir(out, model_config, processor_configs, force=force)
