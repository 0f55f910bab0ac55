"""Load an official-format V4.1 checkpoint: nested config.json + sharded safetensors with the release's names.

Module names mirror the official tensor names (docs/model.md#checkpoint-names-and-formats), so the name table is the
identity; the drafter (``mtp.*``) loads when the model builds one, and the vision tower, aligner and delimiters
when the checkpoint holds any of them (else the model is text-only). ``load_weights`` is the one loader: ``load_model``
feeds it the shards, and the vLLM and SGLang adapters feed it their engine's weight iterator, so the three give the
same parameters. Quantised tensors are taken as stored (see linear.py), float tensors in their stored dtype. Given
a tensor-parallel ``ShardPlan`` (sharding.py), it reads only the rank's part of each split tensor: from the shards
through ``StoredTensor``, which reads that part alone, or sliced off an engine's whole tensor. Every
problem raises ``CheckpointError`` naming the tensor and the shard, and ``load_model`` returns no half-loaded model:
the names are checked against the index before any shard is read, and a bad tensor raises before the model is
returned.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from .args import ConfigError, ModelArgs
from .sharding import ShardPlan, TensorParallel, finish_shards, shard_model

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
UNUSED_TENSORS = ("image_pad",)  # in the release, but no part of the V4.1 model (docs/model.md#vision)


class CheckpointError(RuntimeError):
    """The checkpoint does not match the model its config describes."""


def without_missing_vision(path: Path, args: ModelArgs) -> ModelArgs:
    """``args`` with no vision tower when the checkpoint holds none of its tensors: text-only conversions keep the
    release's ``vision_config``, and a model built from it would wait for tensors that never come."""
    if args.vision is not None and not any(name.startswith(VISION_PREFIXES) for name in shard_map(path)):
        return dataclasses.replace(args, vision_config=None)
    return args


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


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
                      "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                      "BOOL": torch.bool}


class StoredTensor:
    """A tensor of an open shard, not read yet: shape and dtype come from the header, and indexing reads only
    the indexed part, so a tensor-parallel rank never holds a whole split tensor."""

    def __init__(self, handle, name: str, file: str):
        self.name, self.file, self._slice = name, file, handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())
        self.dtype = SAFETENSORS_DTYPES.get(self._slice.get_dtype())
        if self.dtype is None:
            raise CheckpointError(f"tensor {name!r} in {file}: unsupported dtype {self._slice.get_dtype()}")

    def __getitem__(self, index) -> torch.Tensor:
        try:
            return self._slice[index]
        except Exception as exc:
            raise CheckpointError(f"tensor {self.name!r} in {self.file} cannot be read ({exc}); "
                                  "the shard may be truncated") from None


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


def skipped(name: str, model: torch.nn.Module) -> bool:
    """Checkpoint tensors no engine loads: ``image_pad``, and the vision tensors or the drafter's ``mtp.*`` when
    the model was built without them."""
    return (name in UNUSED_TENSORS or (name.startswith(VISION_PREFIXES) and not getattr(model, "has_vision", False))
            or (name.startswith("mtp.") and getattr(model, "drafter", None) is None))


def new_model(cls, args: ModelArgs, dtype: torch.dtype, with_drafter: bool = False):
    """``cls`` with uninitialised parameters for ``load_weights`` to fill; every engine builds through here.

    Float parameters start in bf16, the dtype official checkpoints store them in, whatever the activation
    ``dtype``: ``load_weights`` then keeps each float tensor in its stored dtype, so no engine's choice of
    ``dtype`` changes a parameter.
    """
    extra = {"with_drafter": True} if with_drafter else {}
    return cls(args, dtype=dtype, param_dtype=torch.bfloat16, **extra)


def check_names(targets, names, where: Callable[[str], str], listed_in: str) -> None:
    """Raise ``CheckpointError`` unless ``names`` are exactly the model's ``targets``."""
    unexpected = sorted(set(names) - set(targets))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} in {where(unexpected[0])} ({len(unexpected)} "
                              "unexpected in total) - not part of the model the config describes")
    missing = sorted(set(targets) - set(names))
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} ({len(missing)} missing in total): not listed in "
                              f"{listed_in}")


def _store(model: torch.nn.Module, name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    if tensor.dtype == target.dtype:
        with torch.no_grad():
            target.copy_(tensor)  # in place: a routed expert's target is a view of its layer's stack
        return
    owner, _, leaf = name.rpartition(".")
    model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(tensor.to(target.device), requires_grad=False)


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor | StoredTensor]],
                 source: str = "the checkpoint", where: Callable[[str], str] | None = None,
                 plan: ShardPlan | None = None) -> set[str]:
    """Official-name tensors -> ``model``'s parameters, in place; the one loader of every engine. -> names loaded.

    Tensors stream: each is checked (a tensor of the model, its shape, a quantised dtype exactly the model's)
    and lands on its parameter's device before the next is read. Quantised tensors (FP8 weights, FP4 experts,
    E8M0 scales, FP8 Engram tables) are kept as stored, and a float tensor keeps the float dtype it is stored
    in: the kernels read bf16 weights as stored (ops/gemm.py), and converting would round (fp16 or fp32 into
    bf16) or double the memory (bf16 into fp32). ``skipped`` tensors are passed over. ``source`` names the
    checkpoint in errors, ``where(name)`` the file of one tensor (default: ``source``). With a ``plan`` (a
    model reshaped by ``shard_model``), a split tensor is checked against its whole shape and only the rank's
    part is kept; ``finish_shards`` then completes the shards. After a ``CheckpointError`` the model is partly
    loaded: callers discard it.
    """
    where = where or (lambda name: source)
    targets = model.state_dict(keep_vars=True)  # official names; routed experts as views of their stacks
    loaded: set[str] = set()
    passed_over = 0
    for name, tensor in weights:
        if skipped(name, model):
            passed_over += 1
            continue
        if name not in targets:
            raise CheckpointError(f"unexpected tensor {name!r} in {where(name)}: not part of the model the config "
                                  "describes")
        read = plan.reads.get(name) if plan is not None else None
        expected = targets[name] if read is None else torch.empty(read.full_shape, dtype=targets[name].dtype,
                                                                   device="meta")
        check_tensor(name, where(name), tensor.shape, tensor.dtype, expected)
        if read is not None:
            tensor = tensor[read.index].clone() if isinstance(tensor, torch.Tensor) else tensor[read.index]
        _store(model, name, targets[name], tensor)
        loaded.add(name)
    if passed_over:
        logger.info("checkpoint: skipped %d unused or unbuilt (vision, drafter) tensors", passed_over)
    check_names(targets, loaded, where, source)
    if plan is not None:
        finish_shards(model, plan)
    return loaded


def shard_tensors(path: Path, names: dict[str, str], plan: ShardPlan | None = None
                  ) -> Iterator[tuple[str, torch.Tensor | StoredTensor]]:
    """(name, tensor) of every ``names`` entry (name -> shard file), shard by shard; a tensor the ``plan``
    splits comes unread, as a ``StoredTensor``, for ``load_weights`` to read the rank's part of."""
    by_file: dict[str, list[str]] = {}
    for name, file in names.items():
        by_file.setdefault(file, []).append(name)
    for file in tqdm(sorted(by_file), desc="Loading checkpoint shards", unit="shard",
                     disable=len(by_file) < 2 and None):
        with _open(path / file) as f:
            present = set(f.keys())
            for name in by_file[file]:
                if name not in present:
                    raise CheckpointError(f"missing tensor {name!r}: the index lists it in {file}, which lacks it")
                if plan is not None and name in plan.reads:
                    yield name, StoredTensor(f, name, file)
                    continue
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(f"tensor {name!r} in {file} cannot be read ({exc}); "
                                          "the shard may be truncated") from None
                yield name, tensor


def load_checkpoint(path: Path, model: torch.nn.Module, plan: ShardPlan | None = None) -> set[str]:
    """Every tensor of the checkpoint directory ``path`` into ``model``, through ``load_weights``; the names are
    checked against the index before any shard is read. ``plan``: the rank's parts of split tensors only."""
    wanted = {n: f for n, f in shard_map(path).items() if not skipped(n, model)}
    listed_in = INDEX_FILE if (path / INDEX_FILE).exists() else SINGLE_FILE
    check_names(model.state_dict(), wanted, wanted.__getitem__, listed_in)
    return load_weights(model, shard_tensors(path, wanted, plan), listed_in, wanted.__getitem__, plan)


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
               with_drafter: bool | None = False, tensor_parallel: TensorParallel | None = None, **overrides):
    """Build ``cls`` from ``path``/config.json and assign every checkpoint tensor (strict).

    ``tensor_parallel``: build and read only that rank's shard (sharding.py).

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
    args = without_missing_vision(path, args)
    if with_drafter is None:
        with_drafter = checkpoint_has_drafter(path, args)
    if with_drafter and args.num_nextn_predict_layers < 1:
        raise CheckpointError(f"{path / 'config.json'}: with_drafter=True but num_nextn_predict_layers is 0")
    model = new_model(cls, args, dtype, with_drafter)
    plan = shard_model(model, tensor_parallel) if tensor_parallel is not None else None
    load_checkpoint(path, model, plan)
    model.to(device).finish_loading()
    attach_engram_token_map(model, path)
    return model.eval()


def attach_engram_token_map(model, path: Path) -> None:
    """Give Engram its tokenizer-derived token map (docs/model.md#token-map) unless the config uses the identity map."""
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
