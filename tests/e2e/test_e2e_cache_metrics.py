"""The multimodal cache series on a real server: images and videos through a small cache.

The shared server with the plugin (harness/shared_servers.py) runs with the harness's
``--mm-processor-cache-gb 0.001`` (1 MiB): the tiny Qwen2-VL's items (a 112 x 112 image,
a four-frame video) are evicted after a few requests. The workload, of items no other test
sent: eight images, the last two again, three videos, the last again, the first image again
(evicted by then). ``/metrics`` must show, for the API server's sender cache and EngineCore's
receiver cache: the capacity, bytes in use within it, entries, evictions during the
workload, and the workload's hits and misses per modality (read as the increase over it:
other tests use the same server); the two caches mirror each other, so both see the same.
"""

from __future__ import annotations

import time

import pytest

from harness.health import scrape
from harness.http import http_post
from harness.payloads import media_payload, short_text
from harness.shared_servers import SharedServers
from harness.venvs import e2e_versions
from vllm_mmcache_fix.metrics import names as n

VERSIONS = ("0.23.0", "0.32.0")
CAPACITY = int(0.001 * (1 << 30))
"""The harness's ``--mm-processor-cache-gb 0.001`` (harness/server.py)."""


def workload(base: int) -> list[tuple[str, int]]:
    images = [("image", base + i) for i in range(8)]
    videos = [("video", base + i) for i in range(3)]
    return images + images[-2:] + videos + videos[-1:] + images[:1]


HITS = {"image": 2, "video": 1}
MISSES = {"image": 9, "video": 3}
ROLES = (("sender", ""), ("receiver", "EngineCore"))
COUNTERS = [
    (metric, role, engine, modality)
    for metric in (n.MM_CACHE_HITS, n.MM_CACHE_MISSES)
    for role, engine in ROLES
    for modality in ("image", "video")
] + [(n.MM_CACHE_EVICTIONS, role, engine, None) for role, engine in ROLES]


def series(metrics: dict[str, float], name: str, **labels: str) -> float | None:
    """The value of ``name`` with exactly these labels."""
    for key, value in metrics.items():
        if not key.startswith(name + "{"):
            continue
        got = dict(part.split("=", 1) for part in key[len(name) + 1 : -1].split(",") if "=" in part)
        if {k: v.strip('"') for k, v in got.items()} == labels:
            return value
    return None


def counters(metrics: dict[str, float]) -> dict[tuple[str, str, str, str | None], float]:
    out = {}
    for metric, role, engine, modality in COUNTERS:
        labels = {"role": role, "engine": engine}
        if modality is not None:
            labels["modality"] = modality
        out[(metric, role, engine, modality)] = series(metrics, metric, **labels) or 0.0
    return out


def settled(base_url: str, deadline_s: float = 30.0) -> dict[str, float]:
    """/metrics once the cache counters stay put across a heartbeat answer (2 s): EngineCore's
    figures arrive with it, so a read right after a request may not have them yet."""
    end = time.monotonic() + deadline_s
    _, metrics, _ = scrape(base_url)
    while time.monotonic() < end:
        time.sleep(3.0)
        _, again, _ = scrape(base_url)
        if counters(again) == counters(metrics):
            return again
        metrics = again
    raise AssertionError(f"cache counters still moving after {deadline_s} s: {counters(metrics)}")


@pytest.mark.shared_server("plugin")
@pytest.mark.parametrize("version", VERSIONS)
def test_sender_and_receiver_caches_on_metrics(version: str, shared_server: SharedServers) -> None:
    if version not in e2e_versions():
        pytest.skip(f"{version} not in MMCACHE_FIX_E2E_VERSIONS")
    session = shared_server(version, "plugin")
    before = counters(settled(session.base_url))
    for modality, index in workload(shared_server.new_items()):
        reply = http_post(
            session.chat_url, media_payload(short_text(modality), modality, index), 120
        )
        assert reply.status == 200, (modality, index, reply.status, reply.body[:300])
    metrics = settled(session.base_url)
    after = counters(metrics)
    delta = {key: after[key] - before[key] for key in after}
    report = {k: v for k, v in metrics.items() if "mm_cache" in k}
    print(f"vLLM {version}: increase over the workload {delta}; /metrics after: {report}")
    for role, engine in ROLES:
        where = {"role": role, "engine": engine}
        assert series(metrics, n.MM_CACHE_CAPACITY, **where) == CAPACITY, (where, report)
        used = series(metrics, n.MM_CACHE_BYTES, **where)
        assert used is not None and 0 < used <= CAPACITY, (where, report)
        entries = series(metrics, n.MM_CACHE_ENTRIES, **where)
        assert entries is not None and entries >= 1, (where, report)
        assert delta[(n.MM_CACHE_EVICTIONS, role, engine, None)] > 0, (where, delta)
        for modality in ("image", "video"):
            assert delta[(n.MM_CACHE_HITS, role, engine, modality)] == HITS[modality], delta
            assert delta[(n.MM_CACHE_MISSES, role, engine, modality)] == MISSES[modality], delta
