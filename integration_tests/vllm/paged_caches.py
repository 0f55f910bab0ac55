"""The vLLM adapter's paged caches in-process, without an engine: cache owners bound to small tensors with every
request's blocks drawn at random, and one step run the way the adapter's forward runs it (``paged_chunks``, the
core model, the stored-position audit). Used by test_paged_state.py and benchmarks/paged_step.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deepinfer_plugins.vllm.cache import PagedMetadata, StoredPositions, make_cache_owners, window_meta_at
from deepinfer_plugins.vllm.model import paged_chunks

BLOCK_SIZE = 16


class PagedCaches:
    """The adapter's cache owners over small tensors; each request's blocks of each owner drawn at random.
    ``one_window_table``: every layer's window cache reads one block table, as when vLLM puts them in one cache
    group (by default each has its own, the harder case for the adapter)."""

    def __init__(self, args, num_requests: int, max_tokens: int, generator: torch.Generator,
                 one_window_table: bool = False):
        config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
                                 compilation_config=SimpleNamespace(static_forward_context={}))
        self.static_forward_context = config.compilation_config.static_forward_context
        self.args, self.num_requests = args, num_requests
        self.windows, self.compressed, self.inputs = make_cache_owners(args, config, "model.")
        self.owners = [*self.windows, *self.compressed.values(), *self.inputs.values()]
        self.tables = {}
        for owner in self.owners:
            tokens_per_row = getattr(owner.spec, "tokens_per_state", 1)
            rows_per_block = owner.spec.block_size // tokens_per_row
            blocks = -(-max_tokens // owner.spec.block_size)
            owner.bind_kv_cache(torch.randint(0, 256, (num_requests * blocks + 3, rows_per_block, owner.spec.head_size),
                                              dtype=torch.uint8, generator=generator))  # stale bytes everywhere
            order = torch.randperm(num_requests * blocks + 3, generator=generator)[: num_requests * blocks]
            self.tables[owner.layer_name] = order.view(num_requests, blocks).to(torch.int32)
        if one_window_table:
            for owner in self.windows:
                self.tables[owner.layer_name] = self.tables[self.windows[0].layer_name]

    def step(self, model, work: dict[int, tuple[int, torch.Tensor]]) -> torch.Tensor:
        """work: request -> (start position, token ids) -> logits of every row, requests in ``work`` order."""
        input_ids, positions, metadata = self.batch(work)
        audit = StoredPositions()
        chunks, _ = paged_chunks(self.args, input_ids, positions, metadata, self.windows, self.compressed,
                                 self.inputs, audit)
        hidden = model.hidden_states(input_ids, chunks)
        audit.verify()
        return model.compute_logits(hidden)

    def batch(self, work: dict[int, tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """work (as for ``step``) -> (input ids, positions, metadata by cache name) of the step, as vLLM's runner
        and our metadata builder would give them."""
        requests = sorted(work)
        counts = [work[r][1].numel() if r in work else 0 for r in range(self.num_requests)]
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        input_ids = torch.cat([work[r][1] for r in requests])
        positions = torch.cat([work[r][0] + torch.arange(work[r][1].numel()) for r in requests])
        seq_lens = [work[r][0] + counts[r] if r in work else 0 for r in range(len(counts))]
        metadata = {name: PagedMetadata(table, starts, seq_lens, input_ids.numel())
                    for name, table in self.tables.items()}
        return input_ids, positions, metadata

    def window_positions(self, layer: int, request: int) -> tuple[torch.Tensor, callable]:
        """(int32 [slots, 2] token id and position columns of a layer's window cache, slot of a position)."""
        owner, meta_at = self.windows[layer], window_meta_at(self.args)
        row = self.tables[owner.layer_name][request]
        return owner.rows()[:, meta_at: meta_at + 8].view(torch.int32), lambda p: int(owner.slots(row, torch.tensor(p)))
