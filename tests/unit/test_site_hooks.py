"""The site hooks' shared import hook (``harness/inside_vllm/import_hook.py``).

Each hook is a ``sitecustomize.py`` put on a server's ``PYTHONPATH``; these runs put one on
the path of a fresh interpreter with a small stand-in package where the hooked vLLM module
would be, and read what the hook changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.paths import REPO_ROOT
from harness.programs.topologies.environment import FORK_SITE, START_METHOD_ENV

PLATFORM = """
import os


class CpuPlatform:
    @classmethod
    def check_and_update_config(cls, vllm_config):
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
"""


def _run(tmp_path: Path, site: Path, code: str, env: dict[str, str]) -> str:
    pkg = tmp_path / "vllm" / "platforms"
    pkg.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "cpu.py").write_text(PLATFORM)
    full = {**os.environ, **env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{site}"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


AFTER_HOOK = (
    "import os\nfrom vllm.platforms.cpu import CpuPlatform\n"
    "CpuPlatform.check_and_update_config(None)\n"
    "print(os.environ['VLLM_WORKER_MULTIPROC_METHOD'])"
)


def test_fork_site_sets_the_wanted_start_method_again_after_the_platform_hook(
    tmp_path: Path,
) -> None:
    assert _run(tmp_path, FORK_SITE, AFTER_HOOK, {START_METHOD_ENV: "fork"}) == "fork"


def test_fork_site_does_nothing_without_a_wanted_method(tmp_path: Path) -> None:
    assert _run(tmp_path, FORK_SITE, AFTER_HOOK, {START_METHOD_ENV: ""}) == "spawn"


def test_a_module_imported_before_the_hook_is_hooked_at_once(tmp_path: Path) -> None:
    hook = REPO_ROOT / "harness" / "inside_vllm" / "import_hook.py"
    code = (
        "import runpy, sys, json\n"
        "import vllm.platforms.cpu as cpu\n"
        f"after_import = runpy.run_path({str(hook)!r})['after_import']\n"
        "seen = []\n"
        "after_import({'vllm.platforms.cpu': seen.append, 'vllm.platforms.later': seen.append})\n"
        "import vllm.platforms.later\n"
        "print(json.dumps([m.__name__ for m in seen]))"
    )
    (tmp_path / "vllm" / "platforms").mkdir(parents=True)
    (tmp_path / "vllm" / "platforms" / "later.py").write_text("")
    out = _run_plain(tmp_path, code)
    assert out == '["vllm.platforms.cpu", "vllm.platforms.later"]'


def _run_plain(tmp_path: Path, code: str) -> str:
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "platforms" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "platforms" / "cpu.py").write_text(PLATFORM)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
