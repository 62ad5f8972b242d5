"""Video payloads and the model dispatcher of the harness (pure logic, no vLLM)."""

from __future__ import annotations

import base64
import json

import pytest

from harness import tiny_models
from harness.payloads import VIDEO_LIMIT_ARGS, make_png, make_video, media_payload
from harness.programs import incident


def test_video_url_carries_distinct_png_frames() -> None:
    payload = media_payload("Describe the video.", "video", 3)
    part = payload["messages"][0]["content"][0]  # type: ignore[index]
    assert part["type"] == "video_url"
    head, _, data = part["video_url"]["url"].partition(",")
    assert head == "data:video/jpeg;base64"
    frames = [base64.b64decode(x) for x in data.split(",")]
    assert frames == make_video(3) and len(frames) == 4
    assert all(f.startswith(b"\x89PNG") for f in frames)
    assert len(set(frames)) == 4
    # Videos share no frame with each other nor with the images the harness sends.
    others = {f for i in range(10) if i != 3 for f in make_video(i)}
    assert not others & set(frames)
    assert not {make_png(i) for i in range(50)} & set(frames)


def test_images_differ_for_far_apart_indices() -> None:
    """Shared servers get item indices far above the first replay's: never a cached twin."""
    near = {make_png(i) for i in range(16)}
    far = [make_png(i + step) for step in (16128, 1_000_000, 10**9) for i in range(16)]
    assert len(set(far)) == len(far) and not near & set(far)


def test_image_payload_unchanged_and_unknown_modality() -> None:
    part = media_payload("x", "image", 0)["messages"][0]["content"][0]  # type: ignore[index]
    assert part["image_url"]["url"] == (
        "data:image/png;base64," + base64.b64encode(make_png(0)).decode()
    )
    with pytest.raises(ValueError):
        media_payload("x", "audio", 0)


def test_video_limit_args() -> None:
    assert VIDEO_LIMIT_ARGS[0] == "--limit-mm-per-prompt"
    assert json.loads(VIDEO_LIMIT_ARGS[1]) == {"image": 1, "video": 1}


def test_model_names_and_versions() -> None:
    assert tiny_models.DEFAULT == "qwen2-vl" and tiny_models.names()[0] == "qwen2-vl"
    assert {"qwen2.5-vl", "qwen3-vl"} <= set(tiny_models.names())
    assert all(tiny_models.supports_video(n) for n in tiny_models.names())
    assert tiny_models.supports_version("qwen3-vl", "0.23.0")
    assert tiny_models.supports_version("qwen3-vl", "0.11.0+cpu")
    assert not tiny_models.supports_version("qwen3-vl", "0.10.2")
    assert tiny_models.supports_version("qwen2.5-vl", "0.9.0")
    with pytest.raises(ValueError):
        tiny_models.supports_version("llava", "0.23.0")


def test_step_names() -> None:
    assert incident.step_names("image") == ("a:long+img0", "b:short+img0", "c:img")
    assert incident.step_names("video") == ("a:long+vid0", "b:short+vid0", "c:vid")
