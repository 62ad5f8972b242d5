"""Where a request's journals wait for admission control: the hand-off's lookup (pure logic;
the hand-off on vLLM's real ``AsyncLLM`` is in ``tests/installed/test_drift_admission.py``)."""

from __future__ import annotations

import threading

from vllm_mmcache_fix.drift_guard import handoff
from vllm_mmcache_fix.drift_guard.handoff import Handoff, staging


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
    handoff._close(key, mine)
    assert staging(prompt) is None and handoff._by_prompt == {}


def test_two_open_calls_with_one_prompt_object_find_no_hand_off() -> None:
    prompt = {"prompt": "hi"}
    first, second = Handoff(), Handoff()
    keys = handoff._open(prompt, first), handoff._open(prompt, second)
    assert staging(prompt) is None  # which one is processing it: unknown, so commit at once
    handoff._close(keys[0], first)
    assert staging(prompt) is second
    handoff._close(keys[1], second)
    assert handoff._by_prompt == {} and not second.open


def test_a_closed_hand_off_is_not_found() -> None:
    prompt = {"prompt": "hi"}
    mine = Handoff()
    handoff._open(prompt, mine)
    mine.open = False
    assert staging(prompt) is None
    handoff._by_prompt.clear()
