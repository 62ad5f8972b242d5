"""A tiny, weightless Qwen3-VL-MoE model directory, built offline and reproducibly.

:mod:`harness.tiny_models.qwen3_vl` with a sparse text model: every decoder layer a
mixture of 4 experts, 2 routed per token (``Qwen3VLMoeForConditionalGeneration``). It
exists for what only a MoE model does in vLLM: with ``--data-parallel-size`` above 1 the
engines of a MoE model run in step (``DPEngineCoreProc``: every rank takes part in every
forward, an idle one with a dummy batch, and they agree in an all-reduce whether any has
work left), where the ranks of a dense model run on their own. Same tokenizer, processor
and vision tower as Qwen3-VL. Serve it with ``--load-format dummy``.
"""

from __future__ import annotations

from pathlib import Path

from harness.paths import cache_root
from harness.tiny_models import qwen2_vl as base
from harness.tiny_models import qwen3_vl as dense

NAME = "qwen3-vl-moe"
DIR_NAME = "tiny-qwen3-vl-moe"
ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"
WORDS = dense.WORDS
SPECIAL_TOKENS = dense.SPECIAL_TOKENS
EXPERTS = 4
EXPERTS_PER_TOKEN = 2


def default_out() -> Path:
    return cache_root() / "models" / DIR_NAME


def model_config(ids: dict[str, int]) -> dict[str, object]:
    config = dense.model_config(ids)
    text = dict(config["text_config"])  # type: ignore[call-overload]
    text.update(
        model_type="qwen3_vl_moe_text",
        num_experts=EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN,
        moe_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    vision = dict(config["vision_config"])  # type: ignore[call-overload]
    vision["model_type"] = "qwen3_vl_moe"
    return {
        **config,
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_vl_moe",
        "text_config": text,
        "vision_config": vision,
    }


def processor_configs() -> dict[str, dict[str, object]]:
    return dense.processor_configs()


def is_complete(out: Path) -> bool:
    return base.is_complete(out)


def check(out: Path) -> dict[str, object]:
    return base.check_image(out, dense.MERGE)[0]


def build(out: Path | None = None, *, force: bool = False) -> Path:
    out = Path(out) if out is not None else default_out()
    return base.build_dir(out, model_config, processor_configs, force=force)
