"""Routed experts: the stacked layout behind official per-expert names, and ``ops.moe_experts``' reference against
a token-by-token formulation of the same math."""

import pytest
import torch

from deepinfer_plugins import ops
from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_plugins.models.deepseek_v41.moe import RoutedExperts

from ..conftest import prompt

E, D, I = 6, 64, 96


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def random_experts(generator, n_experts=E, dim=D, inter=I) -> RoutedExperts:
    experts = RoutedExperts(n_experts, dim, inter, swiglu_limit=10.0)
    state = {}
    for e in range(n_experts):
        for kind, (out_features, in_features) in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
            dense = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
            state[f"{e}.{kind}.weight"], state[f"{e}.{kind}.scale"] = ops.quantize_fp4_weight(dense)
    experts.load_state_dict(state, strict=True)
    return experts


def routing(generator, tokens, n_experts=E, top_k=3):
    ids = torch.rand(tokens, n_experts, generator=generator).argsort(dim=1)[:, :top_k]
    return torch.rand(tokens, top_k, generator=generator) * 2, ids


def token_by_token(x, route_weights, ids, experts: RoutedExperts, limit):
    """Each token's experts one at a time from the dequantised stacks, summed in ascending expert id."""
    dense = experts.dense_weights(x.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for slot in ids[t].argsort().tolist():
            e = int(ids[t, slot])
            row = x[t:t + 1]
            hidden = ops.swiglu.reference(row @ dense.w1[e].t(), row @ dense.w3[e].t(), limit)
            hidden = (hidden.float() * route_weights[t, slot]).to(x.dtype)
            out[t] += (hidden @ dense.w2[e].t()).float()[0]
    return out


def test_state_dict_uses_the_official_per_expert_names_in_checkpoint_order():
    names = list(RoutedExperts(2, 32, 32, None).state_dict())
    assert names == [f"{e}.{kind}.{part}" for e in range(2) for kind in ("w1", "w2", "w3")
                     for part in ("weight", "scale")]


@pytest.mark.parametrize("assign", [False, True])
def test_loading_stacks_each_expert_at_its_index(assign, gen):
    source = random_experts(gen)
    state = {name: tensor.clone() for name, tensor in source.state_dict().items()}
    target = RoutedExperts(E, D, I, swiglu_limit=10.0)
    target.load_state_dict(state, strict=True, assign=assign)
    for e in range(E):
        assert torch.equal(target.w2[e].view(torch.uint8), state[f"{e}.w2.weight"].view(torch.uint8))
        assert torch.equal(target.w3_scale[e].view(torch.uint8), state[f"{e}.w3.scale"].view(torch.uint8))
    assert target.state_dict()["4.w1.weight"].data_ptr() == target.w1[4].data_ptr()  # views, not copies


def test_a_missing_or_stray_expert_tensor_is_named():
    state = RoutedExperts(3, 32, 32, None).state_dict()
    del state["1.w3.scale"]
    state["3.w1.weight"] = state["0.w1.weight"]
    with pytest.raises(RuntimeError) as error:
        RoutedExperts(3, 32, 32, None).load_state_dict(state, strict=True)
    message = str(error.value)
    assert '"1.w3.scale"' in message and '"3.w1.weight"' in message and "w3_scale" not in message


def test_every_expert_width_must_fill_scale_blocks():
    with pytest.raises(ValueError, match="divisible by 32"):
        RoutedExperts(2, 64, 48, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [None, 0.3])
def test_reference_matches_token_by_token(dtype, limit, gen):
    experts = random_experts(gen)
    x = torch.randn(11, D, generator=gen).to(dtype)
    route_weights, ids = routing(gen, 11)
    got = ops.moe_experts.reference(x, route_weights, ids, experts.stored_weights(), limit)
    want = token_by_token(x, route_weights, ids, experts, limit)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tolerance * want.abs().max().item(), rtol=tolerance)


def test_kept_dense_stacks_give_the_stored_weights_result_exactly(gen):
    experts = random_experts(gen)
    x = torch.randn(9, D, generator=gen)
    route_weights, ids = routing(gen, 9)
    stored = ops.moe_experts.reference(x, route_weights, ids, experts.weights(x.dtype), 10.0)
    experts.keep_dense(x.dtype)
    assert not experts.weights(x.dtype).quantised
    assert experts.weights(torch.bfloat16).quantised  # kept for fp32 only
    assert torch.equal(ops.moe_experts.reference(x, route_weights, ids, experts.weights(x.dtype), 10.0), stored)


def test_an_expert_no_token_chose_and_an_empty_batch(gen):
    experts = random_experts(gen)
    x = torch.randn(4, D, generator=gen)
    ids = torch.tensor([[0, 2], [2, 0], [0, 5], [5, 2]])  # experts 1, 3, 4 unused
    weights = torch.rand(4, 2, generator=gen)
    got = ops.moe_experts.reference(x, weights, ids, experts.stored_weights(), None)
    torch.testing.assert_close(got, token_by_token(x, weights, ids, experts, None), atol=1e-5, rtol=1e-5)
    empty = ops.moe_experts.reference(x[:0], weights[:0], ids[:0], experts.stored_weights(), None)
    assert empty.shape == (0, D) and empty.dtype == torch.float32


def test_keep_dense_weights_covers_the_routed_experts_and_changes_no_logit(tiny256_dir):
    model = DeepseekV41ForCausalLM.from_pretrained(tiny256_dir)
    ids = prompt(12, 1)
    want = model(ids)
    model.keep_dense_weights()
    assert not any(layer.ffn.experts.weights(model.dtype).quantised for layer in model.layers)
    assert torch.equal(model(ids), want)


def test_finish_loading_gives_each_fp4_stack_its_device_layout_once(tiny256_dir, monkeypatch):
    """A device backend of ``grouped_fp4_weight_layout`` (the NPU's NZ cast) replaces each routed FP4 stack's data
    once, after loading; values, scales and logits stay."""
    from deepinfer_plugins.ops.registry import DEVICE_PREFERENCE

    model = DeepseekV41ForCausalLM.from_pretrained(tiny256_dir)
    ids = prompt(12, 2)
    want = model(ids)
    laid_out = []

    def layout(weight):
        laid_out.append(weight.clone())
        return laid_out[-1]

    ops.registry.discover()
    monkeypatch.setitem(ops.registry.ops["grouped_fp4_weight_layout"].backends, "device", layout)
    monkeypatch.setitem(DEVICE_PREFERENCE, "cpu", ("device",))  # the CPU tensors stand in
    model.finish_loading()
    stacks = [getattr(m, kind) for m in model.modules() if isinstance(m, RoutedExperts) for kind in RoutedExperts.KINDS]
    assert len(laid_out) == len(stacks) and all(any(s.data_ptr() == t.data_ptr() for t in laid_out) for s in stacks)
    assert all(isinstance(s, torch.nn.Parameter) for s in stacks)
    assert torch.equal(model(ids), want)
