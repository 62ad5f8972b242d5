"""Every fact about where vLLM keeps things lives in ``vllm_mmcache_fix.vllm_layout``.

The fixes, ``check``, ``diagnose`` and the patch generator read it; none of them
spells a vLLM module path, file path or factory name of its own.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from harness.paths import REPO_ROOT
from vllm_mmcache_fix import vllm_layout

# A vLLM module ("vllm.multimodal.cache") or file ("vllm/utils/cache.py") inside a string.
VLLM_PATH = re.compile(r"^vllm[./](multimodal|utils|v1|entrypoints|engine)\b")
FACTS = {vllm_layout.MM_CACHE_FACTORY}

OWNERS = {"vllm_layout.py", "owns.py"}  # the table itself, and the catalogue rows of each fix
CONSUMERS = (
    "vllm_mmcache_fix.lru_eviction.locate",
    "vllm_mmcache_fix.drift_guard.fix",
    "vllm_mmcache_fix.drift_guard.sender",
    "vllm_mmcache_fix.tools.check",
    "vllm_mmcache_fix.tools.diagnose.rules",
    "vllm_mmcache_fix.tools.diagnose.classify",
    "harness.programs.make_patches",
)


def _string_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def _sources() -> list[Path]:
    files = sorted((REPO_ROOT / "vllm_mmcache_fix").rglob("*.py"))
    files.append(REPO_ROOT / "harness" / "programs" / "make_patches.py")
    return [f for f in files if f.name not in OWNERS]


def test_no_module_outside_the_table_spells_a_vllm_location() -> None:
    found = []
    for path in _sources():
        for line, text in _string_literals(path):
            if VLLM_PATH.match(text) or text in FACTS:
                found.append(f"{path.relative_to(REPO_ROOT)}:{line}: {text!r}")
    assert not found, "vLLM layout facts outside vllm_layout.py:\n" + "\n".join(found)


def test_each_consumer_reads_the_table() -> None:
    for name in CONSUMERS:
        module = importlib.import_module(name)
        source = Path(module.__file__ or "").read_text()
        assert "vllm_layout import" in source, name


def test_the_table_is_consistent() -> None:
    files = {c.file for c in vllm_layout.FACTORY_LAYOUTS}
    for layout in vllm_layout.FACTORY_LAYOUTS:
        assert layout.file == layout.module.replace(".", "/") + ".py"
    assert len(files) == len(vllm_layout.FACTORY_LAYOUTS)
    for module, file in zip(vllm_layout.LRU_MODULES, vllm_layout.LRU_FILES):
        assert file.startswith(module.replace(".", "/"))
    for target in vllm_layout.DRIFT_TARGETS:
        assert target.candidates and target.required
        for candidate in target.candidates:
            assert candidate.module in vllm_layout.DRIFT_WATCHED_MODULES
