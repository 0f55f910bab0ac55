"""``DeepInferStoreConnector``: vLLM's KV connector for the retained prefix cache on shared storage (kvstore/).

What a unit holds here: every cache group's blocks that the model reads to resume at the unit's boundary, for
every cache of the group (window, compressed, compressor inputs, and the DSpark context when speculation is on),
as the bytes vLLM's paged memory holds. Sliding-window groups keep only the blocks vLLM itself keeps at that
boundary (``get_num_skipped_tokens``), so a unit costs about the compressed cache plus one window per layer.

When it saves (docs/multi_replica.md#retained-prefix-cache): at the end of each prompt (the end of a user turn,
or of a tool result) and when a request finishes (the end of the model's output), the two boundaries the next turn
of a conversation starts from. When it loads: on admission, the longest unit that is a prefix of the prompt and
longer than the local prefix-cache hit; loading is synchronous, before the step's forward.

The scheduler side decides (lookups, retention, which blocks) and sends jobs in the step's metadata; the worker
side copies between vLLM's blocks and files. Only tensor-parallel rank 0 writes: with one KV head our caches are
replicated across ranks, so every rank loads the same unit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.request import RequestStatus

from ..kvstore import PrefixKey, PrefixStore, Retention, UnitError
from ..kvstore import Array as UnitArray

logger = logging.getLogger("vllm.deepinfer.kvstore")  # under vLLM's configured logger: the server log shows it

CONNECTOR_NAME = "DeepInferStoreConnector"
DEFAULT_SWEEP_INTERVAL_S = 60.0
COUNTERS = ("hits", "hit_tokens", "misses", "bytes_read", "bytes_written", "units_written", "evictions",
            "expiries", "invalid")


@dataclass(frozen=True)
class StoreConfig:
    """``kv_connector_extra_config`` of the connector; every key is optional but ``store_dir``."""

    store_dir: str
    model_tag: str | None = None
    retention: Retention = Retention()
    capacity_bytes: int | None = None
    sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "StoreConfig":
        known = {"store_dir", "model_tag", "agent_retention_s", "chat_retention_s", "retention_s",
                 "capacity_bytes", "sweep_interval_s"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"{CONNECTOR_NAME}: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        if not extra.get("store_dir"):
            raise ValueError(f"{CONNECTOR_NAME} needs kv_connector_extra_config.store_dir (a directory every "
                             "replica mounts)")

        def seconds(name: str, default: float | None) -> float | None:
            value = extra.get(name, default)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{CONNECTOR_NAME}: {name} must be a number of seconds >= 0, got {value!r}")
            return float(value)

        base = Retention()
        retention = Retention(seconds("agent_retention_s", base.agent_s), seconds("chat_retention_s", base.chat_s),
                              seconds("retention_s", None))
        capacity = extra.get("capacity_bytes")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(f"{CONNECTOR_NAME}: capacity_bytes must be a positive integer, got {capacity!r}")
        interval = seconds("sweep_interval_s", DEFAULT_SWEEP_INTERVAL_S)
        if not interval:
            raise ValueError(f"{CONNECTOR_NAME}: sweep_interval_s must be > 0")
        return cls(str(extra["store_dir"]), extra.get("model_tag"), retention, capacity, interval)


@dataclass(frozen=True)
class Blocks:
    """One cache group's part of a job: the sequence's block indices and vLLM's block ids holding them."""

    group: int
    indices: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadJob:
    request_id: str
    prefix: str
    blocks: tuple[Blocks, ...]


@dataclass(frozen=True)
class SaveJob:
    request_id: str
    prefix: str
    anchor: str
    num_tokens: int
    retention_s: float
    blocks: tuple[Blocks, ...]
    finished: bool  # the request has finished and its blocks wait for this save


@dataclass
class StoreMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


class StoreStats(KVConnectorStats):
    """Counter deltas of one interval; scheduler and worker halves add up."""

    def reset(self):
        self.data = {name: 0 for name in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> "StoreStats":
        for name in COUNTERS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in COUNTERS)


class StorePromMetrics(KVConnectorPromMetrics):
    """``vllm:deepinfer_kv_store_<counter>_total`` per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name in COUNTERS:
            counter = self._counter_cls(name=f"vllm:deepinfer_kv_store_{name}",
                                        documentation=f"DeepInfer prefix store: {name.replace('_', ' ')}",
                                        labelnames=labelnames)
            self.counters[name] = {engine: counter.labels(*values)
                                   for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name in COUNTERS:
            amount = transfer_stats_data.get(name, 0)
            if amount:
                self.counters[name][engine_idx].inc(amount)


def model_tag(vllm_config, kv_cache_config) -> str:
    """Units of another model, checkpoint or cache layout are foreign: the tag digests config.json, the weight
    files' names and sizes (a checkpoint mounted at another path keeps its tag), and every cache's spec."""
    digest = hashlib.sha256()
    model_dir = Path(vllm_config.model_config.model)
    config = model_dir / "config.json"
    digest.update(config.read_bytes() if config.is_file() else str(vllm_config.model_config.model).encode())
    if model_dir.is_dir():
        for weights in sorted(model_dir.glob("*.safetensors")):
            digest.update(f"{weights.name}:{weights.stat().st_size};".encode())
    layout = [[type(group.kv_cache_spec).__name__, group.kv_cache_spec.block_size,
               group.kv_cache_spec.page_size_bytes, sorted(group.layer_names)]
              for group in kv_cache_config.kv_cache_groups]
    digest.update(json.dumps([layout, str(vllm_config.model_config.dtype),
                              vllm_config.parallel_config.tensor_parallel_size]).encode())
    return f"{model_dir.name or 'model'}-{digest.hexdigest()[:16]}"


def dsml_token_id(vllm_config) -> int | None:
    """The id of the DSML token: the recipe renders it into every prompt that defines tools or replays tool
    calls, which is what makes a request agent traffic."""
    from deepinfer_recipe.tokens import DEFAULT_SPECIAL_TOKENS, find_tokenizer_json
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(find_tokenizer_json(vllm_config.model_config.tokenizer))
    except Exception as error:  # noqa: BLE001 - a tokenizer we cannot read only costs the agent class
        logger.warning("kv store: no tokenizer.json (%s); every request gets the chat retention", error)
        return None
    return tokenizer.token_to_id(DEFAULT_SPECIAL_TOKENS.dsml)


def requested_retention(request) -> float | None:
    """A request's own retention, ``kv_transfer_params.retention_s`` (0: do not store)."""
    value = (request.kv_transfer_params or {}).get("retention_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        logger.warning("kv store: request %s: ignoring retention_s=%r (seconds >= 0 expected)",
                       request.request_id, value)
        return None
    return float(value)


def prefix_key(tag: str, request) -> PrefixKey:
    images = [(feature.mm_position.offset, feature.identifier) for feature in request.mm_features]
    salt = request.cache_salt or ""
    if request.lora_request is not None:
        salt += f"\0lora:{request.lora_request.lora_name}"
    return PrefixKey(tag, request.all_token_ids, images, salt)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class DeepInferStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = StoreConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.tag = self.config.model_tag or model_tag(vllm_config, kv_cache_config)
        self.store = PrefixStore(self.config.store_dir, self.tag, logger)
        self.group_block_sizes = [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups]
        self.group_layers = [list(group.layer_names) for group in kv_cache_config.kv_cache_groups]
        self.num_blocks = kv_cache_config.num_blocks
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config)
        else:
            self._init_worker()

    @property
    def requires_kv_delivery(self) -> bool:
        """A save that never happens is a later cache miss, not lost output: nothing must be delivered."""
        return False

    # ---- scheduler side -------------------------------------------------------------------------------------

    def _init_scheduler(self, vllm_config) -> None:
        self.dsml = dsml_token_id(vllm_config)
        self.requests: dict[str, Any] = {}
        self.found: dict[str, tuple[int, Any]] = {}  # request id -> (local tokens asked with, Found or None)
        self.saved: dict[str, set[int]] = {}  # request id -> boundaries saved or found on file
        self.pending = StoreMetadata()
        self.null_block_id = 0
        self.stop_sweeping = threading.Event()
        threading.Thread(target=self._sweep_forever, name="deepinfer-kv-sweeper", daemon=True).start()
        logger.info("kv store: %s (tag %s), retention agent %.0f s / chat %.0f s%s, capacity %s",
                    self.store.dir, self.tag, self.config.retention.agent_s, self.config.retention.chat_s,
                    "" if self.config.retention.fixed_s is None else f" / fixed {self.config.retention.fixed_s} s",
                    self.config.capacity_bytes or "unlimited")

    def _sweep_forever(self) -> None:
        while not self.stop_sweeping.wait(self.config.sweep_interval_s):
            try:
                self.store.sweep(self.config.capacity_bytes)
            except OSError as error:
                logger.warning("kv store: sweep failed: %s", error)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self.null_block_id = gpu_block_pool.null_block.block_id

    def on_new_request(self, request) -> None:
        self.requests[request.request_id] = request

    def _first_needed(self, group: int, num_tokens: int) -> int:
        """The first block index a group reads when resuming at ``num_tokens`` (below it, vLLM frees them)."""
        manager = self._kv_cache_manager.coordinator.single_type_managers[group]
        return manager.get_num_skipped_tokens(num_tokens) // self.group_block_sizes[group]

    def _blocks(self, block_ids: tuple[list[int], ...], num_tokens: int, local_tokens: int = 0) -> list[Blocks]:
        out = []
        for group, ids in enumerate(block_ids):
            size = self.group_block_sizes[group]
            first = max(self._first_needed(group, num_tokens), local_tokens // size)
            indices = [i for i in range(first, min(_cdiv(num_tokens, size), len(ids)))
                       if ids[i] != self.null_block_id]
            out.append(Blocks(group, tuple(indices), tuple(ids[i] for i in indices)))
        return out

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        asked = self.found.get(request.request_id)
        if asked is None or asked[0] != num_computed_tokens:
            # the last prompt token is always computed: its logits start the answer
            longest = request.num_prompt_tokens - 1
            found = None
            if request.prompt_token_ids is not None and longest > num_computed_tokens:
                found = self.store.find(prefix_key(self.tag, request), longest, num_computed_tokens)
            self.found[request.request_id] = asked = (num_computed_tokens, found)
        found = asked[1]
        return (found.num_tokens - num_computed_tokens if found else 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        asked = self.found.pop(request.request_id, None)
        if asked is None:  # a request resuming after a transfer or preemption: it asked nothing
            return
        if num_external_tokens == 0:
            self.store.counters.add(misses=1)
            return
        local, found = asked
        self.pending.loads.append(LoadJob(request.request_id, found.prefix,
                                          tuple(self._blocks(blocks.get_block_ids(), found.num_tokens, local))))
        self.store.touch(found.prefix)
        self.saved.setdefault(request.request_id, set()).add(found.num_tokens)
        self.store.counters.add(hits=1, hit_tokens=num_external_tokens)

    def _save_job(self, request, num_tokens: int, block_ids, finished: bool) -> SaveJob | None:
        """A save of the request's first ``num_tokens`` tokens, or None where there is nothing to write."""
        boundaries = self.saved.setdefault(request.request_id, set())
        if request.prompt_token_ids is None:  # prompt embeddings: no token ids to address a unit by
            return None
        agent = self.dsml is not None and self.dsml in request.prompt_token_ids
        retention = self.config.retention.seconds(agent, requested_retention(request))
        if num_tokens <= 0 or num_tokens in boundaries or retention <= 0:
            return None
        boundaries.add(num_tokens)
        key = prefix_key(self.tag, request)
        prefix = key.digest(num_tokens)
        if self.store.holds(prefix):
            self.store.touch(prefix)
            return None
        return SaveJob(request.request_id, prefix, key.anchor(num_tokens), num_tokens, retention,
                       tuple(self._blocks(block_ids, num_tokens)), finished)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            before, prompt = request.num_computed_tokens, request.num_prompt_tokens
            if before < prompt == before + scheduled:  # this step computes the end of the prompt
                job = self._save_job(request, prompt, self._kv_cache_manager.get_block_ids(request_id), False)
                if job is not None:
                    self.pending.saves.append(job)
        meta, self.pending = self.pending, StoreMetadata()
        return meta

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        self.requests.pop(request.request_id, None)
        self.found.pop(request.request_id, None)
        job = None
        computed_beyond_prompt = request.num_computed_tokens > request.num_prompt_tokens
        if computed_beyond_prompt and request.status != RequestStatus.FINISHED_ERROR:
            job = self._save_job(request, request.num_computed_tokens, block_ids, True)
        self.saved.pop(request.request_id, None)
        if job is None:
            return False, None
        self.pending.saves.append(job)
        return True, None

    # ---- worker side ----------------------------------------------------------------------------------------

    def _init_worker(self) -> None:
        self.caches: dict[str, torch.Tensor] = {}
        self.writes = get_tensor_model_parallel_rank() == 0
        self.load_errors: set[int] = set()
        self.saved_finished: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, tensor in kv_caches.items():
            if not tensor.is_contiguous():
                raise ValueError(f"{CONNECTOR_NAME}: cache {name} is not contiguous; its blocks cannot be "
                                 "copied as bytes (do not set a layer-outermost VLLM_KV_CACHE_LAYOUT)")
            self.caches[name] = tensor.view(torch.uint8).reshape(self.num_blocks, -1)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        for job in meta.loads:
            try:
                self._load(job)
            except (UnitError, KeyError, ValueError, RuntimeError) as error:
                logger.warning("kv store: request %s: unit %s could not be loaded (%s); its blocks are recomputed "
                               "or the request fails, as kv_load_failure_policy says", job.request_id, job.prefix,
                               error)
                self.store.counters.add(invalid=1)
                self.load_errors.update(i for part in job.blocks for i in part.block_ids)

    def _load(self, job: LoadJob) -> None:
        header, payloads = self.store.read(job.prefix)
        stored = {array.name: array for array in header.arrays}
        for part in job.blocks:
            if not part.indices:
                continue
            for name in self.group_layers[part.group]:
                if name not in self.caches:
                    continue
                cache, array = self.caches[name], stored[name]  # KeyError: the unit lacks this cache
                if array.block_bytes != cache.shape[1]:
                    raise ValueError(f"{name}: blocks of {array.block_bytes} bytes, the cache's are "
                                     f"{cache.shape[1]}")
                at = [array.blocks.index(i) for i in part.indices]  # ValueError: the unit lacks a needed block
                rows = torch.frombuffer(bytearray(payloads[name]), dtype=torch.uint8).view(-1, array.block_bytes)
                cache[torch.tensor(part.block_ids, dtype=torch.long)] = rows[torch.tensor(at)].to(cache.device)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for job in meta.saves:
            if self.writes:
                try:
                    self._save(job)
                except OSError as error:
                    logger.warning("kv store: request %s: unit of %d tokens not stored: %s", job.request_id,
                                   job.num_tokens, error)
            if job.finished:
                self.saved_finished.add(job.request_id)

    def _save(self, job: SaveJob) -> None:
        arrays, payloads = [], []
        for part in job.blocks:
            for name in self.group_layers[part.group]:
                if name not in self.caches:
                    continue
                cache = self.caches[name]
                rows = cache[torch.tensor(part.block_ids, dtype=torch.long)] if part.indices else cache[:0]
                arrays.append(UnitArray(name, cache.shape[1], part.indices))
                payloads.append(rows.cpu().numpy().tobytes())
        self.store.write(job.prefix, job.anchor, job.num_tokens, job.retention_s, arrays, payloads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self.saved_finished = self.saved_finished, set()
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # ---- both sides -----------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = StoreStats(data=self.store.counters.take())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return StoreStats(data=dict(data)) if data is not None else StoreStats(data={name: 0 for name in COUNTERS})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return StorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.SCHEDULER:
            self.stop_sweeping.set()

