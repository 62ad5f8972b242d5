"""The harness's CPU path for vLLM 0.10.x's multimodal rotary embedding.

See harness.inside_vllm.cpu_mrope."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from harness.inside_vllm import cpu_mrope

MROPE_0_10 = """
def triton_mrope(q, k): ...
class MRotaryEmbedding:
    def forward_native(self): return "native"
    def forward_cuda(self): return triton_mrope(1, 2)
"""
MROPE_0_11 = (
    MROPE_0_10
    + """
    def forward_cpu(self): return self.forward_native()
"""
)


def _venv(tmp_path: Path, text: str | None) -> Path:
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if text is not None:
        source = site / cpu_mrope.MODULE_FILE
        source.parent.mkdir(parents=True)
        for parent in [source.parent, *source.parent.parents]:
            if parent == site:
                break
            (parent / "__init__.py").write_text("")
        source.write_text(text)
    return venv


def test_needed_only_where_the_cpu_path_runs_triton(tmp_path: Path) -> None:
    assert cpu_mrope.needed(_venv(tmp_path / "a", MROPE_0_10))
    assert not cpu_mrope.needed(_venv(tmp_path / "b", MROPE_0_11))
    assert not cpu_mrope.needed(_venv(tmp_path / "c", None))


def _import_with_site(venv: Path) -> subprocess.CompletedProcess[str]:
    site = next(venv.glob("lib/python3*/site-packages"))
    code = textwrap.dedent(
        """
        from vllm.model_executor.layers.rotary_embedding import mrope
        cls = mrope.MRotaryEmbedding
        print(cls.forward_cpu(cls()))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cpu_mrope.DIRECTORY), str(site)])}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )


def test_the_site_gives_a_release_without_forward_cpu_the_native_path(tmp_path: Path) -> None:
    proc = _import_with_site(_venv(tmp_path, MROPE_0_10))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "native"
    assert "forward_cpu = forward_native" in proc.stderr


def test_the_site_leaves_a_release_with_forward_cpu_alone(tmp_path: Path) -> None:
    proc = _import_with_site(_venv(tmp_path, MROPE_0_11.replace("self.forward_native()", '"own"')))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "own"
    assert "forward_cpu" not in proc.stderr


def test_preload_env_puts_the_site_on_pythonpath_for_such_a_release(tmp_path: Path) -> None:
    from harness import server

    env = server.preload_env(_venv(tmp_path / "a", MROPE_0_10), version="0.32.0")
    assert env.get("PYTHONPATH") == str(cpu_mrope.DIRECTORY)
    assert "PYTHONPATH" not in server.preload_env(_venv(tmp_path / "b", MROPE_0_11), "0.32.0")
