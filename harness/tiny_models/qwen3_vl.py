"""A tiny, weightless Qwen3-VL model directory, built offline and reproducibly.

Same tokenizer, special tokens and chat template as :mod:`harness.tiny_models.qwen2_vl`
(Qwen3-VL keeps Qwen2-VL's vision tokens). The config names
``Qwen3VLForConditionalGeneration`` with a ``qwen3_vl_text`` text config (interleaved
M-RoPE) and a Qwen3-VL vision tower (16-pixel patches, learned position embeddings,
deepstack layers). Its processor writes a timestamp (``<0.5 seconds>``) before every
temporal patch of a video. One 112 x 112 image becomes 128 x 128: 16 tokens; a video of 4
such frames is 2 x 16 tokens plus the timestamps. vLLM serves Qwen3-VL from 0.11 on.
Serve it with ``--load-format dummy``.
"""

from __future__ import annotations

from pathlib import Path

from harness.paths import cache_root
from harness.tiny_models import qwen2_vl as base

NAME = "qwen3-vl"
DIR_NAME = "tiny-qwen3-vl"
ARCHITECTURE = "Qwen3VLForConditionalGeneration"
WORDS = base.WORDS
SPECIAL_TOKENS = base.SPECIAL_TOKENS
PATCH = 16
MERGE = 2
TOKEN_SIDE = PATCH * MERGE  # 32 pixels per token side
MIN_PIXELS = 4 * TOKEN_SIDE**2  # 4096: 4 tokens
MAX_PIXELS = 16 * TOKEN_SIDE**2  # 16384: 16 tokens
MAX_FRAMES = 8
ROPE_THETA = 5000000.0
MROPE_SECTION = [4, 6, 6]  # sums to head_dim // 2 = 16


def default_out() -> Path:
    return cache_root() / "models" / DIR_NAME


def model_config(ids: dict[str, int]) -> dict[str, object]:
    rope = {
        "rope_type": "default",
        "mrope_section": MROPE_SECTION,
        "mrope_interleaved": True,
    }
    text = {
        "model_type": "qwen3_vl_text",
        "vocab_size": base.VOCAB_SIZE,
        "hidden_size": base.TEXT_HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": base.TEXT_HEADS,
        "num_key_value_heads": base.TEXT_KV_HEADS,
        "head_dim": base.HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rope_scaling": dict(rope),
        "rope_parameters": {**rope, "rope_theta": ROPE_THETA},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    vision = {
        "model_type": "qwen3_vl",
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "hidden_act": "gelu_pytorch_tanh",
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "out_hidden_size": base.TEXT_HIDDEN,
        "num_position_embeddings": 256,  # a 16 x 16 grid, interpolated
        "deepstack_visual_indexes": [0],
        "initializer_range": 0.02,
    }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_vl",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": True,
        "transformers_version": "4.57.0",
    }


def processor_configs() -> dict[str, dict[str, object]]:
    common = base.processor_common([0.5, 0.5, 0.5], [0.5, 0.5, 0.5], PATCH, MERGE)
    common["processor_class"] = "Qwen3VLProcessor"
    image = {
        **common,
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }
    video = {
        **common,
        "video_processor_type": "Qwen3VLVideoProcessor",
        # For video the bounds are on frames x height x width.
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_FRAMES * MAX_PIXELS},
        "fps": 2,
        "min_frames": 2,
        "max_frames": MAX_FRAMES,
        "do_sample_frames": True,
    }
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video}


def is_complete(out: Path) -> bool:
    return base.is_complete(out)


def check(out: Path) -> dict[str, object]:
    return base.check_image(out, MERGE)[0]


def build(out: Path | None = None, *, force: bool = False) -> Path:
    out = Path(out) if out is not None else default_out()
    return base.build_dir(out, model_config, processor_configs, force=force)
