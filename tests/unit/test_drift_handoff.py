"""Where a request's journals wait for admission control: the hand-off's lookup (pure logic;
the hand-off on vLLM's real ``AsyncLLM`` is in ``tests/installed/test_drift_admission.py``)."""

from __future__ import annotations

import threading

from vllm_mmcache_fix.drift_guard import handoff
from vllm_mmcache_fix.drift_guard.handoff import Handoff, staging


def _end(key: int | None, mine: Handoff, admitted: bool = False) -> list:  # type: ignore[type-arg]
    return handoff.end(key, mine, admitted)


def test_a_raw_prompts_hand_off_is_found_by_its_prompt_from_another_thread() -> None:
    prompt, other = {"prompt": "hi"}, {"prompt": "hi"}
    mine = Handoff()
    key = handoff._open(prompt, mine)
    found: list[Handoff | None] = []
    # vLLM's executor thread: no context of the add_request call.
    thread = threading.Thread(target=lambda: found.extend([staging(prompt), staging(other)]))
    thread.start()
    thread.join()
    assert found == [mine, None]
    _end(key, mine)
    assert staging(prompt) is None and handoff._by_prompt == {}


def test_two_open_calls_with_one_prompt_object_find_no_hand_off() -> None:
    prompt = {"prompt": "hi"}
    first, second = Handoff(), Handoff()
    keys = handoff._open(prompt, first), handoff._open(prompt, second)
    assert staging(prompt) is None  # which one is processing it: unknown, so commit at once
    _end(keys[0], first)
    assert staging(prompt) is second
    _end(keys[1], second)
    assert handoff._by_prompt == {} and not second.open


def test_a_closed_hand_off_is_not_found() -> None:
    prompt = {"prompt": "hi"}
    mine = Handoff()
    handoff._open(prompt, mine)
    mine.open = False
    assert staging(prompt) is None
    handoff._by_prompt.clear()


def test_a_call_that_ended_tells_a_late_stager_how_it_ended() -> None:
    # A raw prompt's process_inputs finishing in its thread after the client went away
    # (vLLM cancels add_request, not the thread): committing would record an image
    # EngineCore never received.
    j1, j2, j3 = object(), object(), object()
    cancelled, sent = Handoff(), Handoff()
    assert cancelled.stage(j1) is None  # staged while the call was open
    assert _end(None, cancelled, admitted=False) == [j1]  # the wrapper rolls it back
    assert cancelled.stage(j2) is False  # the late one: roll back too
    assert sent.stage(j3) is None
    assert _end(None, sent, admitted=True) == [j3]
    assert sent.stage(object()) is True  # a task the call started: commit, as before


def test_staging_and_closing_from_two_threads_lose_no_journal() -> None:
    # process_inputs' thread stages while the event loop closes the call, switching every
    # microsecond beside a thread burning CPU: each journal is either taken by the close or
    # told to the stager as ended, never both, never neither.
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    stop = threading.Event()
    burner = threading.Thread(target=lambda: [sum(range(500)) for _ in iter(stop.is_set, True)])
    burner.start()
    try:
        for _ in range(200):
            mine = Handoff()
            journals = [object() for _ in range(50)]
            late: list[object] = []
            taken: list[object] = []

            def stager(mine: Handoff = mine, journals: list = journals, late: list = late) -> None:  # type: ignore[type-arg]
                for j in journals:
                    if mine.stage(j) is not None:
                        late.append(j)

            thread = threading.Thread(target=stager)
            thread.start()
            taken += mine.take(close=True)
            thread.join()
            assert mine.journals == []  # nothing staged into a call that ended
            assert sorted(map(id, taken + late)) == sorted(map(id, journals))
            assert not set(map(id, taken)) & set(map(id, late))
    finally:
        stop.set()
        burner.join()
        sys.setswitchinterval(old)
