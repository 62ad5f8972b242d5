"""Which items of the cache lookup in progress came without data (``drift_guard.context``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_mmcache_fix.drift_guard.context import sent_without_data


def test_an_item_sent_by_its_uuid_only_is_found_by_its_key() -> None:
    lookup = ({"image": [None, b"png"], "video": [None]}, {"image": ["a", "b"], "video": ["v"]})
    assert sent_without_data(lookup, "a") and sent_without_data(lookup, "v")
    assert not sent_without_data(lookup, "b")  # it has its data: the guard may have it sent
    assert not sent_without_data(lookup, "absent")
    assert not sent_without_data(None, "a")  # no lookup in progress


def test_a_key_that_also_comes_with_data_in_the_same_request_can_be_sent() -> None:
    assert not sent_without_data(({"image": [None, b"png"]}, {"image": ["a", "a"]}), "a")


def test_an_unreadable_lookup_is_not_taken_for_one_without_data() -> None:
    class Broken(dict):
        def __getitem__(self, key: object) -> object:
            raise RuntimeError("a layout this code does not know")

    assert not sent_without_data((Broken(), {"image": ["a"]}), "a")
    assert not sent_without_data(({"image": []}, {"image": ["a"]}), "a")  # IndexError
    assert not sent_without_data(("not", "a mapping"), "a")


@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), max_size=6))
def test_only_a_key_every_occurrence_of_which_lacks_data(items: list[tuple[str, bool]]) -> None:
    lookup = (
        {"image": [None if empty else b"x" for _, empty in items]},
        {"image": [k for k, _ in items]},
    )
    for key in "abc":
        flags = [empty for k, empty in items if k == key]
        assert sent_without_data(lookup, key) == (bool(flags) and all(flags))
