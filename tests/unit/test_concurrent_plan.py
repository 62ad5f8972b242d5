"""The concurrent run's seeded plan and its benchmark ratios (pure logic, no server)."""

from __future__ import annotations

import collections

from harness.programs import concurrent


def test_the_same_seed_gives_the_same_plan() -> None:
    assert concurrent.plan_requests(300, 7) == concurrent.plan_requests(300, 7)
    assert concurrent.plan_requests(300, 7) != concurrent.plan_requests(300, 8)


def test_the_mixed_plan_has_every_kind_and_reuses_images() -> None:
    plan = concurrent.plan_requests(300, 7, video=False)
    kinds = collections.Counter(p.kind for p in plan)
    assert set(kinds) == {"new", "reuse", "long", "pair", "n2"}
    assert kinds["long"] >= 30 and kinds["n2"] >= 5
    assert all(p.n == 2 for p in plan if p.kind == "n2")
    assert all(len(p.images) == 2 and p.images[0] != p.images[1] for p in plan if p.kind == "pair")
    assert [p.index for p in plan] == list(range(300))
    seen: set[int] = set()
    for p in plan:
        if p.kind == "new":
            assert p.images[0] not in seen
        if p.kind in ("reuse", "n2"):
            assert p.images[0] in seen or not seen  # hits: an image sent before
        seen.update(p.images)
    # Long prompts often carry an image a later request sends again.
    long_images = {p.images[0] for p in plan if p.kind == "long"}
    later = {i for p in plan if p.kind != "long" for i in p.images}
    assert len(long_images & later) >= 10
    assert concurrent.mm_limits(plan) == '{"image": 2, "video": 0}'


def test_the_clean_plan_has_nothing_rejected() -> None:
    plan = concurrent.plan_requests(300, 7, "clean")
    assert {p.kind for p in plan} == {"new", "reuse"}
    assert all(p.expected == 200 for p in plan)


def test_video_items_only_when_asked_for() -> None:
    plan = concurrent.plan_requests(400, 7, video=True)
    assert any(p.kind == "video" for p in plan)
    assert '"video": 1' in concurrent.mm_limits(plan)
    assert not any(p.kind == "video" for p in concurrent.plan_requests(400, 7, video=False))


def test_n2_payloads_ask_for_two_completions() -> None:
    item = concurrent.Planned(3, "n2", (5,), n=2)
    body = concurrent.build_payload(item, "short", "long")
    assert body["n"] == 2 and body["temperature"] > 0
    long_item = concurrent.Planned(4, "long", (5,))
    assert concurrent.build_payload(long_item, "short", "long words")["messages"][0]["content"][
        -1
    ] == {"type": "text", "text": "long words"}


def test_ratios_are_medians_of_with_over_without() -> None:
    rounds = [
        (
            {"throughput_rps": 10.0, "latency_p50_s": 1.0, "latency_p99_s": 2.0},
            {"throughput_rps": 9.0, "latency_p50_s": 1.1, "latency_p99_s": 2.0},
        ),
        (
            {"throughput_rps": 10.0, "latency_p50_s": 1.0, "latency_p99_s": 2.0},
            {"throughput_rps": 10.0, "latency_p50_s": 1.0, "latency_p99_s": 2.2},
        ),
        (
            {"throughput_rps": 10.0, "latency_p50_s": 1.0, "latency_p99_s": 2.0},
            {"throughput_rps": 11.0, "latency_p50_s": 0.9, "latency_p99_s": 1.8},
        ),
    ]
    r = concurrent.ratios(rounds)
    assert r["throughput"] == 1.0 and r["p50"] == 1.0 and r["p99"] == 1.0
    assert r["rounds"] == 3


def test_json_lines_keep_finished_runs_for_resume(tmp_path) -> None:
    record = concurrent.JsonLines(tmp_path / "r.jsonl")
    record.write({"type": "run_start", "key": "a"})
    record.write({"type": "request", "key": "a", "index": 0})
    record.write({"type": "run_end", "key": "a", "result": {"sent": 1}})
    record.write({"type": "run_start", "key": "b"})
    assert record.summaries() == {"a": {"sent": 1}}


def test_video_items_use_the_harness_video_helper(monkeypatch) -> None:
    from harness import payloads, tiny_models

    monkeypatch.setattr(
        payloads,
        "media_part",
        lambda modality, index: {"type": f"{modality}_url", "i": index},
        raising=False,
    )
    monkeypatch.setattr(tiny_models, "supports_video", lambda name: True, raising=False)
    plan = concurrent.plan_requests(400, 7)
    video = [p for p in plan if p.kind == "video"]
    assert video
    body = concurrent.build_payload(video[0], "short", "long")
    content = body["messages"][0]["content"]
    assert content[0] == {"type": "video_url", "i": video[0].images[0]}
    monkeypatch.setattr(tiny_models, "supports_video", lambda name: False, raising=False)
    assert concurrent.video_helper() is None
    assert not any(p.kind == "video" for p in concurrent.plan_requests(400, 7))
