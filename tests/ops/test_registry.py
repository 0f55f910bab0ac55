"""Registry selection rules that no single backend test covers: forced-only backends, declined calls."""

import pytest
import torch

from deepinfer_plugins.ops.registry import DEVICE_PREFERENCE, OpBackendError, OpRegistry


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



def test_a_declined_call_goes_to_the_next_choice(registry, monkeypatch):
    """A backend returns NotImplemented for a call outside its kernel: the next preferred backend runs it, and
    when every backend declines (or the one forced does), the reference. Meta tensors stand in for a device
    whose preference list is (cuda, triton)."""
    monkeypatch.setitem(DEVICE_PREFERENCE, "meta", ("cuda", "triton"))
    op = registry.reference("square")(lambda x: "reference")
    calls = []

    def backend(name, takes):
        def run(x):
            calls.append(name)
            return name if takes(x) else NotImplemented
        return run

    registry.register_backend("square", "cuda", backend("cuda", lambda x: x.shape[0] >= 32))
    registry.register_backend("square", "triton", backend("triton", lambda x: x.dtype == torch.bfloat16))
    assert op(torch.empty(64, device="meta")) == "cuda" and calls == ["cuda"]
    calls.clear()
    assert op(torch.empty(8, dtype=torch.bfloat16, device="meta")) == "triton" and calls == ["cuda", "triton"]
    calls.clear()
    assert op(torch.empty(8, device="meta")) == "reference" and calls == ["cuda", "triton"]
    calls.clear()
    monkeypatch.setenv("DEEPINFER_OP_BACKEND", "square=cuda")
    assert op(torch.empty(8, dtype=torch.bfloat16, device="meta")) == "reference" and calls == ["cuda"]
