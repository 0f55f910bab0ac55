"""The byte layout of V4.1's caches in vLLM's paged memory (deepinfer_plugins/vllm/cache.py) at the full config.

Guarantees: every cache owner is a uint8 table whose page equals the window page (so vLLM pools them without
growing any group's blocks); the window row is the 528-byte fp8_window record plus token id and position; a
compressed row holds the 288-byte nvfp4 entry and the 68-byte mxfp4 index key of every KV source of its ratio,
at disjoint columns; the compressor inputs of the ratio-2 sources sit in a sliding window of 2 tokens, so the
bytes a request keeps per token of context are those of the compressed caches alone. The served behaviour of
these caches is covered by the other tests here (test_packed_sources.py for several sources of one ratio).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer_plugins.models.deepseek_v41.args import ModelArgs, preset_config
from deepinfer_plugins.vllm.cache import make_cache_owners, make_dspark_feature_owner, paged_layout, window_width


def fake_vllm_config(block_size: int):
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size),
                           compilation_config=SimpleNamespace(static_forward_context={}))


@pytest.mark.parametrize("block_size", [64, 256])
def test_full_config_caches_are_records_with_one_page_size(block_size):
    args = ModelArgs.from_hf_config(preset_config("full"))
    config = fake_vllm_config(block_size)
    windows, compressed, inputs = make_cache_owners(args, config, "model.")
    draft = make_dspark_feature_owner(args, config, "model.", num_speculative_tokens=5)
    owners = [*windows, *compressed.values(), *inputs.values(), draft]
    assert all(o.spec.dtype == torch.uint8 for o in owners)
    window_page = windows[0].spec.page_size_bytes
    assert windows[0].spec.head_size == 544  # 512 E4M3 + 16 UE8M0 scale bytes, int32 token id, int32 position
    assert window_page == block_size * 544
    assert {o.spec.page_size_bytes for o in owners} == {window_page}

    assert {r: o.sources for r, o in compressed.items()} == {"1": [20], "2": [2, 8, 14]}
    assert compressed["1"].spec.head_size == 544  # 288 + 68 bytes of records, padded to the page rule
    assert compressed["2"].spec.head_size == 1088  # 3 x (288 + 68) = 1068 bytes: one row holds all three sources
    for ratio, owner in compressed.items():
        assert owner.spec.block_size % int(ratio) == 0 and owner.spec.tokens_per_state == int(ratio)
        owner.bind_kv_cache(torch.zeros(2, owner.spec.block_size // int(ratio), owner.spec.head_size,
                                        dtype=torch.uint8))
        columns = [(c.data_ptr() - owner.rows().data_ptr(), c.shape[1]) for s in owner.sources
                   for c in (owner.entry_columns(s), owner.key_columns(s))]
        assert sorted(w for _, w in columns) == sorted([288, 68] * len(owner.sources))
        spans = sorted((start, start + width) for start, width in columns)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])) and spans[-1][1] <= 1088
    assert sorted(int(s) for s in inputs) == [2, 8, 14]
    for owner in inputs.values():
        assert owner.spec.sliding_window == 2 and owner.spec.head_size >= 2 * 512 * 4 + 4

    persistent = sum(o.spec.head_size / int(r) for r, o in compressed.items())
    assert persistent == 1088 / 2 + 544 == 1088  # bytes per token of context; docs/model.md's unpadded budget is 890


@pytest.mark.parametrize("preset", ["tiny", "full"])
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("tokens_per_row", [1, 2])
@pytest.mark.parametrize("needed", [1, 5, 33, 100, 356, 544, 4100, 10000])
def test_paged_layout_keeps_the_window_page(preset, block_size, tokens_per_row, needed):
    """Rows fit, stay 16-byte aligned, and a block holds whole rows; the page equals the window page unless the
    block could not be divided (then the block size is unchanged and vLLM grows the other groups' blocks)."""
    args = ModelArgs.from_hf_config(preset_config(preset))
    width, block = paged_layout(args, needed, tokens_per_row, block_size)
    assert width >= needed and width % 16 == 0 and block % tokens_per_row == 0
    page = block // tokens_per_row * width
    window_page = block_size * window_width(args)
    assert page == window_page or (block == block_size and page % window_page == 0)
