"""The tiny V4.1 model (preset tiny-vocab256, seed 0) with every op that has a Triton kernel forced
to Triton (interpreter) gives the reference backend's logits.

Tolerance: 2e-3 absolute on fp32 logits of magnitude ~1 and the same argmax. Quantisers, RoPE and top-k are
bit-exact; the attention, norms, mHC and router differ from the reference only in summation order (last-bit
float differences), which can move a value across a quantisation boundary downstream, hence not 1e-6.
Also checks the registry: discovery through the entry point, forced selection, and the CPU fallback.
"""

import logging
import types

import pytest
import torch

# importing kernel_compare turns the interpreter on and skips without Triton
from .kernel_compare import TEST_DEVICE, gen, triton, triton_kernels  # noqa: F401

from deepinfer_plugins import ops  # noqa: E402
from deepinfer_plugins.ops.backends import triton_backend  # noqa: E402

from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM  # noqa: E402

from ..conftest import prompt  # noqa: E402


def triton_ops() -> list[str]:
    return [name for name in sorted(ops.registry.ops) if "triton" in ops.registry.backends_of(name)]


def test_entry_point_registers_triton_for_every_kernel_op():
    names = triton_ops()
    missing = sorted(set(triton_backend.OPS) & set(ops.registry.ops) - set(names))
    assert not missing, f"ops with a Triton kernel but no registration: {missing}"
    assert {"sparse_attention", "fp8_fake_quant", "topk_indices", "hc_coefficients", "hc_collapse_norm", "cache_write",
            "moe_experts", "linear_fp8_grouped", "linear_to_fp32", "engram_gather", "engram_gate",
            "csa2_compress"} <= set(names)


def test_forced_triton_is_used_on_cpu(monkeypatch):
    monkeypatch.setenv("DEEPINFER_OP_BACKEND", "triton")
    assert ops.registry.select("fp8_fake_quant", "cpu").__name__ == "triton_fp8_fake_quant"
    monkeypatch.setenv("DEEPINFER_OP_BACKEND", "fp8_fake_quant=reference")
    assert ops.registry.select("fp8_fake_quant", "cpu") is ops.fp8_fake_quant.reference
    monkeypatch.delenv("DEEPINFER_OP_BACKEND")
    assert ops.registry.select("fp8_fake_quant", "cpu") is ops.fp8_fake_quant.reference  # CPU default


def test_cpu_without_interpreter_falls_back_with_one_info_line(monkeypatch, caplog):
    from deepinfer_plugins.ops.backends.triton_kernels import common

    monkeypatch.setattr(common, "INTERPRETED", False)
    monkeypatch.setattr(triton_backend, "_declined_logged", set())
    monkeypatch.setenv("DEEPINFER_OP_BACKEND", "swiglu=triton")
    g, u = torch.randn(3, 8), torch.randn(3, 8)
    with caplog.at_level(logging.INFO, logger=triton_backend.__name__):
        out1 = ops.swiglu(g, u, 10.0)
        ops.swiglu(g, u, 10.0)
    assert torch.equal(out1, ops.swiglu.reference(g, u, 10.0))
    assert sum("swiglu" in r.message for r in caplog.records) == 1


def test_npu_tensors_run_only_under_triton_ascend(monkeypatch):
    from deepinfer_plugins.ops.backends.triton_kernels import common

    npu_tensor = types.SimpleNamespace(device=types.SimpleNamespace(type="npu"))
    cuda_tensor = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    monkeypatch.setattr(common, "INTERPRETED", False)
    for ascend, runs_npu in ((False, False), (True, True)):
        monkeypatch.setattr(common, "TRITON_ASCEND", ascend)
        assert common.can_run(npu_tensor) is runs_npu
        assert common.can_run(cuda_tensor) is not runs_npu
        assert common.can_run(torch.zeros(1)) is False
    monkeypatch.setattr(common, "INTERPRETED", True)
    assert common.can_run(torch.zeros(1)) is True


def test_a_grid_past_the_npu_limit_is_cut_along_its_first_axis(monkeypatch):
    """Under triton-ascend a grid of more programs than an NPU launch takes becomes several launches, each a run of
    the first axis (the kernels add ``first_program`` to their axis-0 program id); a grid whose other axes alone
    pass the limit cannot be cut and raises GridTooLarge. The limit is lowered to 4 here."""
    from deepinfer_plugins.ops.backends.triton_kernels import common

    monkeypatch.setattr(common, "ASCEND_MAX_PROGRAMS", 4)
    monkeypatch.delenv(common.BLOCKS_PARALLEL_ENV, raising=False)
    monkeypatch.setattr(common, "TRITON_ASCEND", False)
    assert common.launch_chunks(9, 3) == [(0, (9, 3))]
    monkeypatch.setattr(common, "TRITON_ASCEND", True)
    assert common.launch_chunks(2, 2) == [(0, (2, 2))]
    assert common.launch_chunks(5) == [(0, (4,)), (4, (1,))]
    assert common.launch_chunks(5, 2) == [(0, (2, 2)), (2, (2, 2)), (4, (1, 2))]
    with pytest.raises(common.GridTooLarge, match="5 programs per index"):
        common.launch_chunks(2, 5)


def test_a_grid_that_cannot_be_cut_declines_to_the_reference(monkeypatch, caplog, gen):
    """A grid whose axes past the first alone hold more programs than an NPU launch takes is never launched: the op
    declines with one INFO line naming TRITON_ALL_BLOCKS_PARALLEL, and the reference answers. Here the limit is 1
    and the routed experts' grid has two output tiles per row block."""
    from deepinfer_plugins.ops.backends.triton_kernels import common

    from .test_triton_moe import stacked_experts

    monkeypatch.setattr(common, "TRITON_ASCEND", True)
    monkeypatch.setattr(common, "ASCEND_MAX_PROGRAMS", 1)
    monkeypatch.setattr(triton_backend, "_declined_logged", set())
    monkeypatch.setenv("DEEPINFER_OP_BACKEND", "moe_experts=triton")
    monkeypatch.delenv(common.BLOCKS_PARALLEL_ENV, raising=False)
    experts = stacked_experts(gen, 3, 64, 96)
    x, weights, ids = torch.randn(5, 64, generator=gen), torch.rand(5, 2, generator=gen), torch.tensor([[0, 1]] * 5)
    with caplog.at_level(logging.INFO, logger=triton_backend.__name__):
        out = ops.moe_experts(x, weights, ids, experts, 10.0)
        ops.moe_experts(x, weights, ids, experts, 10.0)
    assert torch.equal(out, ops.moe_experts.reference(x, weights, ids, experts, 10.0))
    declined = [r.message for r in caplog.records if "moe_experts" in r.message]
    assert len(declined) == 1 and common.BLOCKS_PARALLEL_ENV in declined[0], declined


@pytest.mark.parametrize("setting, capped", [("1", False), ("true", False), ("TRUE", False), ("0", True),
                                              ("false", True)])
def test_triton_all_blocks_parallel_lifts_the_npu_launch_limit(monkeypatch, setting, capped):
    """With triton-ascend's TRITON_ALL_BLOCKS_PARALLEL on (as its compiler and launcher parse it), its compiler
    loops each core over the programs: every grid is one launch."""
    from deepinfer_plugins.ops.backends.triton_kernels import common

    monkeypatch.setattr(common, "TRITON_ASCEND", True)
    monkeypatch.setattr(common, "ASCEND_MAX_PROGRAMS", 4)
    monkeypatch.setenv(common.BLOCKS_PARALLEL_ENV, setting)
    assert common.programs_capped() is capped
    assert len(common.launch_chunks(5, 2)) == (3 if capped else 1)
    if capped:
        with pytest.raises(common.GridTooLarge):
            common.launch_chunks(1, 5)
    else:
        assert common.launch_chunks(1, 5) == [(0, (1, 5))]


def test_no_kernel_depends_on_the_order_of_its_programs():
    """TRITON_ALL_BLOCKS_PARALLEL is safe only for kernels whose programs never wait on or race with each other:
    every program writes its own outputs, so none may use atomics or barriers."""
    from pathlib import Path

    from deepinfer_plugins.ops.backends import triton_kernels

    sources = sorted(Path(triton_kernels.__file__).parent.glob("*.py"))
    assert len(sources) >= 8
    for source in sources:
        text = source.read_text()
        for construct in ("atomic_", "debug_barrier", "tl.inline_asm"):
            assert construct not in text, f"{source.name} uses {construct}"


def test_every_launch_of_a_cut_grid_takes_one_binary():
    """``run_kernel`` passes a grid's start as ``first_program``; a kernel that let Triton specialise on it would
    compile anew for a launch that starts at a multiple of 16 or not (on an NPU, mid-serving). Every kernel must
    be decorated with ``cut_launch_jit`` (``do_not_specialize``) or take it as a constexpr (the GEMM, for
    triton-ascend's adapter). tests/ops/triton_ascend_lowering.py checks the compiled binaries of cut grids."""
    import inspect

    kernels = triton_kernels()
    assert len(kernels) == 27
    for name, kernel in kernels.items():
        constexpr = inspect.signature(kernel.fn).parameters["first_program"].annotation == "tl.constexpr"
        decorator = inspect.getsource(kernel.fn).lstrip().splitlines()[0]  # the jit options, in any Triton version
        assert decorator == "@cut_launch_jit" or constexpr, f"{name} is {decorator}: it specialises on first_program"


def test_a_kernel_triton_ascend_cannot_compile_falls_back_for_good(monkeypatch, caplog):
    """On an NPU a compile error (CI runs triton-ascend's compiler only up to its CANN stage) logs one warning and
    the reference runs the op from then on; elsewhere a compile error is a bug and propagates."""
    from triton.compiler.errors import CompilationError

    from deepinfer_plugins.ops.backends.triton_kernels import common, misc

    calls = []

    def failing_launcher(*args, **kwargs):
        calls.append(args)
        raise CompilationError("kernel.py", None, "unsupported access pattern")

    monkeypatch.setattr(misc, "swiglu", failing_launcher)
    monkeypatch.setattr(triton_backend, "_failed_to_compile", set())
    g, u = torch.randn(3, 8), torch.randn(3, 8)
    with pytest.raises(CompilationError):
        triton_backend._make("swiglu", "misc")(g, u, 10.0)
    monkeypatch.setattr(common, "TRITON_ASCEND", True)
    monkeypatch.setattr(common, "INTERPRETED", False)
    monkeypatch.setattr(common, "can_run", lambda t: True)  # the CPU tensors stand in for NPU ones
    run = triton_backend._make("swiglu", "misc")
    with caplog.at_level(logging.INFO, logger=triton_backend.__name__):
        assert run(g, u, 10.0) is NotImplemented
        assert run(g, u, 10.0) is NotImplemented
    assert len(calls) == 2  # the propagated call, then one on the NPU
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "swiglu" in warnings[0].message and "unsupported access" in warnings[0].message


def test_tiny_model_prefill_and_decode_with_triton_match_reference(tiny256, monkeypatch):
    """Prefill 17 tokens, then decode 3 one at a time (the 8-token window wraps, 2-token compression groups close
    during decode, the indexer keeps 4 compressed entries per query) on Triton, against the reference's full
    forward over all 20; one test, because each forward under the interpreter costs tens of seconds."""
    ids = prompt(20, 0)
    monkeypatch.delenv("DEEPINFER_OP_BACKEND", raising=False)
    want = tiny256(ids)
    monkeypatch.setenv("DEEPINFER_OP_BACKEND", ",".join(f"{name}=triton" for name in triton_ops()))
    cache = tiny256.new_cache()
    got = torch.cat([tiny256(ids[:17], cache)] + [tiny256(ids[i:i + 1], cache) for i in range(17, 20)])
    print(f"max |logit diff| {(got - want).abs().max().item():.3e}")
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="GPU run: DEEPINFER_TEST_DEVICE=cuda (benchmarks/device_check.sh)")
def test_tiny_model_on_gpu_matches_cpu_reference(tiny256_dir, tiny256, monkeypatch):
    """The default GPU selection (CUDA kernels first, then Triton) against the CPU reference: prefill 9 tokens,
    decode 3, same tolerance as the interpreter runs above."""
    monkeypatch.delenv("DEEPINFER_OP_BACKEND", raising=False)
    ids = prompt(12, 5)
    want = tiny256(ids)
    gpu = DeepseekV41ForCausalLM.from_pretrained(tiny256_dir, device="cuda")
    cache = gpu.new_cache()
    ids_gpu = ids.cuda()
    got = torch.cat([gpu(ids_gpu[:9], cache)] + [gpu(ids_gpu[i:i + 1], cache) for i in range(9, 12)]).cpu()
    per_row = " ".join(f"{v:.0e}" for v in (got - want).abs().amax(dim=1).tolist())
    print(f"max |logit diff| GPU vs CPU reference {(got - want).abs().max().item():.3e}; per row (9 prefill, "
          f"3 decode) {per_row}; benchmarks/gpu_diagnose.py names the op")
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
