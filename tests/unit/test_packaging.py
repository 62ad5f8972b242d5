"""The wheel ships every package of the source tree (pyproject lists them by hand)."""

from __future__ import annotations

import re

from harness.paths import REPO_ROOT


def test_every_package_is_listed_in_pyproject() -> None:
    text = (REPO_ROOT / "pyproject.toml").read_text()
    block = re.search(r"^packages = \[(.*?)\]", text, re.S | re.M)
    assert block is not None
    listed = set(re.findall(r'"([\w.]+)"', block.group(1)))
    root = REPO_ROOT / "vllm_mmcache_fix"
    found = {
        ".".join(init.parent.relative_to(REPO_ROOT).parts) for init in root.rglob("__init__.py")
    }
    assert found - listed == set(), "packages missing from pyproject.toml"


def test_register_survives_a_broken_install(monkeypatch, caplog) -> None:
    """vLLM calls the entry point without a ``try``: a module missing from the wheel
    must not stop vLLM (it did, when a new subpackage was left out of the list)."""
    import sys

    import vllm_mmcache_fix

    monkeypatch.setitem(sys.modules, "vllm_mmcache_fix.plugin", None)  # import fails
    with caplog.at_level("WARNING", logger="vllm.mmcache_fix"):
        vllm_mmcache_fix.register()
    assert "cannot import the plugin" in caplog.text
