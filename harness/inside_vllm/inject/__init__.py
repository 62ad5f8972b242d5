"""Faults and slow paths made on purpose in a real vLLM server (test-only, never the plugin).

A ``sitecustomize`` in :data:`DIRECTORY`, put on the server's ``PYTHONPATH`` by
:func:`inject_env`, patches vLLM as its modules are imported, in every process of the
server (API server, EngineCore, workers), with the plugin loaded or not. What it does is
chosen by environment variables (:func:`inject_env` writes them):

- ``step_sleep_s``: every EngineCore step takes this much longer (a sleep inside
  ``EngineCoreProc._process_engine_step``, as a large model on a slow accelerator);
- ``utility_sleep_s``: EngineCore's ``reset_prefix_cache`` utility call takes this much
  longer (vLLM's dev-mode ``POST /reset_prefix_cache`` runs it; as a profiler stop, a weight
  sync or a LoRA load would);
- ``busy_loop_delay_s``: EngineCore's busy loop starts this much later after EngineCore
  said it was ready (the API server's first requests and pings wait in its input queue);
- ``fork``: undo the CPU platform's forced ``spawn`` (``VLLM_WORKER_MULTIPROC_METHOD``), so
  EngineCore is forked from the API server as on GPU and Ascend images;
- trigger files in ``trigger_dir``: while ``stuck-step`` exists, the next step does not
  return (a busy loop stuck inside one step); ``burn-api`` (its text: seconds) makes the
  next ``AsyncLLM.generate`` in the API server burn that much CPU in pure Python, in the
  request path, before it goes on; while ``drop-pings`` exists the API server drops the
  answers to the plugin's heartbeat pings as they arrive (their futures never resolve, as
  when vLLM's ROUTER drops the replies of an engine that reconnects); while ``livelock``
  exists EngineCore's scheduler schedules nothing (the zero-token livelock: empty steps, every
  ping answered); ``slow-steps`` (its text: seconds) makes every step that much longer
  while it exists; ``slow-grammar`` (seconds) makes each structured-output grammar take that
  much longer to compile; ``slow-utility`` (seconds) does to ``reset_prefix_cache`` what
  ``utility_sleep_s`` does, only while it exists; while ``remote-kv`` exists every waiting
  request is left in vLLM's ``WAITING_FOR_REMOTE_KVS`` state, unscheduled; while
  ``preempt`` exists every running request is preempted after each step (the preemption
  cascade); while
  ``dp-stuck`` exists EngineCore of DP rank 1, once it has taken requests, blocks in its busy
  loop outside a step (where a MoE DP rank waits on its peers in the DP all-reduce); while
  ``input-stuck`` exists the busy loop, once its scheduler holds no request, blocks before
  it takes its input queue (requests wait there, where the scheduler does not see them; the
  loop is in ``_process_input_queue``'s wait when the file comes, so the first request after
  it is taken and served, and the loop blocks after it).

Each injection prints one ``[inject]`` line to stderr (the server log) when it acts.
"""

from __future__ import annotations

import os
from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent / "site"
ENV_STEP_SLEEP = "MMCACHE_INJECT_STEP_SLEEP_S"
ENV_UTILITY_SLEEP = "MMCACHE_INJECT_UTILITY_SLEEP_S"
ENV_BUSY_LOOP_DELAY = "MMCACHE_INJECT_BUSY_LOOP_DELAY_S"
ENV_FORK = "MMCACHE_INJECT_FORK"
ENV_TRIGGERS = "MMCACHE_INJECT_DIR"
STUCK_STEP = "stuck-step"
BURN_API = "burn-api"
DROP_PINGS = "drop-pings"
LIVELOCK = "livelock"
SLOW_STEPS = "slow-steps"
SLOW_GRAMMAR = "slow-grammar"
REMOTE_KV = "remote-kv"
PREEMPT = "preempt"
DP_STUCK = "dp-stuck"
INPUT_STUCK = "input-stuck"
SLOW_UTILITY = "slow-utility"
STUCK_STEP_MAX_S = 900.0
"""A stuck step gives up after this long whatever the trigger says (a test never hangs)."""


def inject_env(
    base: dict[str, str] | None = None,
    *,
    step_sleep_s: float = 0.0,
    utility_sleep_s: float = 0.0,
    busy_loop_delay_s: float = 0.0,
    fork: bool = False,
    trigger_dir: Path | None = None,
) -> dict[str, str]:
    """``base`` (a server's extra environment) plus the injections asked for; the
    ``sitecustomize`` goes first on ``PYTHONPATH`` and runs any other one found after it."""
    env = dict(base or {})
    paths = [str(DIRECTORY), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if step_sleep_s:
        env[ENV_STEP_SLEEP] = str(step_sleep_s)
    if utility_sleep_s:
        env[ENV_UTILITY_SLEEP] = str(utility_sleep_s)
    if busy_loop_delay_s:
        env[ENV_BUSY_LOOP_DELAY] = str(busy_loop_delay_s)
    if fork:
        env[ENV_FORK] = "1"
    if trigger_dir is not None:
        env[ENV_TRIGGERS] = str(trigger_dir)
    return env


def trigger(trigger_dir: Path, name: str, text: str = "") -> Path:
    path = Path(trigger_dir) / name
    path.write_text(text)
    return path
