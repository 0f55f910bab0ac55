"""The compiled kernels/cuda extension against the PyTorch references, on a CUDA device (skipped elsewhere).

Guarantees: every sparse_attention variant (tensor-core ``mma``, CUDA-core ``simt``, and on their own
architectures Hopper ``wgmma`` and SM100 ``tcgen05``) matches the fp32 reference
within atol 2e-2 / rtol 2e-2 with cosine similarity > 0.9999 over the whole output, across decode (T = 1, the
key-split path) and multi-row shapes, head counts that fill or leave empty head tiles, head dims 512 / 128, key
counts that are and are not multiples of the 64-key block, -1 padding, duplicate indices, a row without any valid
key (exact zeros) and large-magnitude logits; cache_write is bit-exact against the reference records and leaves
unselected slots untouched. The variant dispatch (DEEPINFER_CUDA_ATTENTION) is checked on any machine.

The extension is JIT-built once per process, for the visible device's arch only (unless DEEPINFER_CUDA_ARCHS is
set), so the first test pays one short compile.
"""

import os
from pathlib import Path

import pytest
import torch

from deepinfer_plugins import ops
from deepinfer_plugins.ops.backends import cuda_backend

needs_cuda = pytest.mark.skipif(not (torch.version.cuda and torch.cuda.is_available()), reason="no CUDA device")


def _device_major() -> int | None:
    return torch.cuda.get_device_capability()[0] if torch.version.cuda and torch.cuda.is_available() else None


# tensor-core variants that exist only on one architecture run where the device has it
ARCH_ONLY = {"wgmma": 9, "tcgen05": 10}
VARIANTS = [pytest.param(v, marks=pytest.mark.skipif(ARCH_ONLY.get(v, _device_major()) != _device_major(),
                                                     reason=f"{v} needs compute capability {ARCH_ONLY.get(v)}.x"))
            for v in ("mma", "simt", "wgmma", "tcgen05")]


@pytest.fixture(scope="module")
def ext():
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    arch += "a" if arch in ("90", "100", "103") else ""
    previous = os.environ.get("DEEPINFER_CUDA_ARCHS")
    os.environ["DEEPINFER_CUDA_ARCHS"] = previous or arch
    try:
        return cuda_backend._extension()
    finally:
        if previous is None:
            del os.environ["DEEPINFER_CUDA_ARCHS"]


def attention_inputs(t, h, d, k, magnitude, seed):
    """q, pool, indices, sink on the GPU: ~20 % of slots -1, duplicates in every row, the last row all -1 (T > 1)."""
    g = torch.Generator().manual_seed(seed)
    pool_rows = 3000
    q = (torch.randn(t, h, d, generator=g) * magnitude).to(torch.bfloat16)
    pool = torch.randn(pool_rows, d, generator=g).to(torch.bfloat16)
    indices = torch.randint(0, pool_rows, (t, k), generator=g)
    indices[torch.rand(t, k, generator=g) < 0.2] = -1
    if k >= 4:
        indices[:, 1] = indices[:, 0].clamp(min=0)
        indices[:, k - 1] = indices[:, 0].clamp(min=0)
    if t > 1:
        indices[-1] = -1
    sink = torch.randn(h, generator=g) * 2
    return q.cuda(), pool.cuda(), indices.cuda(), sink.cuda()


def run_variant(ext, variant, q, pool, indices, sink, scale):
    out = getattr(ext, f"sparse_attention_{variant}")(q, pool, indices, sink, scale)
    torch.cuda.synchronize()
    return out


def assert_attention_close(got, want):
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    got32 = got.float()
    assert torch.isfinite(got32).all()
    torch.testing.assert_close(got32, want, atol=2e-2, rtol=2e-2)
    cosine = torch.nn.functional.cosine_similarity(got32.flatten(), want.flatten(), dim=0).item()
    assert cosine > 0.9999, cosine


@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("magnitude", [1.0, 40.0])
@pytest.mark.parametrize("k", [640, 128, 37])
@pytest.mark.parametrize("d", [512, 128])
@pytest.mark.parametrize("h", [64, 16])
@pytest.mark.parametrize("t", [1, 5, 130])
def test_sparse_attention_matches_reference(ext, t, h, d, k, magnitude, variant):
    q, pool, indices, sink = attention_inputs(t, h, d, k, magnitude, seed=t * 7919 + h * 131 + d + k)
    scale = d ** -0.5
    want = ops.sparse_attention.reference(q.float(), pool.float(), indices, sink, scale)
    got = run_variant(ext, variant, q, pool, indices, sink, scale)
    assert_attention_close(got, want)
    if t > 1:
        assert torch.equal(got[-1], torch.zeros_like(got[-1])), "a row with no valid key must be exactly zero"


@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("t,h,k", [(3, 24, 200), (2, 80, 640), (1, 128, 1000)])
def test_sparse_attention_partial_head_tiles(ext, t, h, k, variant):
    """Head counts that end inside a 16-head tile or a 64-head CTA, and long key lists."""
    q, pool, indices, sink = attention_inputs(t, h, 512, k, 1.0, seed=h * 17 + k)
    want = ops.sparse_attention.reference(q.float(), pool.float(), indices, sink, 0.04)
    assert_attention_close(run_variant(ext, variant, q, pool, indices, sink, 0.04), want)


@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("t,k", [(1, 640), (4, 640), (2, 0), (7, 37)])
def test_sparse_attention_without_valid_keys_is_zero(ext, t, k, variant):
    q, pool, indices, sink = attention_inputs(t, 64, 512, k, 1.0, seed=k + t)
    indices.fill_(-1)
    got = run_variant(ext, variant, q, pool, indices, sink, 0.04)
    assert torch.equal(got, torch.zeros_like(got))


@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_sparse_attention_takes_misaligned_and_strided_inputs(ext, variant):
    """A contiguous pool starting 2 bytes into its storage (cp.async needs 16-byte rows) and a strided q."""
    q, pool, indices, sink = attention_inputs(5, 64, 128, 300, 1.0, seed=5)
    storage = torch.empty(pool.numel() + 1, dtype=pool.dtype, device=pool.device)
    misaligned_pool = storage[1:].view_as(pool)
    misaligned_pool.copy_(pool)
    assert misaligned_pool.is_contiguous() and misaligned_pool.data_ptr() % 16 != 0
    strided_q = q.transpose(0, 1).contiguous().transpose(0, 1)
    want = ops.sparse_attention.reference(q.float(), pool.float(), indices, sink, 0.09)
    assert_attention_close(run_variant(ext, variant, strided_q, misaligned_pool, indices, sink, 0.09), want)


def spread(shape, g, dtype, saturate):
    """Values over many binades, exact quarter steps mixed in, one all-zero block, a negative underflow and, with
    ``saturate``, one value far past the format's range."""
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape[:-1] + (1,), generator=g).float())
    x = torch.where(torch.rand(shape, generator=g) < 0.1, torch.round(x * 4) / 4, x)
    x[0, :32] = 0.0
    x[-1, :2] = torch.tensor([1e6 if saturate else 3.0, -3e-30])
    return x.to(dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt,dim", [("fp8_window", 512), ("nvfp4", 512), ("mxfp4", 128), ("nvfp4", 64)])
def test_cache_write_is_bit_exact(ext, fmt, dim, dtype):
    g = torch.Generator().manual_seed(dim)
    # nvfp4's E4M3 block scale overflows for amax > 6 * 448, where the reference's scale is torch's float8
    # conversion of an out-of-range value (NaN in torch 2.11, saturated in others): no fixed answer to match.
    x = spread((9, dim), g, dtype, saturate=fmt != "nvfp4")
    slots = torch.tensor([9, 0, -1, 3, 11, 4, 1, -1, 13])
    cache = torch.randint(0, 256, (16, ops.record_bytes(fmt, dim)), generator=g, dtype=torch.uint8)
    want = ops.cache_write.reference(cache.clone(), slots, x, fmt)
    got = cuda_backend.cache_write(cache.cuda(), slots.cuda(), x.cuda(), fmt)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)
    # records inside engine rows wider than a record (vLLM's window row also holds the token id and position;
    # its packed compressed rows hold several sources' records, so a record may start mid-row)
    table = torch.randint(0, 256, (16, 4 + cache.shape[1] + 16), generator=g, dtype=torch.uint8)
    columns = slice(4, 4 + cache.shape[1])
    want_table = table.clone()
    ops.cache_write.reference(want_table[:, columns], slots, x, fmt)
    gpu_table = table.cuda()
    cuda_backend.cache_write(gpu_table[:, columns], slots.cuda(), x.cuda(), fmt)
    torch.cuda.synchronize()
    assert torch.equal(gpu_table.cpu(), want_table)


class RecordingExtension:
    """Stands in for the compiled module: records which attention variant the dispatcher called."""

    def __init__(self):
        self.calls = []

    def sparse_attention_mma(self, *args):
        self.calls.append("mma")

    def sparse_attention_simt(self, *args):
        self.calls.append("simt")

    def sparse_attention_wgmma(self, *args):
        self.calls.append("wgmma")

    def sparse_attention_tcgen05(self, *args):
        self.calls.append("tcgen05")


@pytest.mark.parametrize("forced,rows,dim,major,expected", [
    ("", 64, 512, 9, "mma"), ("", 64, 72, 9, "simt"), ("", 1, 512, 9, "declined"), ("", 31, 512, 9, "declined"),
    ("", 64, 512, 10, "mma"),  # the unverified arch-specific kernels are never picked by default
    ("mma", 1, 512, 9, "mma"), ("simt", 1, 512, 9, "simt"), ("mma", 64, 72, 9, "declined"),
    ("wgmma", 64, 512, 9, "wgmma"), ("wgmma", 64, 512, 10, "declined"), ("wgmma", 64, 96, 9, "declined"),
    ("tcgen05", 1, 512, 10, "tcgen05"), ("tcgen05", 64, 512, 9, "declined"), ("tcgen05", 64, 96, 10, "declined"),
])
def test_attention_variant_dispatch(monkeypatch, forced, rows, dim, major, expected):
    """Declined calls (NotImplemented) go to the registry's next choice, Triton."""
    recorder = RecordingExtension()
    monkeypatch.setattr(cuda_backend, "_ext", recorder)
    monkeypatch.setenv(cuda_backend.ATTENTION_ENV, forced)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    q = torch.zeros(rows, 2, dim, dtype=torch.bfloat16)
    result = cuda_backend.sparse_attention(q, torch.zeros(4, dim, dtype=torch.bfloat16),
                                           torch.zeros(rows, 3, dtype=torch.long), torch.zeros(2), 0.1)
    if expected == "declined":
        assert result is NotImplemented and recorder.calls == []
    else:
        assert recorder.calls == [expected]


def test_attention_variant_env_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv(cuda_backend.ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="DEEPINFER_CUDA_ATTENTION"):
        cuda_backend.sparse_attention(torch.zeros(1, 2, 64, dtype=torch.bfloat16), None, None, None, 0.1)


def records_inputs(t, h, d, g):
    """q and two record caches as the model hands them over: window rows shared by neighbouring query rows,
    compressed entries picked per row, -1 in both."""
    window_cache = ops.pack_cache_records(torch.randn(40, d, generator=g), "fp8_window")
    compressed_cache = ops.pack_cache_records(torch.randn(90, d, generator=g), "nvfp4")
    window_slots = (torch.arange(t)[:, None] + torch.arange(16)[None, :]) % 40
    window_slots[:, :3] = -1
    compressed_slots = torch.randint(0, 90, (t, 24), generator=g)
    compressed_slots[::3, -4:] = -1
    q = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    return q, window_cache, window_slots, compressed_cache, compressed_slots, torch.randn(h, generator=g)


class ReferenceExtension(RecordingExtension):
    """Stands in for the compiled module with the reference math, so the records path runs on any machine."""

    def sparse_attention_mma(self, q, pool, indices, sink, scale):
        self.calls.append("mma")
        return ops.sparse_attention.reference(q, pool, indices, sink, scale)


def test_records_attention_decodes_each_key_once_then_runs_the_tensor_core_kernel(monkeypatch):
    monkeypatch.setattr(cuda_backend, "_ext", ReferenceExtension())
    monkeypatch.delenv(cuda_backend.ATTENTION_ENV, raising=False)
    args = records_inputs(cuda_backend.MMA_FROM_ROWS + 8, 8, 64, torch.Generator().manual_seed(3))
    got = cuda_backend.sparse_attention_records(*args, 0.125)
    assert cuda_backend._ext.calls == ["mma"]
    assert torch.equal(got, ops.sparse_attention_records.reference(*args, 0.125))
    assert cuda_backend.sparse_attention_records(*records_inputs(4, 8, 64, torch.Generator()), 0.125) is NotImplemented


def test_records_attention_leaves_rows_with_their_own_keys_to_triton(monkeypatch):
    """A batch of decodes: every row reads keys no other row reads, so a pool would only add a decode pass."""
    monkeypatch.setattr(cuda_backend, "_ext", ReferenceExtension())
    monkeypatch.delenv(cuda_backend.ATTENTION_ENV, raising=False)
    t, g = cuda_backend.MMA_FROM_ROWS + 8, torch.Generator().manual_seed(4)
    window_cache = ops.pack_cache_records(torch.randn(t * 16, 64, generator=g), "fp8_window")
    compressed_cache = ops.pack_cache_records(torch.randn(t * 8, 64, generator=g), "nvfp4")
    window_slots = torch.arange(t * 16).view(t, 16)
    compressed_slots = torch.arange(t * 8).view(t, 8)
    q = torch.randn(t, 8, 64, generator=g).to(torch.bfloat16)
    args = (q, window_cache, window_slots, compressed_cache, compressed_slots, torch.randn(8, generator=g), 0.125)
    assert cuda_backend.sparse_attention_records(*args) is NotImplemented and cuda_backend._ext.calls == []
    monkeypatch.setenv(cuda_backend.ATTENTION_ENV, "mma")  # a forced variant pools whatever the sharing
    assert torch.equal(cuda_backend.sparse_attention_records(*args), ops.sparse_attention_records.reference(*args))
    assert cuda_backend._ext.calls == ["mma"]


@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_records_attention_on_the_device(ext, monkeypatch, variant):
    monkeypatch.setenv(cuda_backend.ATTENTION_ENV, variant)
    q, wc, ws, cc, cs, sink = records_inputs(48, 64, 512, torch.Generator().manual_seed(5))
    want = ops.sparse_attention_records.reference(q.float(), wc, ws, cc, cs, sink, 0.04)
    got = cuda_backend.sparse_attention_records(q.cuda(), wc.cuda(), ws.cuda(), cc.cuda(), cs.cuda(), sink.cuda(),
                                                0.04)
    torch.cuda.synchronize()
    assert_attention_close(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_to_fp32_is_one_fp32_output_gemm_on_the_stored_weight(dtype):
    """Shapes and dtypes through torch's own meta function of ``mm`` with ``out_dtype`` (the values need cuBLAS)."""
    x, weight = torch.empty(2, 5, 96, dtype=dtype, device="meta"), torch.empty(70, 96, dtype=dtype, device="meta")
    y = cuda_backend.linear_to_fp32(x, weight)
    assert y.shape == (2, 5, 70) and y.dtype == torch.float32


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.float16), (torch.float32, torch.float32)])
def test_linear_to_fp32_declines_what_cublas_cannot_take(x_dtype, w_dtype):
    x, weight = torch.zeros(3, 64, dtype=x_dtype), torch.zeros(8, 64, dtype=w_dtype)
    assert cuda_backend.linear_to_fp32(x, weight) is NotImplemented


@needs_cuda
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_linear_to_fp32_matches_the_reference_on_the_device(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 4096, generator=g).to(torch.bfloat16).cuda()
    weight = (torch.randn(1000, 4096, generator=g) * 0.02).to(torch.bfloat16).cuda()
    y = cuda_backend.linear_to_fp32(x, weight)
    expected = ops.linear_to_fp32.reference(x, weight)  # bf16 products are exact in fp32: only the order differs
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


# --- registration and a failed build (any machine) -------------------------------------------------------------

class _Recorder:
    """Records what the backend registers and refuses; its CUDA check says a GPU of ``major`` is there."""

    def __init__(self, major):
        self.major, self.registered, self.unavailable = major, set(), {}

    def cuda_major(self, backend):
        return self.major

    def register_backend(self, op_name, backend, fn, automatic=True):
        self.registered.add(op_name)

    def mark_unavailable(self, backend, reason):
        self.unavailable[backend] = reason


EXTENSION_OPS = {"cache_write", "sparse_attention", "sparse_attention_records"}


@pytest.mark.parametrize("sources, cuda_home, registered, reason", [
    (True, "/usr/local/cuda", EXTENSION_OPS | {"linear_to_fp32"}, None),
    (True, None, {"linear_to_fp32"}, "nvcc"),
    (False, "/usr/local/cuda", {"linear_to_fp32"}, "sources"),
])
def test_registers_the_compiled_kernels_only_where_they_can_be_built(monkeypatch, tmp_path, sources, cuda_home,
                                                                       registered, reason):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cuda_backend, "cuda_sources", lambda: tmp_path if sources else None)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cuda_home)
    recorder = _Recorder(major=9)
    cuda_backend.deepinfer_register_ops(recorder)
    assert recorder.registered == registered
    assert (reason is None and not recorder.unavailable) or reason in recorder.unavailable["cuda"]


def test_the_cuda_sources_are_found_in_the_checkout():
    assert cuda_backend.cuda_sources() == Path(__file__).resolve().parents[1]


def test_a_failed_build_declines_every_kernel_and_is_not_retried(monkeypatch, tmp_path, caplog):
    (tmp_path / "build.py").write_text("def load():\n    raise RuntimeError('nvcc fatal: sm_103a')\n")
    monkeypatch.setattr(cuda_backend, "cuda_sources", lambda: tmp_path)
    monkeypatch.setattr(cuda_backend, "_ext", None)
    monkeypatch.setattr(cuda_backend, "_ext_failure", None)
    monkeypatch.delenv(cuda_backend.ATTENTION_ENV, raising=False)
    q = torch.zeros(64, 2, 512, dtype=torch.bfloat16)
    pool, indices = torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(64, 3, dtype=torch.long)
    with caplog.at_level("WARNING"):
        assert cuda_backend.sparse_attention(q, pool, indices, torch.zeros(2), 0.1) is NotImplemented
        assert cuda_backend.cache_write(torch.zeros(4, 528, dtype=torch.uint8), torch.zeros(1, dtype=torch.long),
                                        torch.zeros(1, 512), "fp8_window") is NotImplemented
        assert cuda_backend.sparse_attention_records(q, None, None, None, None, None, 0.1) is NotImplemented
    assert len([record for record in caplog.records if "failed to build" in record.message]) == 1
    assert "sm_103a" in cuda_backend._ext_failure
