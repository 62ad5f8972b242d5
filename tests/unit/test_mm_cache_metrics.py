"""The multimodal cache series: from the flat counts to metric updates (pure logic)."""

from __future__ import annotations

from vllm_mmcache_fix.core.declaration import ENGINE_NAME_KEY
from vllm_mmcache_fix.lru_eviction import stats
from vllm_mmcache_fix.metrics import names as n
from vllm_mmcache_fix.metrics.exporter import Deltas, engine_labels, plan


def engine(name: str, hits: int, entries: int) -> dict[str, int]:
    return {
        "protected": 1,
        f"mmcache|process|{name}": 1,
        "mmcache|receiver|bytes": entries * 10,
        "mmcache|receiver|capacity_bytes": 1000,
        "mmcache|receiver|entries": entries,
        "mmcache|receiver|evictions": hits // 2,
        "mmcache|receiver|too_large": 0,
        "mmcache|receiver|hits|image": hits,
        "mmcache|receiver|misses|video": 1,
    }


def by_key(updates: list) -> dict:
    return {(m, labels): (op, v) for m, labels, op, v in updates}


def labels(role: str, engine: str, modality: str | None = None) -> tuple:
    out: tuple = (("role", role), ("engine", engine))
    return out if modality is None else (*out, ("modality", modality))


def test_each_engine_and_the_api_server_have_their_own_series() -> None:
    local = {
        "protected": 1,
        "mmcache|sender|entries": 4,
        "mmcache|sender|hits|image": 7,
        "mmcache|process|MainProcess": 1,
    }
    got = by_key(
        plan(Deltas(), local, [engine("EngineCore_DP0", 4, 2), engine("EngineCore_DP1", 6, 3)])
    )
    assert got[(n.MM_CACHE_ENTRIES, labels("sender", ""))] == ("set", 4.0)
    assert got[(n.MM_CACHE_HITS, labels("sender", "", "image"))] == ("inc", 7.0)
    assert got[(n.MM_CACHE_HITS, labels("receiver", "EngineCore_DP0", "image"))] == ("inc", 4.0)
    assert got[(n.MM_CACHE_HITS, labels("receiver", "EngineCore_DP1", "image"))] == ("inc", 6.0)
    assert got[(n.MM_CACHE_CAPACITY, labels("receiver", "EngineCore_DP1"))] == ("set", 1000.0)
    assert got[(n.MM_CACHE_MISSES, labels("receiver", "EngineCore_DP0", "video"))] == ("inc", 1.0)


def test_an_engine_leaving_moves_no_counter_back_and_zeroes_its_gauges() -> None:
    deltas = Deltas()
    plan(deltas, {}, [engine("EngineCore_DP0", 4, 2), engine("EngineCore_DP1", 6, 3)])
    after = by_key(plan(deltas, {}, [engine("EngineCore_DP0", 10, 2)]))
    assert after[(n.MM_CACHE_HITS, labels("receiver", "EngineCore_DP0", "image"))] == ("inc", 6.0)
    # DP1 is gone: no update to its counters at all (a counter cannot go back), its gauges 0.
    assert (n.MM_CACHE_HITS, labels("receiver", "EngineCore_DP1", "image")) not in after
    assert after[(n.MM_CACHE_ENTRIES, labels("receiver", "EngineCore_DP1"))] == ("set", 0.0)
    # Once: the next plan does not set it again.
    again = by_key(plan(deltas, {}, [engine("EngineCore_DP0", 10, 2)]))
    assert (n.MM_CACHE_ENTRIES, labels("receiver", "EngineCore_DP1")) not in again
    # It comes back restarted (counts from 0): the counter goes on from where it was.
    back = by_key(
        plan(deltas, {}, [engine("EngineCore_DP0", 10, 2), engine("EngineCore_DP1", 2, 1)])
    )
    assert back[(n.MM_CACHE_HITS, labels("receiver", "EngineCore_DP1", "image"))] == ("inc", 2.0)


def test_a_single_engine_without_a_process_key_is_named_as_vllm_names_it() -> None:
    counts = engine("x", 1, 1)
    del counts["mmcache|process|x"]
    got = by_key(plan(Deltas(), {}, [counts]))
    assert (n.MM_CACHE_ENTRIES, labels("receiver", "EngineCore")) in got


def test_every_cache_series_is_a_declared_metric_with_its_labels() -> None:
    specs = {spec.name: spec for spec in n.METRICS}
    local = {"mmcache|processor_only|bytes": 1, "mmcache|processor_only|misses|audio": 2}
    for metric, labelset, _, _ in plan(Deltas(), local, [engine("EngineCore", 1, 1)]):
        assert tuple(name for name, _ in labelset) == specs[metric].labels, metric


def test_modality_is_what_the_item_says() -> None:
    class MultiModalKwargsItem(dict):
        pass

    class Meta:
        def __init__(self, modality: str) -> None:
            self.prompt_updates = [type("U", (), {"modality": modality})()]

    assert stats.modality_of(MultiModalKwargsItem(pixel_values_videos=1)) == "video"
    assert stats.modality_of(MultiModalKwargsItem(pixel_values=1, image_grid_thw=2)) == "image"
    assert stats.modality_of(MultiModalKwargsItem(input_audio_features=1)) == "audio"
    assert stats.modality_of(Meta("video")) == "video"
    assert stats.modality_of(b"bytes") == stats.MODALITY_UNKNOWN
    assert stats.modality_of(MultiModalKwargsItem(something_else=1)) == stats.MODALITY_UNKNOWN


def test_the_role_comes_from_the_value_type_vllm_names() -> None:
    for name, role in (
        ("MultiModalProcessorCacheItemMetadata", stats.ROLE_SENDER),
        ("MultiModalProcessorCacheItem", stats.ROLE_PROCESSOR_ONLY),
        ("MultiModalKwargsItem", stats.ROLE_RECEIVER),
        ("Mapping", stats.ROLE_OTHER),
    ):
        assert stats.role_of(type(name, (), {})) == role
    assert stats.role_of(None) == stats.ROLE_OTHER


def test_engines_whose_processes_share_a_name_keep_their_own_series() -> None:
    # Ray actors may all be named MainProcess: one slot for two engines would read each
    # other's counts as resets, and every sync would add them again.
    first = {**engine("MainProcess", 140, 2), ENGINE_NAME_KEY: "EngineCore_DP0"}
    second = {**engine("MainProcess", 100, 3), ENGINE_NAME_KEY: "EngineCore_DP1"}
    deltas = Deltas()
    got = by_key(plan(deltas, {}, [first, second]))
    assert got[(n.MM_CACHE_HITS, labels("receiver", "EngineCore_DP0", "image"))] == ("inc", 140.0)
    assert got[(n.MM_CACHE_HITS, labels("receiver", "EngineCore_DP1", "image"))] == ("inc", 100.0)
    for _ in range(3):  # nothing happened: nothing rises
        again = by_key(plan(deltas, {}, [first, second]))
        rises = {key: value for key, value in again.items() if value[0] == "inc" and value[1]}
        assert rises == {}


def test_engine_labels_are_never_the_same_for_two_engines() -> None:
    same = {**engine("MainProcess", 1, 1), ENGINE_NAME_KEY: "EngineCore"}
    assert engine_labels([same, same]) == ["EngineCore#0", "EngineCore#1"]
    assert engine_labels([engine("EngineCore_DP3", 1, 1)]) == ["EngineCore_DP3"]
