"""The bound on vLLM's Responses store (vllm/patches/patch_responses_store.py): it keeps the most recently
written entries up to its capacity, so a server with ``store`` on holds at most that many responses."""

import pytest

from deepinfer_plugins import envs
from deepinfer_plugins.vllm.patches.patch_responses_store import BoundedStore


def test_keeps_the_most_recently_written():
    store = BoundedStore(3)
    for key in "abcd":
        store[key] = key.upper()
    assert list(store) == ["b", "c", "d"] and store.get("a") is None
    store["b"] = "B2"  # rewriting (a background response finishing) makes it the newest
    store["e"] = "E"
    assert list(store) == ["d", "b", "e"] and store["b"] == "B2"


def test_takes_over_existing_entries_within_the_bound():
    assert list(BoundedStore(2, {"a": 1, "b": 2, "c": 3})) == ["b", "c"]


@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_size_must_be_a_positive_integer(monkeypatch, value):
    monkeypatch.setenv("DEEPINFER_RESPONSES_STORE_SIZE", value)
    with pytest.raises(ValueError, match="DEEPINFER_RESPONSES_STORE_SIZE"):
        envs.responses_store_size()
