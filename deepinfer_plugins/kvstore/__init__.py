"""Engine-neutral retained prefix cache on shared storage: unit files (unit.py) and the directory that holds,
finds, expires and evicts them (store.py). Engine adapters decide what a unit's arrays are and when to save."""

from .store import (AGENT_RETENTION_S, ANCHOR_TOKENS, CHAT_RETENTION_S, Counters, Found, PrefixKey, PrefixStore,
                    Retention, SweepResult)
from .unit import Array, UnitError, UnitHeader

__all__ = ["AGENT_RETENTION_S", "ANCHOR_TOKENS", "CHAT_RETENTION_S", "Array", "Counters", "Found", "PrefixKey",
           "PrefixStore", "Retention", "SweepResult", "UnitError", "UnitHeader"]
