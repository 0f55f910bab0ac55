"""Mixture of experts: sqrt-softplus router with noaux_tc correction bias, FP4 routed experts, a shared expert."""

from __future__ import annotations

import torch
from torch import nn

from ... import ops
from .args import ModelArgs
from .linear import WEIGHT_BLOCK, Linear


class Expert(nn.Module):
    """The shared expert: SwiGLU FFN w2(silu(w1 x) * w3 x), with the activation clamp of ``swiglu_limit`` when
    given (the routed experts run the same math in ``ops.moe_experts``)."""

    def __init__(self, dim: int, inter_dim: int, fmt: str, swiglu_limit: float | None):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, fmt)
        self.w2 = Linear(inter_dim, dim, fmt)
        self.w3 = Linear(dim, inter_dim, fmt)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, d] -> [n, d]."""
        return self.w2(ops.swiglu(self.w1(x), self.w3(x), self.swiglu_limit))


class Gate(nn.Module):
    """Router: scores sqrt(softplus(x W^T)); ``bias`` (text) or ``bias_vl`` (image tokens) only steers selection."""

    def __init__(self, args: ModelArgs, n_experts: int, top_k: int, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.route_scale = top_k, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(n_experts, args.hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, image_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, d], image_rows [n] bool (image-span tokens select with ``bias_vl``) -> (weights, expert ids)."""
        logits = ops.linear_to_fp32(x, self.weight)
        bias = self.bias if image_rows is None else torch.where(image_rows[:, None], self.bias_vl, self.bias)
        return ops.sqrtsoftplus_route(logits, bias, self.top_k, self.route_scale)


class RoutedExperts(nn.Module):
    """A layer's routed experts, each weight kind stacked over experts ([E, ...]) so that ``ops.moe_experts``
    runs them all in one grouped call (the layout of DeepGEMM's grouped GEMMs and vLLM's fused MoE too).

    The checkpoint names every expert's tensors on their own (``experts.{e}.w1.weight`` / ``.scale``); this
    module's state dict uses those names, as views of the stacks, and loading stacks them back, so the loaders
    and the checkpoint writer see only official names. ``from_weights`` wraps given stacks (tensor-parallel
    shards)."""

    KINDS = ("w1", "w2", "w3")  # the checkpoint's order within an expert

    def __init__(self, n_experts: int, dim: int, inter_dim: int, swiglu_limit: float | None):
        super().__init__()
        for size in (dim, inter_dim):
            if size % WEIGHT_BLOCK:
                raise ValueError(f"FP4 experts need dimensions divisible by {WEIGHT_BLOCK}, got {size}")
        self.n_experts, self.swiglu_limit = n_experts, swiglu_limit
        shapes = {"w1": (inter_dim, dim), "w2": (dim, inter_dim), "w3": (inter_dim, dim)}  # [out, in] per expert
        for kind, (out_features, in_features) in shapes.items():
            self.register_parameter(kind, nn.Parameter(
                torch.empty(n_experts, out_features, in_features // 2, dtype=torch.int8), requires_grad=False))
            self.register_parameter(f"{kind}_scale", nn.Parameter(
                torch.empty(n_experts, out_features, in_features // WEIGHT_BLOCK, dtype=torch.float8_e8m0fnu),
                requires_grad=False))

    @classmethod
    def from_weights(cls, weights: ops.ExpertWeights, swiglu_limit: float | None) -> "RoutedExperts":
        """Experts holding ``weights`` as given (FP4 stacks, or float stacks with no scales)."""
        experts = cls.__new__(cls)
        nn.Module.__init__(experts)
        experts.n_experts, experts.swiglu_limit = weights.w1.shape[0], swiglu_limit
        for kind in cls.KINDS:
            for name in (kind, f"{kind}_scale"):
                tensor = getattr(weights, name)
                experts.register_parameter(name, None if tensor is None else
                                           nn.Parameter(tensor.contiguous(), requires_grad=False))
        return experts

    def stored_weights(self) -> ops.ExpertWeights:
        return ops.ExpertWeights(self.w1, self.w1_scale, self.w3, self.w3_scale, self.w2, self.w2_scale)

    def dense_weights(self, dtype: torch.dtype) -> ops.ExpertWeights:
        """Every expert dequantised into ``dtype`` (FP4 scales are per row, so the stack dequantises as rows)."""
        stored = self.stored_weights()
        if not stored.quantised:
            return ops.ExpertWeights(*(w if w is None else w.to(dtype) for w in stored))

        def dense(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            rows = ops.dequant_fp4_weight(weight.flatten(0, 1), scale.flatten(0, 1), dtype)
            return rows.unflatten(0, weight.shape[:2])

        return ops.ExpertWeights(dense(stored.w1, stored.w1_scale), None, dense(stored.w3, stored.w3_scale), None,
                                 dense(stored.w2, stored.w2_scale), None)

    def keep_dense(self, dtype: torch.dtype) -> None:
        """As ``Linear.keep_dense``: keep the dequantised stacks (memory: their dense size)."""
        self.dense = self.dense_weights(dtype)

    def lay_out_for_device(self) -> None:
        """Once after loading, on the weights' device: the FP4 stacks in the layout its grouped GEMM reads."""
        for kind in self.KINDS if self.w1_scale is not None else ():
            stack = getattr(self, kind)
            laid_out = ops.grouped_fp4_weight_layout(stack)
            if laid_out is not stack:
                stack.data = laid_out

    def weights(self, dtype: torch.dtype) -> ops.ExpertWeights:
        """What ``ops.moe_experts`` reads for activations of ``dtype``: the kept dense stacks, else the stored."""
        dense = getattr(self, "dense", None)
        return dense if dense is not None and dense.w1.dtype == dtype else self.stored_weights()

    def _official_names(self, prefix: str, kind: str, suffix: str) -> list[str]:
        return [f"{prefix}{expert}.{kind}.{suffix}" for expert in range(self.n_experts)]

    def _stacks(self):
        """(official name suffix, stacked parameter name, kind) for every stacked tensor this module holds."""
        for kind in self.KINDS:
            yield "weight", kind, kind
            if getattr(self, f"{kind}_scale") is not None:
                yield "scale", f"{kind}_scale", kind

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        stacks = {name: getattr(self, name) if keep_vars else getattr(self, name).detach()
                  for _, name, _ in self._stacks()}
        for expert in range(self.n_experts):
            for suffix, name, kind in self._stacks():
                destination[f"{prefix}{expert}.{kind}.{suffix}"] = stacks[name][expert]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        incomplete = []
        for suffix, name, kind in self._stacks():
            names = self._official_names(prefix, kind, suffix)
            absent = [n for n in names if n not in state_dict]
            if absent:
                missing_keys.extend(absent)
                incomplete.append(prefix + name)
                for n in names:
                    state_dict.pop(n, None)
            else:
                state_dict[prefix + name] = torch.stack([state_dict.pop(n) for n in names])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for name in incomplete:  # reported above under the official names
            if name in missing_keys:
                missing_keys.remove(name)

    def extra_repr(self) -> str:
        stored = "fp4" if self.w1_scale is not None else str(self.w1.dtype)
        return f"experts={self.n_experts}, inter={self.w1.shape[1]}, {stored}"


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, n_experts: int | None = None, top_k: int | None = None):
        super().__init__()
        n_experts = n_experts or args.n_routed_experts
        self.gate = Gate(args, n_experts, top_k or args.num_experts_per_tok, dtype)
        self.experts = RoutedExperts(n_experts, args.hidden_size, args.moe_intermediate_size, args.swiglu_limit)
        shared_limit = args.swiglu_limit if args.clamp_shared_expert else None
        self.shared_experts = Expert(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts, "fp8",
                                     shared_limit)

    def forward(self, x: torch.Tensor, image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, d] -> [n, d]: weighted routed experts (token choice) plus the shared expert. The routed experts
        run as an opaque op (ops/opaque.py), so the layer compiles without a graph break. ``image_rows``: see
        ``Gate``."""
        weights, ids = self.gate(x, image_rows)
        routed = ops.routed_experts(x, weights, ids, self.experts.weights(x.dtype), self.experts.swiglu_limit)
        return (routed + self.shared_experts(x).float()).to(x.dtype)
