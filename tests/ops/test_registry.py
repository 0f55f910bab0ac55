"""Registry selection rules that no single backend test covers: forced-only backends."""

import pytest
import torch

from deepinfer_plugins.ops.registry import OpBackendError, OpRegistry


@pytest.fixture
def registry():
    fresh = OpRegistry()
    fresh._discovered = True  # no entry points: only what the test registers
    return fresh


def test_forced_only_backend_is_skipped_by_the_device_preference(registry, monkeypatch):
    op = registry.reference("double")(lambda x: x * 2)
    registry.register_backend("double", "cuda", lambda x: "cuda", automatic=False)
    registry.register_backend("double", "triton", lambda x: "triton")
    assert registry.select("double", "cuda")(0) == "triton"
    monkeypatch.setenv("DEEPINFER_OP_BACKEND", "double=cuda")
    assert registry.select("double", "cuda")(0) == "cuda"
    monkeypatch.setenv("DEEPINFER_OP_BACKEND", "double=ascend")
    with pytest.raises(OpBackendError, match="ascend"):
        op(torch.ones(1))


def test_forced_only_everywhere_falls_back_to_the_reference(registry):
    op = registry.reference("negate")(lambda x: -x)
    registry.register_backend("negate", "triton", lambda x: "triton", automatic=False)
    assert registry.select("negate", "cuda") is op.reference
    assert registry.backends_of("negate") == ["reference", "triton"]
