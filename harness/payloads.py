"""What the harness sends: PNG images, short videos, chat payloads, prompts of a chosen length.

A video is sent in the form every installed vLLM release (0.23.0, 0.27.1, 0.32.0)
decodes without a video decoder and without network, and that the harness can make
with the standard library alone: a ``video_url`` whose URL is
``data:video/jpeg;base64,<frame>,<frame>,...``. (The venvs do carry
opencv-python-headless, which vLLM's default video backend would use for an mp4, but
the harness process has no encoder.) vLLM splits
that on commas and opens each frame with its image loader (PIL, which reads the PNG
frames made here whatever the media type says), then gives the frames to the model's
video processor with ``fps`` 1. ``--limit-mm-per-prompt`` must allow ``"video"``
(:data:`VIDEO_LIMIT_ARGS`).
"""

from __future__ import annotations

import base64
import json
import struct
import zlib

from harness import tiny_models
from harness.http import http_post
from harness.server import MAX_MODEL_LEN, SERVED_NAME

IMAGE_SIDE = 112  # 112 x 112 -> 8 x 8 patches -> 16 image tokens after 2 x 2 merge
SHORT_TEXT = "Describe the image."
SHORT_VIDEO_TEXT = "Describe the video."
VIDEO_FRAMES = 4  # two temporal patches of two frames each
MODALITIES = ("image", "video")


def mm_limits_args(images: int = 1, videos: int = 0) -> list[str]:
    """``--limit-mm-per-prompt`` for so many images and videos per prompt (the JSON form is
    read the same way by 0.23.0, 0.27.1 and 0.32.0; later arguments override earlier ones)."""
    return ["--limit-mm-per-prompt", json.dumps({"image": images, "video": videos})]


# Server arguments that let a request carry one image and one video.
VIDEO_LIMIT_ARGS = mm_limits_args(1, 1)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def make_png(index: int, side: int = IMAGE_SIDE) -> bytes:
    """An RGB PNG (stdlib only) whose pixels differ for every index.

    The pattern repeats after a few thousand indices; the first pixels of the last row
    carry the index itself (eight bytes), so no two indices give the same image and a
    server that has served other requests can always be sent items it has not seen.
    """
    r0, g0, b0 = (index * 67) % 256, (index * 131 + 40) % 256, (index * 29 + 90) % 256
    period = 4 + index % 9
    stamp = index.to_bytes(8, "big", signed=True) + bytes(1)
    rows = []
    for y in range(side):
        row = bytearray(b"\0")  # filter type 0
        for x in range(side):
            if y == side - 1 and x < 3:
                row += stamp[3 * x : 3 * x + 3]
            elif (x + y * (1 + index % 3)) % period == 0:
                row += bytes((255 - r0, 255 - g0, 255 - b0))
            elif y < 8 and index % side <= x < index % side + 8:
                row += bytes((index % 256, 0, 255))
            else:
                row += bytes(((r0 + x) % 256, (g0 + y) % 256, b0))
        rows.append(bytes(row))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            _png_chunk(b"IHDR", header),
            _png_chunk(b"IDAT", zlib.compress(b"".join(rows), 9)),
            _png_chunk(b"IEND", b""),
        ]
    )


def image_part(png: bytes) -> dict[str, object]:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def make_video(index: int, frames: int = VIDEO_FRAMES, side: int = IMAGE_SIDE) -> list[bytes]:
    """``frames`` PNG frames; two videos of different ``index`` share no frame.

    Frame ``k`` of video ``index`` is :func:`make_png` of an index no image request
    uses (from 100000 up), so video items never collide with image items either.
    """
    return [make_png(100000 + index * frames + k, side) for k in range(frames)]


def video_part(frames: list[bytes]) -> dict[str, object]:
    """A ``video_url`` item carrying the frames in a ``data:video/jpeg`` URL."""
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    return {"type": "video_url", "video_url": {"url": url}}


def media_part(modality: str, index: int) -> dict[str, object]:
    """Item ``index`` of ``modality``: :func:`make_png` or :func:`make_video` of it."""
    if modality == "image":
        return image_part(make_png(index))
    if modality == "video":
        return video_part(make_video(index))
    raise ValueError(f"unknown modality {modality!r}; known: {MODALITIES}")


def short_text(modality: str) -> str:
    return SHORT_VIDEO_TEXT if modality == "video" else SHORT_TEXT


def user_request(parts: list[dict[str, object]], text: str, **fields: object) -> dict[str, object]:
    """A request to the served model: one user message of ``parts`` then ``text``, and
    ``fields`` (``max_tokens``, ...)."""
    content = [*parts, {"type": "text", "text": text}]
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": content}], **fields}


def media_payload(
    text: str, modality: str, index: int | None, max_tokens: int = 1
) -> dict[str, object]:
    """A chat request with item ``index`` of ``modality`` (none when None), then the text."""
    parts = [] if index is None else [media_part(modality, index)]
    return user_request(parts, text, max_tokens=max_tokens, temperature=0.0)


def words_text(n: int, model: str = tiny_models.DEFAULT) -> str:
    """``n`` words the tiny model's tokenizer knows (long prompts are made of them)."""
    w = tiny_models.model_module(model).WORDS
    return " ".join(w[(i * 5) % len(w)] for i in range(n))


def chat_payload(text: str, png: bytes | None, max_tokens: int = 1) -> dict[str, object]:
    """A chat request with at most one image."""
    parts = [] if png is None else [image_part(png)]
    return user_request(parts, text, max_tokens=max_tokens, temperature=0.0)


def images_payload(text: str, images: list[int], max_tokens: int = 2) -> dict[str, object]:
    """A chat request with the images ``make_png(i)`` for each index, then the text."""
    parts = [image_part(make_png(i)) for i in images]
    return user_request(parts, text, max_tokens=max_tokens, temperature=0.0)


def count_text_tokens(base_url: str, text: str, timeout: float) -> int | None:
    """Tokens of a text-only chat prompt, from the server's ``/tokenize``."""
    payload = user_request([], text, add_generation_prompt=True)
    res = http_post(base_url + "/tokenize", payload, timeout)
    if res.status != 200:
        return None
    try:
        return int(json.loads(res.body)["count"])
    except (ValueError, KeyError, TypeError):
        return None


def choose_word_count(
    base_url: str, timeout: float, target_tokens: int = MAX_MODEL_LEN - 7
) -> tuple[int, int | None]:
    """Words for a text-only chat prompt of about ``target_tokens`` tokens.

    With an image placeholder (3 tokens before expansion, 2 + 16 after) such a prompt
    passes the pre-expansion length check and fails after expansion.
    """
    base = count_text_tokens(base_url, words_text(0), timeout)
    probe = 200
    at_probe = count_text_tokens(base_url, words_text(probe), timeout)
    if base is None or at_probe is None or at_probe <= base:
        return 240, None
    rate = (at_probe - base) / probe
    words = max(1, round((target_tokens - base) / rate))
    tokens: int | None = None
    for _ in range(10):
        tokens = count_text_tokens(base_url, words_text(words), timeout)
        if tokens is None:
            break
        diff = target_tokens - tokens
        if diff == 0 or (0 < diff < rate):
            break
        words = max(1, words + (1 if diff > 0 else -1) * max(1, round(abs(diff) / rate)))
    return words, tokens
