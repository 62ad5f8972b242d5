"""The wheel ships every package of the source tree (pyproject lists them by hand)."""

from __future__ import annotations

import re

import pytest

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


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the other Pythons skip
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_the_build_backend_is_bounded_and_the_license_is_spdx() -> None:
    data = _pyproject()
    [backend] = data["build-system"]["requires"]
    assert re.fullmatch(r"setuptools>=(\d+),<(\d+)", backend), backend
    low, high = map(int, re.findall(r"\d+", backend))
    assert low >= 77 and high > low  # 77: PEP 639 license fields
    project = data["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert (
        (REPO_ROOT / "LICENSE")
        .read_text()
        .startswith(" " * 33 + "Apache License\n" + " " * 27 + "Version 2.0, January 2004")
    )


def test_metadata_an_index_page_needs() -> None:
    project = _pyproject()["project"]
    classifiers = project["classifiers"]
    for minor in range(9, 14):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert project["requires-python"] == ">=3.9"
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    assert any(c.startswith("Intended Audience :: ") for c in classifiers)
    assert any(c.startswith("Topic :: ") for c in classifiers)
    assert project["keywords"] and project["maintainers"]
    # No addresses until the project has real ones (placeholders pointed nowhere).
    assert "urls" not in project
    assert "example.invalid" not in (REPO_ROOT / "pyproject.toml").read_text()
    # Published extras are for users; development tools are not among them.
    assert project["optional-dependencies"] == {"diagnose": ["py-spy>=0.3"]}
    assert project["dependencies"] == []
