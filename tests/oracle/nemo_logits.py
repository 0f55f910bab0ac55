#!/usr/bin/env python3
"""Differential-test oracle: full-sequence DeepSeek-V4.1 logits from NeMo AutoModel 0.7.0.

Run ONLY with the isolated oracle interpreter (see setup_oracle_venv.sh):

    .venv-oracle/bin/python tests/oracle/nemo_logits.py \
        --checkpoint DIR --ids IDS_JSON --out OUT.npy [--dtype float32] [--token-map-out MAP.npy]
        [--images IMAGES.npz [--tower-out EMBEDDINGS.npz]]

* ``DIR`` is an official-format checkpoint directory: nested HF ``config.json``
  (``text_config`` / ``vision_config``), ``model.safetensors.index.json`` plus shards
  (or a single ``model.safetensors``), official tensor names (no ``model.`` prefix), FP8
  E4M3 dense weights with E8M0 32x32 ``.scale`` tensors, packed FP4 routed experts with
  E8M0 [out, in/32] scales.
* ``IDS_JSON`` is a JSON file holding a flat list of token ids (one sequence) or an
  object ``{"input_ids": [...]}``. A literal JSON list on the command line is also accepted.
* ``OUT.npy`` receives float32 logits of shape [T, vocab].
* Engram's compressed token map is the identity when the config's ``engram_compressed_vocab_size`` equals its
  ``vocab_size``, and otherwise NeMo's own map from ``tokenizer.json`` in the checkpoint (or ``--tokenizer``);
  ``MAP.npy`` receives the int64 map the forward uses, one entry per token id.
* ``IMAGES.npz`` (implies ``--with-vision``) holds NeMo's processor tensors for the sequence: ``pixel_values``
  [all_patches, 3, p, p], ``image_grid_hws`` [images, 2] and ``vision_token_types`` [T] (-1 text, 0 start,
  1 embedding, 2 newline, 3 end), which NeMo checks form complete spans of its layout. ``EMBEDDINGS.npz`` then
  receives, per image ``image{i}``, the tower and aligner's output alone [cells, hidden], cells row-major.

The NeMo model is used purely as an external oracle; nothing from it is imported by the
deepinfer package. Execution is eager on CPU: attention backend "eager" (plain einsum +
softmax), per-expert loop MoE ("torch" experts, "torch" dispatcher), torch linears,
FP32 RMSNorm, torch Sinkhorn, torch RoPE, TorchDynamo disabled.
"""

from __future__ import annotations

import os

# Must be set before torch is imported: some NeMo activation helpers are @torch.compile'd.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402


class OracleError(RuntimeError):
    """A checkpoint/config/input problem reported to the user without a traceback."""


def _fail(message: str, code: int = 2) -> None:
    print(f"[nemo_logits] ERROR: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _log(message: str) -> None:
    print(f"[nemo_logits] {message}", flush=True)


def _read_ids(spec: str) -> list[int]:
    text = spec
    path = Path(spec)
    if path.is_file():
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OracleError(f"--ids must be a JSON file or JSON list of ints ({exc})") from exc
    if isinstance(data, dict):
        data = data.get("input_ids", data.get("ids"))
    if isinstance(data, list) and data and isinstance(data[0], list):
        if len(data) != 1:
            raise OracleError("--ids holds several sequences; the oracle runs exactly one")
        data = data[0]
    if not isinstance(data, list) or not data or not all(isinstance(v, int) and not isinstance(v, bool) for v in data):
        raise OracleError("--ids must be a non-empty flat list of integer token ids")
    return data


def _shard_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise OracleError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (ckpt / f).is_file()]
        if missing:
            raise OracleError(f"shards listed in {index.name} are missing: {missing[:5]}")
        return [ckpt / f for f in files]
    single = ckpt / "model.safetensors"
    if single.is_file():
        return [single]
    raise OracleError(f"{ckpt} has neither model.safetensors.index.json nor model.safetensors")


def _load_tensors(files: list[Path], keep) -> tuple[dict, list[str]]:
    from safetensors import safe_open

    tensors, skipped = {}, []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                if not keep(key):
                    skipped.append(key)
                    continue
                if key in tensors:
                    raise OracleError(f"tensor {key} occurs in more than one shard")
                tensors[key] = handle.get_tensor(key)
    return tensors, skipped


def _identity_token_map(vocab_size: int):
    def token_map(_tokenizer):
        return tuple(range(vocab_size)), vocab_size

    return token_map


def run(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]

    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41 import engram as nemo_engram
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    ckpt = Path(args.checkpoint)
    cfg_path = ckpt / "config.json"
    if not cfg_path.is_file():
        raise OracleError(f"{cfg_path} not found")
    raw = json.loads(cfg_path.read_text())
    if "text_config" not in raw:
        raise OracleError("config.json is not the nested V4.1 HF layout (no text_config)")
    if raw.get("model_type") not in (None, "deepseek_v41"):
        raise OracleError(f"config model_type is {raw.get('model_type')!r}, expected 'deepseek_v41'")
    raw = dict(raw)
    text = dict(raw.pop("text_config"))
    vision = dict(raw.pop("vision_config", {}) or {})
    text["dtype"] = args.dtype
    text.pop("torch_dtype", None)
    raw.pop("torch_dtype", None)
    raw["dtype"] = args.dtype
    if args.images:
        args.with_vision = True
    if not args.with_vision:
        vision["num_hidden_layers"] = 0  # text-only oracle: the vision tower is never run
    raw.pop("model_type", None)
    try:
        config = DeepseekV41Config(text_config=text, vision_config=vision, **raw)
    except Exception as exc:  # noqa: BLE001
        raise OracleError(f"NeMo rejected config.json: {exc}") from exc
    config._name_or_path = str(ckpt)
    tc = config.text_config

    ids = _read_ids(args.ids)
    bad = [v for v in ids if not 0 <= v < tc.vocab_size]
    if bad:
        raise OracleError(f"token ids outside [0, {tc.vocab_size}): {bad[:8]}")

    # The compressed token map follows the config, as in deepinfer: compressed vocab == vocab means the identity
    # map (the convention of the small-vocabulary test presets; NeMo has none, so the harness supplies it), any
    # other size means NeMo's own tokenizer-derived map, built by NeMo from the fast tokenizer.
    tokenizer = None
    engram_active = any(i < tc.num_hidden_layers for i in tc.engram_layer_ids)
    if engram_active:
        identity = tc.engram_compressed_vocab_size == tc.vocab_size
        if args.engram_identity_map and not identity:
            raise OracleError(
                "--engram-identity-map is only valid when engram_compressed_vocab_size "
                f"({tc.engram_compressed_vocab_size}) == vocab_size ({tc.vocab_size})"
            )
        if identity:
            _log("Engram: identity compressed-token map (compressed vocab == vocab)")
            nemo_engram._compressed_token_map = _identity_token_map(tc.vocab_size)
            tokenizer = object()  # never inspected once the map is patched
        else:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            tok_dir = Path(args.tokenizer) if args.tokenizer else ckpt
            if not (tok_dir / "tokenizer.json").is_file():
                raise OracleError(
                    f"Engram's compressed vocab ({tc.engram_compressed_vocab_size}) differs from the vocab "
                    f"({tc.vocab_size}), so NeMo builds the token map from the tokenizer, and {tok_dir} has no "
                    "tokenizer.json; pass --tokenizer DIR"
                )
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), use_fast=True, trust_remote_code=False)
            except Exception as exc:  # noqa: BLE001
                raise OracleError(f"could not load the fast tokenizer from {tok_dir}: {exc}") from exc
            if not isinstance(tokenizer, PreTrainedTokenizerFast):
                raise OracleError("Engram hashing requires a fast tokenizer")
            _log(f"Engram: NeMo's tokenizer-derived compressed-token map from {tok_dir}")
    elif args.token_map_out:
        raise OracleError("--token-map-out: the config has no active Engram layer")

    backend = BackendConfig(
        attn="eager",
        linear="torch",
        rms_norm="torch_fp32",
        rope="torch",
        rope_fusion=False,
        experts="torch",
        dispatcher="torch",
        fake_balanced_gate=False,
        enable_hf_state_dict_adapter=True,
    )
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=tokenizer)
    model.to_empty(device="cpu")
    # Derived (non-persistent) integer buffers are not in the checkpoint: rebuild them.
    if model.model.engram_hash is not None:
        model.model.engram_hash.init_weights()
    model.eval()
    if args.token_map_out:
        token_map = model.model.engram_hash.token_map.numpy().astype(np.int64)
        Path(args.token_map_out).parent.mkdir(parents=True, exist_ok=True)
        np.save(args.token_map_out, token_map)
        _log(f"saved the token map the forward uses ({token_map.size} ids, {len(np.unique(token_map))} classes) "
             f"to {args.token_map_out}")
    expected = model.state_dict()
    _log(f"built NeMo DeepseekV41ForCausalLM ({len(expected)} tensors) in {time.perf_counter() - t0:.2f}s")

    def keep(key: str) -> bool:
        if key.startswith("mtp."):
            return False  # DSpark draft: not part of the backbone forward
        if not args.with_vision and (
            key.startswith(("vision.", "aligner.")) or key in ("image_start", "image_end", "image_newline")
        ):
            return False
        return key != "image_pad"  # present in the release, unused by V4.1

    t0 = time.perf_counter()
    files = _shard_files(ckpt)
    hf_state, skipped = _load_tensors(files, keep)
    _log(
        f"read {len(hf_state)} tensors from {len(files)} shard(s) in {time.perf_counter() - t0:.2f}s "
        f"(ignored {len(skipped)}: {sorted({k.split('.')[0] for k in skipped})})"
    )
    for key, value in hf_state.items():
        if key.endswith(".scale") and value.dtype != torch.float8_e8m0fnu:
            raise OracleError(f"{key} has dtype {value.dtype}; official scales are float8_e8m0fnu")
    t0 = time.perf_counter()
    try:
        native = model.state_dict_adapter.from_hf(hf_state)
    except Exception as exc:  # noqa: BLE001
        raise OracleError(f"NeMo state-dict adapter failed: {type(exc).__name__}: {exc}") from exc
    missing = sorted(set(expected) - set(native))
    unexpected = sorted(set(native) - set(expected))
    if missing or unexpected:
        if sum(k.startswith("model.model.") or k.startswith("model.head.") for k in unexpected):
            _log("hint: official tensor names carry no 'model.' prefix (e.g. 'embed.weight', 'layers.0.attn.wq_a.weight')")
        raise OracleError(
            f"checkpoint does not match the NeMo module tree: {len(missing)} missing "
            f"(e.g. {missing[:6]}), {len(unexpected)} unexpected (e.g. {unexpected[:6]})"
        )
    shape_errors = [
        f"{k}: checkpoint {tuple(native[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if tuple(native[k].shape) != tuple(expected[k].shape)
    ]
    if shape_errors:
        raise OracleError("shape mismatch after conversion: " + "; ".join(shape_errors[:8]))
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in native.items()}, strict=True)
    nonfinite = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if nonfinite:
        raise OracleError(f"non-finite weights after dequantisation: {nonfinite[:6]}")
    _log(f"converted + loaded weights in {time.perf_counter() - t0:.2f}s")

    input_ids = torch.tensor([ids], dtype=torch.long)
    image_inputs = {}
    if args.images:
        images = np.load(args.images)
        image_inputs = {
            "pixel_values": torch.from_numpy(images["pixel_values"]).to(dtype),
            "image_grid_hws": torch.from_numpy(images["image_grid_hws"]).long(),
            "vision_token_types": torch.from_numpy(images["vision_token_types"]).long()[None],
        }
        if image_inputs["vision_token_types"].shape != input_ids.shape:
            raise OracleError("vision_token_types must have one entry per token id")
        if args.tower_out:
            _save_image_embeddings(model.model, image_inputs, args.tower_out)
    t0 = time.perf_counter()
    output = model(input_ids, output_hidden_states=bool(args.hidden_out), **image_inputs)
    forward_s = time.perf_counter() - t0
    if args.hidden_out:
        # the 4 residual streams entering each block (before that block's Engram, if any)
        streams = {f"block{i:02d}_in": h[0].float().numpy() for i, h in enumerate(output.hidden_states)}
        Path(args.hidden_out).parent.mkdir(parents=True, exist_ok=True)
        np.savez(args.hidden_out, **streams)
        _log(f"saved {len(streams)} residual-stream tensors [T, hc_mult, hidden] to {args.hidden_out}")
    logits = output.logits[0].float().numpy()
    if logits.shape != (len(ids), tc.vocab_size):
        raise OracleError(f"unexpected logits shape {logits.shape}")
    if not np.isfinite(logits).all():
        raise OracleError("logits contain non-finite values")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, logits.astype(np.float32))
    _log(
        f"forward T={len(ids)} dtype={args.dtype} in {forward_s:.2f}s -> {out} {logits.shape} "
        f"(argmax[-1]={int(logits[-1].argmax())}, |logits| max {float(np.abs(logits).max()):.4g})"
    )


def _save_image_embeddings(backbone, image_inputs: dict, out: str) -> None:
    """Each image through NeMo's tower and aligner alone -> its LM embeddings [cells, hidden], cells row-major."""
    import numpy as np

    embeddings, start = {}, 0
    for i, (n_h, n_w) in enumerate(image_inputs["image_grid_hws"].tolist()):
        patches = image_inputs["pixel_values"][start: start + n_h * n_w]
        start += n_h * n_w
        cells = backbone.aligner(backbone.vision(patches, n_h, n_w), n_h, n_w)
        embeddings[f"image{i}"] = cells.float().numpy()
    np.savez(out, **embeddings)
    _log(f"saved the tower + aligner embeddings of {len(embeddings)} images to {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="official-format V4.1 checkpoint directory")
    parser.add_argument("--ids", required=True, help="JSON file (or literal JSON list) with one sequence of ids")
    parser.add_argument("--out", required=True, help="output .npy path for float32 logits [T, vocab]")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="NeMo compute dtype")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="fast-tokenizer dir for Engram when compressed vocab != vocab (default: the checkpoint dir)",
    )
    parser.add_argument(
        "--engram-identity-map",
        action="store_true",
        help="require the identity compressed-token map (compressed vocab == vocab; that is also the default then)",
    )
    parser.add_argument(
        "--token-map-out", default=None, help="optional .npy with the int64 compressed token map the forward uses"
    )
    parser.add_argument(
        "--hidden-out", default=None, help="optional .npz with the 4-stream residual entering every block"
    )
    parser.add_argument("--with-vision", action="store_true", help="also build/load vision tower tensors")
    parser.add_argument("--images", default=None, help="optional .npz of image inputs for the sequence (see above)")
    parser.add_argument("--tower-out", default=None, help="optional .npz: each image's tower + aligner output")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--traceback", action="store_true", help="print a full traceback on failure")
    args = parser.parse_args(argv)
    if os.environ.get("TORCHDYNAMO_DISABLE") != "1":
        _log("warning: TORCHDYNAMO_DISABLE is not 1; compiled helpers may not run eagerly")
    try:
        run(args)
    except OracleError as exc:
        if args.traceback:
            traceback.print_exc()
        _fail(str(exc))
    except ImportError as exc:
        traceback.print_exc()
        _fail(f"import failed ({exc}); run with .venv-oracle/bin/python (tests/oracle/setup_oracle_venv.sh)", 3)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        _fail(f"oracle run failed: {type(exc).__name__}: {exc}", 1)


if __name__ == "__main__":
    main()
