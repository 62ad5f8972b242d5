"""What the harness sends: PNG images, chat payloads, prompts of a chosen token length."""

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


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def make_png(index: int, side: int = IMAGE_SIDE) -> bytes:
    """An RGB PNG (stdlib only) whose pixels differ for every index."""
    r0, g0, b0 = (index * 67) % 256, (index * 131 + 40) % 256, (index * 29 + 90) % 256
    period = 4 + index % 9
    rows = []
    for y in range(side):
        row = bytearray(b"\0")  # filter type 0
        for x in range(side):
            if (x + y * (1 + index % 3)) % period == 0:
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


def words_text(n: int, model: str = tiny_models.DEFAULT) -> str:
    """``n`` words the tiny model's tokenizer knows (long prompts are made of them)."""
    w = tiny_models.model_module(model).WORDS
    return " ".join(w[(i * 5) % len(w)] for i in range(n))


def chat_payload(text: str, png: bytes | None, max_tokens: int = 1) -> dict[str, object]:
    """A chat request with at most one image."""
    content: list[dict[str, object]] = []
    if png is not None:
        content.append(image_part(png))
    content.append({"type": "text", "text": text})
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


def images_payload(text: str, images: list[int], max_tokens: int = 2) -> dict[str, object]:
    """A chat request with the images ``make_png(i)`` for each index, then the text."""
    content: list[dict[str, object]] = [image_part(make_png(i)) for i in images]
    content.append({"type": "text", "text": text})
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


def count_text_tokens(base_url: str, text: str, timeout: float) -> int | None:
    """Tokens of a text-only chat prompt, from the server's ``/tokenize``."""
    payload = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
        "add_generation_prompt": True,
    }
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
