"""Load an official-format V4.1 checkpoint: nested config.json + sharded safetensors with the release's names.

Module names mirror the official tensor names (spec §11), so the name table is the identity for the text
model; the drafter (``mtp.*``) loads when the model builds one, and the vision tower / image embeddings are
skipped until the vision issue lands. Quantised tensors are taken as stored (see linear.py). Every problem
raises ``CheckpointError`` naming the tensor and the shard, and nothing is half-loaded: the whole checkpoint is
checked against the model before any tensor is assigned.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .args import ConfigError, ModelArgs

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SKIPPED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline", "image_pad")


class CheckpointError(RuntimeError):
    """The checkpoint does not match the model its config describes."""


def shard_map(path: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index (or the single-file checkpoint)."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        missing_files = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing_files:
            example = next(name for name, f in weight_map.items() if f == missing_files[0])
            raise CheckpointError(f"{INDEX_FILE} points at missing shard file {missing_files[0]!r} "
                                  f"(e.g. for tensor {example!r})")
        return weight_map
    if (path / SINGLE_FILE).exists():
        with _open(path / SINGLE_FILE) as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for truncated or corrupt headers
        raise CheckpointError(f"shard {file.name}: cannot be read ({exc}); the file may be truncated") from None


def is_quantised(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)


def check_tensor(name: str, file: str, tensor_shape, tensor_dtype, expected: torch.Tensor) -> None:
    if tuple(tensor_shape) != tuple(expected.shape):
        raise CheckpointError(f"tensor {name!r} in {file}: shape {tuple(tensor_shape)}, but the config implies "
                              f"{tuple(expected.shape)}")
    if is_quantised(expected.dtype) or is_quantised(tensor_dtype):
        if tensor_dtype != expected.dtype:
            raise CheckpointError(f"tensor {name!r} in {file}: dtype {tensor_dtype}, expected {expected.dtype}")
    elif not tensor_dtype.is_floating_point:
        raise CheckpointError(f"tensor {name!r} in {file}: dtype {tensor_dtype}, expected a floating dtype")


def load_state_dict_checked(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    expected = model.state_dict()
    weight_map = shard_map(path)
    wanted = {n: f for n, f in weight_map.items() if not n.startswith(SKIPPED_PREFIXES)}
    skipped = len(weight_map) - len(wanted)
    if skipped:
        logger.info("checkpoint: skipping %d vision / image tensors (the vision tower is not implemented yet)",
                    skipped)
    drafter_built = any(n.startswith("mtp.") for n in expected)
    if not drafter_built:
        wanted = {n: f for n, f in wanted.items() if not n.startswith("mtp.")}
    unexpected = sorted(set(wanted) - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} in {wanted[unexpected[0]]} "
                              f"({len(unexpected)} unexpected in total) - not part of the model the config describes")
    missing = sorted(set(expected) - set(wanted))
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} ({len(missing)} missing in total): "
                              f"not listed in {INDEX_FILE if (path / INDEX_FILE).exists() else SINGLE_FILE}")
    by_file: dict[str, list[str]] = {}
    for name, file in wanted.items():
        by_file.setdefault(file, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for file in tqdm(sorted(by_file), desc="Loading checkpoint shards", unit="shard",
                     disable=len(by_file) < 2 and None):
        with _open(path / file) as f:
            present = set(f.keys())
            for name in by_file[file]:
                if name not in present:
                    raise CheckpointError(f"missing tensor {name!r}: the index lists it in {file}, which lacks it")
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(f"tensor {name!r} in {file} cannot be read ({exc}); "
                                          "the shard may be truncated") from None
                check_tensor(name, file, tensor.shape, tensor.dtype, expected[name])
                state[name] = tensor
    return state


def drafter_tensor_names(args: ModelArgs) -> list[str]:
    """Names of every ``mtp.*`` tensor the config's DSpark drafter has (built on the meta device: no memory)."""
    from .drafter import DSparkDrafter

    with torch.device("meta"):
        drafter = DSparkDrafter(args)
    return ["mtp." + name for name in drafter.state_dict()]


def checkpoint_has_drafter(path: Path, args: ModelArgs) -> bool:
    """True iff the checkpoint lists every tensor of the config's drafter. A partial set (some converters keep a
    few ``mtp.*`` tensors) is logged and ignored: the backbone loads without a drafter."""
    present = {name for name in shard_map(path) if name.startswith("mtp.")}
    if not present or args.num_nextn_predict_layers < 1:
        return False
    missing = [name for name in drafter_tensor_names(args) if name not in present]
    if missing:
        logger.warning("checkpoint has %d mtp.* tensors but not the whole DSpark drafter (e.g. %r is missing); "
                       "loading the target only", len(present), missing[0])
    return not missing


def load_model(cls, path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               with_drafter: bool | None = False, **overrides):
    """Build ``cls`` from ``path``/config.json and assign every checkpoint tensor (strict).

    ``with_drafter`` (only for classes that take it, DeepseekV41ForCausalLM): True builds the DSpark drafter and
    requires its ``mtp.*`` tensors, None builds it iff the checkpoint holds all of them, False skips them.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    try:
        args = ModelArgs.from_file(path, **overrides)
    except ConfigError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None
    param_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    if with_drafter is None:
        with_drafter = checkpoint_has_drafter(path, args)
    if with_drafter and args.num_nextn_predict_layers < 1:
        raise CheckpointError(f"{path / 'config.json'}: with_drafter=True but num_nextn_predict_layers is 0")
    extra = {"with_drafter": True} if with_drafter else {}
    model = cls(args, dtype=dtype, param_dtype=param_dtype, **extra)  # parameters are uninitialised (torch.empty)
    state = load_state_dict_checked(path, model)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device).finish_loading()
    attach_engram_token_map(model, path)
    return model.eval()


def attach_engram_token_map(model, path: Path) -> None:
    """Give Engram its tokenizer-derived token map (spec §7.1) unless the config uses the identity map."""
    args = model.args
    if not args.engram_layer_ids or model.hasher.identity_map:
        return
    from tokenizers import Tokenizer

    from .engram import compressed_token_map

    tokenizer_file = Path(path) / "tokenizer.json"
    if not tokenizer_file.exists():
        raise CheckpointError(f"{path}: Engram needs tokenizer.json to build its compressed token map")
    try:
        token_map = compressed_token_map(Tokenizer.from_file(str(tokenizer_file)), args.engram_compressed_vocab_size)
    except ValueError as exc:
        raise CheckpointError(f"{tokenizer_file}: {exc}") from None
    model.hasher.set_token_map(token_map)
