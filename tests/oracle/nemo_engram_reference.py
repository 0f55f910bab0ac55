#!/usr/bin/env python3
"""Reference Engram artefacts from NeMo AutoModel 0.7.0 (test oracle only).

    .venv-oracle/bin/python tests/oracle/nemo_engram_reference.py \
        --config CONFIG_JSON_OR_CKPT_DIR [--tokenizer DIR | --identity-map] \
        [--token-map-out MAP.npy] [--ids IDS_JSON --hashes-out HASHES.npy]

* ``MAP.npy``: int64 [len(tokenizer)] compressed token id of every raw token id (docs/model.md#token-map).
* ``HASHES.npy``: int64 [T, n_engram_layers, (max_ngram-1)*n_heads] logical table rows for one
  sequence (docs/model.md#hash), in NeMo's column order (order 2 heads, order 3 heads, ...).
Also prints the per-layer primes, offsets and multipliers. Needs no checkpoint weights.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="nested V4.1 config.json, or a directory containing it")
    parser.add_argument("--tokenizer", default=None, help="fast-tokenizer directory (tokenizer.json)")
    parser.add_argument("--identity-map", action="store_true", help="identity map (compressed vocab == vocab)")
    parser.add_argument("--token-map-out", default=None)
    parser.add_argument("--ids", default=None, help="JSON list of token ids (one sequence)")
    parser.add_argument("--hashes-out", default=None)
    args = parser.parse_args()

    import numpy as np
    import torch

    from nemo_automodel.components.models.deepseek_v41 import engram as nemo_engram
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    cfg_path = Path(args.config)
    if cfg_path.is_dir():
        cfg_path = cfg_path / "config.json"
    raw = json.loads(cfg_path.read_text())
    text = dict(raw.get("text_config", raw))
    text.pop("model_type", None)
    tc = DeepseekV41TextConfig(**text)
    if args.identity_map:
        nemo_engram._compressed_token_map = lambda _t: (tuple(range(tc.vocab_size)), tc.vocab_size)
        tokenizer = object()
    elif args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, use_fast=True)
    else:
        sys.exit("[nemo_engram_reference] ERROR: pass --tokenizer DIR or --identity-map")
    try:
        hasher = nemo_engram.DeepseekV41NgramHash(tc, tokenizer)
    except ValueError as exc:
        sys.exit(f"[nemo_engram_reference] ERROR: {exc}")
    print(f"compressed vocab {len(set(hasher._token_map_values))}, pad id -> {hasher.pad_id}")
    for layer, primes, offsets, mults in zip(
        hasher.layer_ids, hasher._prime_values, hasher._offset_values, hasher._multiplier_values
    ):
        print(f"layer {layer}: rows {sum(primes)} multipliers {list(mults)}")
        print(f"  primes {list(primes)}")
        print(f"  offsets {list(offsets)}")
    if args.token_map_out:
        np.save(args.token_map_out, np.asarray(hasher._token_map_values, dtype=np.int64))
        print(f"token map -> {args.token_map_out}")
    if args.ids:
        spec = Path(args.ids).read_text() if Path(args.ids).is_file() else args.ids
        ids = json.loads(spec)
        ids = ids.get("input_ids", ids) if isinstance(ids, dict) else ids
        hashes = hasher(torch.tensor([ids], dtype=torch.long))[0].numpy()
        if args.hashes_out:
            np.save(args.hashes_out, hashes.astype(np.int64))
            print(f"hashes {hashes.shape} -> {args.hashes_out}")
        else:
            print(hashes)


if __name__ == "__main__":
    main()
