"""The tiny Qwen-VL models, built and read by each installed vLLM venv's transformers.

For every model of :mod:`harness.tiny_models` the venv's Python builds the directory
offline, loads config and processor with transformers, and runs one image and one
video of :mod:`harness.payloads` through the processor: the architecture, processor
classes and token counts are the ones the real-server tests rely on.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from harness import tiny_models
from harness.paths import REPO_ROOT
from harness.venvs import e2e_versions, venv_python

VERSIONS = e2e_versions()

PROBE = r"""
import json, sys
from io import BytesIO
from pathlib import Path

import numpy as np
from PIL import Image
from transformers import AutoConfig, AutoProcessor

from harness import tiny_models
from harness.payloads import make_png, make_video

out = {}
for name in json.loads(sys.argv[2]):
    path = tiny_models.build(name, Path(sys.argv[1]) / name)
    cfg = AutoConfig.from_pretrained(path)
    proc = AutoProcessor.from_pretrained(path)
    frames = [np.asarray(Image.open(BytesIO(f)).convert("RGB")) for f in make_video(1)]
    kw = {}
    if name.startswith("qwen3-vl"):
        meta = {"fps": 1.0, "total_num_frames": len(frames), "frames_indices": [0, 1, 2, 3]}
        kw = {"video_metadata": [meta], "do_sample_frames": False}
    video = proc(
        text=["<|vision_start|><|video_pad|><|vision_end|>"],
        videos=[np.stack(frames)],
        return_tensors="np",
        **kw,
    )
    image = proc(
        text=["<|vision_start|><|image_pad|><|vision_end|>"],
        images=[Image.open(BytesIO(make_png(0)))],
        return_tensors="np",
    )
    out[name] = {
        "architectures": cfg.architectures,
        "model_type": cfg.model_type,
        "text_model_type": cfg.text_config.model_type,
        "experts": getattr(cfg.text_config, "num_experts", None),
        "processor": type(proc).__name__,
        "video_processor": type(proc.video_processor).__name__,
        "image_grid": image["image_grid_thw"].tolist(),
        "image_ids": len(image["input_ids"][0]),
        "video_grid": video["video_grid_thw"].tolist(),
        "video_ids": len(video["input_ids"][0]),
        "video_pad": int((video["input_ids"][0] == cfg.video_token_id).sum()),
        "image_pad": int((image["input_ids"][0] == cfg.image_token_id).sum()),
    }
print("PROBE " + json.dumps(out))
"""

EXPECTED = {
    "qwen2-vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen2.5-vl": (
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLProcessor",
        "Qwen2VLVideoProcessor",
    ),
    "qwen3-vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    "qwen3-vl-moe": (
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3VLProcessor",
        "Qwen3VLVideoProcessor",
    ),
}


@pytest.mark.parametrize("version", VERSIONS)
def test_tiny_models_read_by_transformers(version: str, vllm_venv, tmp_path) -> None:
    venv = vllm_venv(version)
    names = [n for n in tiny_models.names() if tiny_models.supports_version(n, version)]
    proc = subprocess.run(
        [str(venv_python(venv)), "-c", PROBE, str(tmp_path), json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO_ROOT),
        env={"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))
    got = json.loads(line[len("PROBE ") :])
    print(json.dumps(got, indent=1))
    assert sorted(got) == sorted(names)
    for name, res in got.items():
        arch, processor, video_processor = EXPECTED[name]
        assert res["architectures"] == [arch], res
        assert res["processor"] == processor and res["video_processor"] == video_processor
        assert res["text_model_type"].endswith("_text"), res
        assert res["experts"] == (4 if name.endswith("-moe") else None), res
        # One 112 x 112 image: an 8 x 8 patch grid, 16 tokens after the 2 x 2 merge.
        assert res["image_grid"] == [[1, 8, 8]] and res["image_pad"] == 16, res
        # Four frames: two temporal patches of 8 x 8, 32 video tokens.
        assert res["video_grid"] == [[2, 8, 8]] and res["video_pad"] == 32, res
        if name.startswith("qwen3-vl"):
            # A timestamp and its own vision start/end per temporal patch.
            assert res["video_ids"] > 32 + 2 * 2, res
        else:
            assert res["video_ids"] == 32 + 2, res
