"""A tiny, weightless Qwen2-VL model directory, built offline and reproducibly.

Built through :mod:`harness.tiny_models` (``scripts/build-tiny-model``), with a Python
that has ``tokenizers`` (a vLLM venv). The directory, by default
``<cache>/models/tiny-qwen2-vl``, holds a config, a byte-level BPE tokenizer trained
here on a small fixed corpus, a chat template and an image processor config sized so
that one image becomes 4 to 16 tokens. There are no weights: serve it with ``--load-format dummy``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.paths import cache_root

MARKER_NAME = ".mmcache-fix-model.json"
MARKER_SCHEMA = 1

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Words of the training corpus; the e2e harness builds its long prompts from them.
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu "
    "red green blue cyan magenta yellow black white image picture photo describe what "
    "is in this the a an of and to with on for please tell me about short long text "
    "system user assistant hello world one two three four five six seven eight nine ten"
).split()

# Qwen2's pre-tokenization pattern (letters, numbers, punctuation, whitespace runs).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] in ['image', 'image_url'] or 'image' in item -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] in ['video', 'video_url'] or 'video' in item -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}"
    "{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

PATCH = 14
MERGE = 2
MIN_TOKENS = 4
MAX_TOKENS = 16
MIN_PIXELS = MIN_TOKENS * (PATCH * MERGE) ** 2  # 3136
MAX_PIXELS = MAX_TOKENS * (PATCH * MERGE) ** 2  # 12544
VOCAB_SIZE = 512  # model embedding rows (>= tokenizer size)

TEXT_HIDDEN = 128
TEXT_HEADS = 4
TEXT_KV_HEADS = 2
HEAD_DIM = TEXT_HIDDEN // TEXT_HEADS  # 32
MROPE_SECTION = [4, 6, 6]  # sums to HEAD_DIM // 2


NAME = "qwen2-vl"
DIR_NAME = "tiny-qwen2-vl"


def default_out() -> Path:
    return cache_root() / "models" / DIR_NAME


def _corpus() -> list[str]:
    lines = []
    n = len(WORDS)
    for i in range(40):
        lines.append(" ".join(WORDS[(i * 7 + j) % n] for j in range(12)))
    lines.append(" ".join(WORDS))
    lines.append("Describe the image. What is in this picture? Hello, world! 0123456789")
    return lines


def build_tokenizer(out: Path, chat_template: str = CHAT_TEMPLATE) -> dict[str, int]:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=448,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer too large: {tok.get_vocab_size()}")
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if any(v is None for v in ids.values()):
        raise RuntimeError(f"special tokens missing: {ids}")
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 32768,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        "chat_template": chat_template,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out / "special_tokens_map.json",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    return {t: int(i) for t, i in ids.items()}


def model_config(ids: dict[str, int]) -> dict[str, object]:
    rope = {"type": "mrope", "rope_type": "default", "mrope_section": MROPE_SECTION}
    text = {
        "model_type": "qwen2_vl_text",
        # transformers 4.57's Qwen2VLConfig reads every attribute its text config has from
        # the text config, "architectures" included: without it there, vLLM 0.13-0.19 find
        # no architecture and serve the model as a pooling model.
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": TEXT_HEADS,
        "num_key_value_heads": TEXT_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": dict(rope),
        "rope_parameters": {**rope, "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    vision = {
        "model_type": "qwen2_vl",
        "depth": 2,
        "embed_dim": 64,
        "hidden_size": TEXT_HIDDEN,
        "hidden_act": "quick_gelu",
        "mlp_ratio": 2,
        "num_heads": 2,
        "in_channels": 3,
        "in_chans": 3,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "spatial_patch_size": PATCH,
        "temporal_patch_size": 2,
    }
    top: dict[str, object] = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|image_pad|>"],
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": True,
        "transformers_version": "4.57.0",
    }
    # Older readers look for the text fields at the top level.
    for key, value in text.items():
        if key != "model_type":
            top.setdefault(key, value)
    # transformers rewrites the text config's legacy "type": "mrope" to "default"; the top
    # level copy is read as it is, and vLLM 0.11 (transformers 4.56) rejects a "type"
    # that conflicts with "rope_type". The copy carries the modern field only.
    top["rope_scaling"] = {k: v for k, v in rope.items() if k != "type"}
    return top


def processor_common(
    mean: list[float], std: list[float], patch: int, merge: int
) -> dict[str, object]:
    """The fields the image and video processor configs of a tiny Qwen-VL share."""
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": mean,
        "image_std": std,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "patch_size": patch,
        "merge_size": merge,
        "temporal_patch_size": 2,
    }


def processor_configs() -> dict[str, dict[str, object]]:
    common = processor_common(
        [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711], PATCH, MERGE
    )
    common["min_pixels"] = MIN_PIXELS
    common["max_pixels"] = MAX_PIXELS
    common["size"] = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    image = {
        **common,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }
    video = {
        **common,
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": "Qwen2VLProcessor",
    }
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video}


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.iterdir()):
        if p.name == MARKER_NAME or not p.is_file():
            continue
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def is_complete(out: Path) -> bool:
    try:
        data = json.loads((out / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(data, dict)
        and data.get("schema") == MARKER_SCHEMA
        and data.get("sha256") == _digest(out)
    )


def check_image(out: Path, merge: int) -> tuple[dict[str, object], Any]:
    """Load the directory with transformers and measure the image token count (``merge``:
    the model's merge size); also the tokenizer."""
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    cfg = AutoConfig.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ip = AutoImageProcessor.from_pretrained(out)
    img = Image.new("RGB", (112, 112), (10, 200, 30))
    grid = [int(x) for x in ip(images=[img], return_tensors="np")["image_grid_thw"][0]]
    return {
        "config": type(cfg).__name__,
        "tokenizer": type(tok).__name__,
        "image_processor": type(ip).__name__,
        "vocab": len(tok),
        "image_grid_thw": grid,
        "image_tokens": grid[0] * grid[1] * grid[2] // (merge * merge),
    }, tok


def check(out: Path) -> dict[str, object]:
    """:func:`check_image`, and the token ids of a chat prompt."""
    result, tok = check_image(out, MERGE)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hello world"}], tokenize=False, add_generation_prompt=True
    )
    return {**result, "prompt": prompt, "prompt_ids": tok(prompt)["input_ids"]}


def build(out: Path | None = None, *, force: bool = False) -> Path:
    out = Path(out) if out is not None else default_out()
    return build_dir(out, model_config, processor_configs, force=force)


def build_dir(
    out: Path,
    config_of: Callable[[dict[str, int]], dict[str, object]],
    processors: Callable[[], dict[str, dict[str, object]]],
    *,
    chat_template: str = CHAT_TEMPLATE,
    force: bool = False,
) -> Path:
    """Write a model directory: this tokenizer, ``config_of(special ids)``, ``processors()``.

    The sibling model modules (Qwen2.5-VL, Qwen3-VL) share the tokenizer and the chat
    template and differ in their config and processor files.
    """
    if not force and is_complete(out):
        return out
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    ids = build_tokenizer(tmp, chat_template)
    (tmp / "chat_template.jinja").write_text(chat_template + "\n")
    _write_json(tmp / "config.json", config_of(ids))
    for name, data in processors().items():
        _write_json(tmp / name, data)
    _write_json(
        tmp / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"]],
            "pad_token_id": ids["<|endoftext|>"],
            "do_sample": False,
        },
    )
    _write_json(tmp / MARKER_NAME, {"schema": MARKER_SCHEMA, "sha256": _digest(tmp)})
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
