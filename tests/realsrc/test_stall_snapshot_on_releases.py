"""What the stall snapshot reads on an EngineCore, in every release's own ``core.py``.

The answer's details read ``engine.scheduler`` (its requests, queues and cache managers,
checked on installed builds in tests/installed/test_stall_snapshot_installed.py) and
``engine.model_executor.is_sleeping``: both are attributes ``EngineCore.__init__`` sets in
every release (0.10.0-0.34.0), and the sleep state is the executor's wherever vLLM itself
asks it.
"""

from __future__ import annotations

import ast

import pytest

from harness import realsrc
from vllm_mmcache_fix import vllm_layout as layout
from vllm_mmcache_fix.engine_liveness.progress import SCHEDULER_ATTR

VERSIONS = realsrc.VERSIONS
CORE = layout.ENGINE_CORE_CLASS.module.replace(".", "/") + ".py"


def _self_attrs_set(func: ast.FunctionDef) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(func):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                out.add(target.attr)
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_engine_core_has_the_scheduler_and_executor_the_details_read(version: str) -> None:
    tree = realsrc.parse_release_file(version, CORE)
    core = realsrc.top_level_class(tree, layout.ENGINE_CORE_CLASS.cls)
    assert core is not None, version
    init = realsrc.class_method(core, "__init__")
    assert init is not None, version
    assert {SCHEDULER_ATTR, "model_executor"} <= _self_attrs_set(init), version
    sleeping = [
        node
        for node in ast.walk(core)
        if isinstance(node, ast.Attribute)
        and node.attr == "is_sleeping"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "model_executor"
    ]
    # Where the release has sleep mode (and only there), vLLM asks the executor.
    has_sleep = realsrc.class_method(core, "sleep") is not None
    assert bool(sleeping) == has_sleep, version
