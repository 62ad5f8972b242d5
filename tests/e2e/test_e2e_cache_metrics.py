"""The multimodal cache series on a real server: images and videos through a small cache.

The shared server with the plugin (harness/shared_servers.py) runs with the harness's
``--mm-processor-cache-gb 0.001`` (1 MiB): the tiny Qwen2-VL's items (a 112 x 112 image,
a four-frame video; about 0.3 and 0.6 MiB on 0.23.0, a third of that on 0.32.0) are evicted
after a few requests. The workload, of items no other test sent: sixteen images, the last
two again, three videos, the last again, the first image again
(evicted by then). ``/metrics`` must show, for the API server's sender cache and EngineCore's
receiver cache: the capacity, bytes in use within it, entries, evictions during the
workload, and the workload's hits and misses per modality (read as the increase over it:
other tests use the same server); the two caches mirror each other, so both see the same.
"""

from __future__ import annotations

import pytest

from harness.http import http_post
from harness.payloads import media_payload, short_text
from harness.programs.cache_figures import ROLES, counters, series, settled
from harness.shared_servers import SharedServers
from harness.venvs import e2e_versions
from vllm_mmcache_fix.metrics import names as n

VERSIONS = ("0.23.0", "0.32.0")
CAPACITY = int(0.001 * (1 << 30))
"""The harness's ``--mm-processor-cache-gb 0.001`` (harness/server.py)."""


def workload(base: int) -> list[tuple[str, int]]:
    images = [("image", base + i) for i in range(16)]
    videos = [("video", base + i) for i in range(3)]
    return images + images[-2:] + videos + videos[-1:] + images[:1]


HITS = {"image": 2, "video": 1}
MISSES = {"image": 17, "video": 3}


@pytest.mark.shared_server("plugin")
@pytest.mark.parametrize("version", VERSIONS)
def test_sender_and_receiver_caches_on_metrics(version: str, shared_server: SharedServers) -> None:
    if version not in e2e_versions():
        pytest.skip(f"{version} not in MMCACHE_HARNESS_E2E_VERSIONS")
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
