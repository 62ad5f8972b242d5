"""Give vLLM 0.10.x's ``MRotaryEmbedding`` the ``forward_cpu`` of 0.11.0.

See harness.inside_vllm.cpu_mrope."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from types import ModuleType

TARGET = "vllm.model_executor.layers.rotary_embedding.mrope"


def _give_forward_cpu(module: ModuleType) -> None:
    cls = getattr(module, "MRotaryEmbedding", None)
    if cls is not None and "forward_cpu" not in vars(cls) and hasattr(cls, "forward_native"):
        cls.forward_cpu = cls.forward_native
        print(
            "[harness] MRotaryEmbedding.forward_cpu = forward_native (as vLLM 0.11.0 has it)",
            file=sys.stderr,
            flush=True,
        )


_HOOKS = Path(__file__).resolve().parents[2] / "import_hook.py"
runpy.run_path(str(_HOOKS))["after_import"]({TARGET: _give_forward_cpu})
