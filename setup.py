"""The version of a build: ``vllm_mmcache_fix/_version.py`` decides it, this writes it into the
wheel. Everything else is in ``pyproject.toml``.

From a git checkout a development version carries the commit; from an sdist (no ``.git``)
the version its ``PKG-INFO`` names. Needs nothing but setuptools (offline builds work).
"""

from __future__ import annotations

import importlib.util
import os
import re

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    pkg_info = os.path.join(ROOT, "PKG-INFO")
    if os.path.isfile(pkg_info) and not os.path.exists(os.path.join(ROOT, ".git")):
        with open(pkg_info, encoding="utf-8") as f:
            found = re.search(r"^Version: (\S+)$", f.read(), re.M)
        if found:
            return found.group(1)
    spec = importlib.util.spec_from_file_location(
        "_mmcache_fix_version", os.path.join(ROOT, "vllm_mmcache_fix", "_version.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.of_checkout(ROOT))


VERSION = _version()


class BuildPy(build_py):  # type: ignore[misc]
    """Copies the package and writes :data:`VERSION` into the copy's ``_version.py``."""

    def run(self) -> None:
        super().run()
        path = os.path.join(self.build_lib, "vllm_mmcache_fix", "_version.py")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        # The line as the checkout has it, or as an earlier build in this tree left it:
        # setuptools copies a file into build/ again only when the checkout's is newer.
        line = re.escape("BUILT: str | None = ")
        text, n = re.subn("^" + line + ".*$", f"BUILT: str | None = {VERSION!r}", text, flags=re.M)
        if n != 1:
            raise RuntimeError(f"{path}: no 'BUILT: str | None = ...' line to set")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


setup(version=VERSION, cmdclass={"build_py": BuildPy})
