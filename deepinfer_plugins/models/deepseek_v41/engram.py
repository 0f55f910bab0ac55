"""Engram conditional memory: n-gram hashed lookups into large FP8 tables, gated into every residual stream.

Hashes depend only on token ids (docs/model.md#hash), so they are computed once per forward for all Engram layers,
before any layer runs; the tables could live in host memory and be prefetched. The gate compares each stream
with a learned key of the looked-up memory and adds the memory's value where they agree (docs/model.md#gate).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ... import ops
from ...ops.cache import to_device
from .args import ModelArgs
from .linear import Linear


class EngramTable(nn.Module):
    """Rows of FP8 E4M3 with one E8M0 scale per 32 columns: ``weight`` [rows, width], ``scale`` [rows, blocks]."""

    def __init__(self, rows: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, width, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(rows, -(-width // 32), dtype=torch.float8_e8m0fnu),
                                  requires_grad=False)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [n, columns] -> [n, columns, width]: one op, so a kernel reads only the looked-up rows' bytes."""
        return ops.engram_gather(self.weight, self.scale, ids, dtype)


class Engram(nn.Module):
    def __init__(self, args: ModelArgs, table: int, dtype: torch.dtype):
        super().__init__()
        self.table, self.eps, self.hc = table, args.rms_norm_eps, args.hc_mult
        columns = (args.engram_max_ngram_size - 1) * args.engram_n_heads
        self.embed = EngramTable(args.engram_num_embeddings[table], args.engram_head_dim)
        self.wkv = Linear(columns * args.engram_head_dim, (args.hc_mult + 1) * args.hidden_size, "fp8")
        self.q_weight = nn.Parameter(torch.empty(args.hc_mult, args.hidden_size, dtype=dtype), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(args.hc_mult, args.hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor, image_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """streams [n, S, d], row_ids [n, columns] -> streams with the gated memory value added to each.
        Image-span rows (``image_rows`` [n] bool) take no memory: their gate is 0, done by zeroing the value."""
        d = streams.shape[-1]
        memory = self.embed(row_ids, streams.dtype).flatten(1)  # [n, columns * width]
        kv = self.wkv(memory)
        key = kv[:, : self.hc * d].unflatten(-1, (self.hc, d))  # [n, S, d]
        value = kv[:, self.hc * d:]  # [n, d]
        if image_rows is not None:
            value = value.masked_fill(image_rows[:, None], 0)
        w = self.q_weight.float() * self.k_weight.float()  # only the product of the two is ever used
        return ops.engram_gate(streams, key, value, w, self.eps)


class EngramHasher(nn.Module):
    """Table row ids for every position and Engram layer -> [n, n_tables, columns]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ngram = args.engram_max_ngram_size
        self.identity_map = args.engram_compressed_vocab_size == args.vocab_size
        self.register_buffer("token_map", torch.arange(args.vocab_size), persistent=False)
        self.pad_id, self.image_token_id = args.engram_pad_token_id, args.image_token_id
        self.register_buffer("multipliers", torch.tensor(args.engram_multipliers, dtype=torch.int64),
                             persistent=False)
        shape = (len(args.engram_layer_ids), self.ngram - 1, args.engram_n_heads)
        primes = torch.tensor(args.engram_primes, dtype=torch.int64).view(shape)
        offsets = (primes.flatten(1).cumsum(1) - primes.flatten(1)).view(shape)
        self.register_buffer("primes", primes, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)

    def set_token_map(self, token_map: torch.Tensor) -> None:
        self.token_map = token_map.to(self.token_map.device)
        self.identity_map = False

    def ngram_tokens(self, token_ids: torch.Tensor, histories: list[list[int] | torch.Tensor],
                     counts: list[int]) -> torch.Tensor:
        """Compressed ids of the tokens at t, t-1, ..., t-G+1 for each new token [n, G] of several sequences
        (``counts`` tokens each, in order, with the token ids that precede each in ``histories``); before a
        sequence's start the compressed pad id. Image-span tokens are dead (docs/model.md#vision): from the first
        one looking back, every slot is the pad id, as before a sequence's start. One gather for the whole batch."""
        keep = self.ngram - 1
        pads = torch.full((keep,), self.pad_id, dtype=torch.long, device=token_ids.device)
        pieces, row = [], 0
        for history, n in zip(histories, counts):
            history = torch.as_tensor(history, dtype=torch.long, device=token_ids.device)[-keep:] if keep else pads
            pieces += [pads[: keep - history.numel()], history, token_ids[row: row + n].long()]
            row += n
        sequences = torch.cat(pieces)  # each sequence as [keep earlier ids, its new tokens]
        # row i of sequence k sits at i + (k + 1) * keep in ``sequences``
        shift = torch.repeat_interleave(torch.arange(1, len(counts) + 1) * keep, torch.tensor(counts))
        last = torch.arange(row, device=token_ids.device) + to_device(shift, token_ids.device)
        grams = sequences[last[:, None] - torch.arange(self.ngram, device=token_ids.device)]  # raw ids [n, G]
        dead = (grams == self.image_token_id).cummax(dim=1).values
        return self.token_map[grams.masked_fill(dead, self.pad_id)]

    def forward(self, token_ids: torch.Tensor, histories: list[list[int] | torch.Tensor],
                counts: list[int]) -> torch.Tensor:
        grams = self.ngram_tokens(token_ids, histories, counts)
        return torch.stack([ops.engram_hash(grams, self.multipliers[t], self.primes[t], self.offsets[t])
                            for t in range(self.primes.shape[0])], dim=1)


_SPACE_SENTINEL = "\ue000"


@functools.lru_cache(maxsize=1)
def _token_text_normalizer():
    """The normalisation of docs/model.md#token-map with the ``tokenizers`` library's own normalizers, whose
    notions of accents (every combining mark) and of stripping (space-like characters only, not ASCII control
    characters) the released token map was built with; Python's ``unicodedata`` / ``str.strip`` give 1,364 different keys on the V4 vocabulary."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def normalize_token_text(text: str) -> str:
    """NFKC, NFD, drop accents, lowercase, collapse whitespace runs, strip (a lone space survives)."""
    return _token_text_normalizer().normalize_str(text)


def compressed_token_map(tokenizer, expected_size: int) -> torch.Tensor:
    """token id -> compressed id, first-seen order over ids (docs/model.md#token-map); needs a
    ``tokenizers.Tokenizer``."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    by_id = {i: tok for tok, i in vocab.items()}
    keys: dict[str, int] = {}
    mapping = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte: keyed by its raw token string, in the same key space
            key = by_id.get(token_id, "")
        else:
            key = normalize_token_text(text) or text
        mapping.append(keys.setdefault(key, len(keys)))
    if len(keys) != expected_size:
        raise ValueError(f"tokenizer yields {len(keys)} compressed token classes, "
                         f"config engram_compressed_vocab_size says {expected_size}")
    return torch.tensor(mapping, dtype=torch.long)
