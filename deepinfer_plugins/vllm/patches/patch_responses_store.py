"""Bound vLLM's in-memory Responses store (see the ledger in __init__.py)."""

from __future__ import annotations

import os
from collections import OrderedDict

from ... import envs

_PATCHED_FLAG = "_deepinfer_patched"
STORES = ("response_store", "msg_store", "event_store")


class BoundedStore(OrderedDict):
    """A dict that keeps the ``capacity`` most recently written keys: writing a key makes it the newest, and a
    write past the capacity forgets the oldest."""

    def __init__(self, capacity: int, items=()):
        self.capacity = capacity
        super().__init__(items)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)


def store_enabled() -> bool:
    return os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0").strip() not in ("", "0")


def apply() -> bool:
    if not store_enabled():
        return False
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    original = OpenAIServingResponses.__init__
    if getattr(original, _PATCHED_FLAG, False):
        return True
    capacity = envs.responses_store_size()

    def bounded_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for name in STORES:
            setattr(self, name, BoundedStore(capacity, getattr(self, name)))

    setattr(bounded_init, _PATCHED_FLAG, True)
    OpenAIServingResponses.__init__ = bounded_init
    return True
