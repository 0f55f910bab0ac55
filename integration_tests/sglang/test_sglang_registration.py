"""DeepInfer inside SGLang 0.5.23, on CPU: plugin, registries, server args, and the model adapter's numbers.

Guarantees (each test names the SGLang code path it goes through):
  * SGLang's own plugin loader (``sglang.srt.plugins.load_plugins``) discovers the ``deepinfer`` entry point
    and runs it (fresh subprocesses, so registration state never leaks between tests);
  * the tiny V4.1 checkpoint's config, loaded by SGLang's config loader, resolves through SGLang's
    ``get_model_architecture`` to DeepInfer's class, and to upstream's ``DeepseekV4ForCausalLM`` with
    ``DEEPINFER_SGLANG_KEEP_UPSTREAM=1``;
  * no speculative algorithm is registered: ``DEEPINFER_DSPARK`` is not in SGLang's registry, and SGLang's
    server-args resolution of ``--speculative-algorithm DEEPINFER_DSPARK`` fails with our error naming what
    works instead;
  * the SGLang model class builds from SGLang's config object, loads the checkpoint through ``load_weights``
    fed by SGLang's safetensors iterator, and its logits for real ``ForwardBatch``es (EXTEND of two requests,
    chunked EXTEND, a radix-style shared prefix, DECODE, TARGET_VERIFY and a rollback) equal the core model's.
    SGLang's model runner cannot start without a GPU here, so the batch is built by hand and the attention
    backend published in SGLang's ForwardContext is a stand-in that only carries SGLang's real ReqToTokenPool.

Run: .venv-sglang/bin/python -m pytest integration_tests/sglang -q   (setup: setup_sglang_venv.sh)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

try:
    import sglang  # noqa: F401
except Exception as exc:  # ImportError, or a broken CUDA-only dependency
    pytest.skip(f"sglang is not importable ({exc!r}); run integration_tests/sglang/setup_sglang_venv.sh and use "
                ".venv-sglang/bin/python", allow_module_level=True)

import torch

from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM as CoreModel
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint
from integration_tests.host_reads import TOKEN_CHECK, HostReadWatch

PRESET = "tiny-vocab256"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), PRESET)


def run_sglang(code: str, **env) -> dict:
    """Run ``code`` in a fresh interpreter after SGLang's own plugin loading; it prints one JSON line last."""
    prelude = "import json\nfrom sglang.srt.plugins import load_plugins\nload_plugins()\n"
    full_env = {**os.environ, "SGLANG_PLUGINS": "deepinfer", **env}
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- plugin, registries, server args (subprocesses) ---------------------------------------------------------
RESOLVE = """
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.utils import get_model_architecture
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
import deepinfer_plugins.sglang.register as reg
cls, arch = get_model_architecture(ModelConfig({ckpt!r}))
direct = ModelRegistry.resolve_model_cls(["DeepseekV41ForCausalLM"])[0]
ours = ModelRegistry.resolve_model_cls(["DeepInferDeepseekV41ForCausalLM"])[0]
from sglang.srt.speculative.spec_registry import get_spec
try:
    SpeculativeAlgorithm.from_string("deepinfer_dspark")
    refusal = None
except ValueError as exc:
    refusal = dict(error=type(exc).__name__, message=str(exc))
reg.register()  # a second call must be a no-op
print(json.dumps(dict(cls=cls.__module__ + "." + cls.__name__, arch=arch,
                      direct=direct.__module__ + "." + direct.__name__, ours=ours.__module__ + "." + ours.__name__,
                      spec=get_spec("DEEPINFER_DSPARK") is not None, refusal=refusal, eagle=str(
                          SpeculativeAlgorithm.from_string("EAGLE")), registered=reg._registered)))
"""


def assert_refused(refusal: dict) -> None:
    """Asking for DEEPINFER_DSPARK fails with our error, which names the working alternatives."""
    assert refusal["error"] == "UnavailableAlgorithmError", refusal
    for hint in ("without --speculative-algorithm", "vLLM", "--speculative-algorithm DSPARK",
                 "DEEPINFER_SGLANG_KEEP_UPSTREAM=1"):
        assert hint in refusal["message"], (hint, refusal["message"])


def test_plugin_loader_registers_the_model_and_no_algorithm(checkpoint):
    out = run_sglang(RESOLVE.format(ckpt=str(checkpoint)))
    assert out["registered"] is True
    assert out["arch"] == "DeepseekV41ForCausalLM"
    assert out["cls"] == "deepinfer_plugins.sglang.model.DeepseekV41ForCausalLM"
    assert out["direct"] == "deepinfer_plugins.sglang.model.DeepseekV41ForCausalLM"
    assert out["ours"] == "deepinfer_plugins.sglang.model.DeepInferDeepseekV41ForCausalLM"
    assert out["spec"] is False
    assert_refused(out["refusal"])
    assert out["eagle"] == "SpeculativeAlgorithm.EAGLE"  # other names reach SGLang unchanged


def test_keep_upstream_switch_leaves_v41_to_sglang(checkpoint):
    code = RESOLVE.replace('direct = ModelRegistry.resolve_model_cls(["DeepseekV41ForCausalLM"])[0]',
                           'direct = int')
    out = run_sglang(code.format(ckpt=str(checkpoint)), DEEPINFER_SGLANG_KEEP_UPSTREAM="1")
    assert out["arch"] == "DeepseekV4ForCausalLM"
    assert out["cls"] == "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM"
    assert out["ours"] == "deepinfer_plugins.sglang.model.DeepInferDeepseekV41ForCausalLM"
    assert out["spec"] is False
    assert_refused(out["refusal"])


def test_plugin_not_loaded_when_filtered_out(checkpoint):
    """SGLANG_PLUGINS is SGLang's allowlist: without our name nothing of ours is registered."""
    out = run_sglang("""
        from sglang.srt.speculative.spec_registry import get_spec
        from sglang.srt.models.registry import ModelRegistry
        print(json.dumps(dict(spec=get_spec("DEEPINFER_DSPARK") is not None,
                              arch="DeepInferDeepseekV41ForCausalLM" in ModelRegistry.get_supported_archs())))
        """, SGLANG_PLUGINS="some-other-plugin")
    assert out == {"spec": False, "arch": False}


SERVER_ARGS = """
from sglang.srt.server_args import prepare_server_args
results = {{}}
for name, extra in {cases!r}.items():
    try:
        args = prepare_server_args(["--model-path", {ckpt!r}, "--device", "cpu",
                                    "--speculative-algorithm", "DEEPINFER_DSPARK", *extra])
        args.resolve_once()
        results[name] = None
    except Exception as exc:
        results[name] = dict(error=type(exc).__name__, message=str(exc))
print(json.dumps(results))
"""


def test_server_args_refuse_the_algorithm(checkpoint):
    """SGLang's own server-args resolution of ``--speculative-algorithm DEEPINFER_DSPARK`` fails with our error,
    whatever DSpark flags come with it."""
    cases = {"default": [], "block4": ["--speculative-dspark-block-size", "4"],
             "window": ["--speculative-num-draft-tokens", "5"]}
    out = run_sglang(SERVER_ARGS.format(cases=cases, ckpt=str(checkpoint)))
    for case in cases:
        assert out[case] is not None, case
        assert_refused(out[case])


# ---- the model adapter against the core model (in process) ---------------------------------------------------
@pytest.fixture(scope="module")
def models(checkpoint):
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.utils.hf_transformers_utils import get_config

    from deepinfer_plugins.sglang.model import DeepInferDeepseekV41ForCausalLM

    config = get_config(str(checkpoint), trust_remote_code=False)  # SGLang's (flattened) V4.1 config
    assert config.model_type == "deepseek_v41" and not hasattr(config, "text_config")
    adapter = DeepInferDeepseekV41ForCausalLM(config).eval()
    files = sorted(str(f) for f in checkpoint.glob("*.safetensors"))
    loaded = adapter.load_weights(safetensors_weights_iterator(files))
    core = CoreModel.from_pretrained(checkpoint, with_drafter=False)
    assert loaded == set(core.state_dict())
    return adapter, core


def test_load_weights_matches_core_loader(models):
    adapter, core = models
    ours, ref = adapter.model.state_dict(), core.state_dict()
    assert ours.keys() == ref.keys()
    for name in ref:
        assert ours[name].dtype == ref[name].dtype, name
        assert torch.equal(ours[name].view(torch.uint8) if ours[name].element_size() == 1 else ours[name],
                           ref[name].view(torch.uint8) if ref[name].element_size() == 1 else ref[name]), name


def test_load_weights_rejects_missing_and_foreign_tensors(checkpoint):
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.utils.hf_transformers_utils import get_config

    from deepinfer_plugins.models.deepseek_v41 import CheckpointError
    from deepinfer_plugins.sglang.model import DeepInferDeepseekV41ForCausalLM

    config = get_config(str(checkpoint), trust_remote_code=False)
    files = sorted(str(f) for f in checkpoint.glob("*.safetensors"))
    weights = list(safetensors_weights_iterator(files))
    with pytest.raises(CheckpointError, match="missing tensor"):
        DeepInferDeepseekV41ForCausalLM(config).load_weights(w for w in weights if w[0] != "embed.weight")
    with pytest.raises(CheckpointError, match="unexpected tensor 'layers.99.foo'"):
        DeepInferDeepseekV41ForCausalLM(config).load_weights(weights + [("layers.99.foo", torch.zeros(1))])


class Engine:
    """The bookkeeping SGLang's scheduler does around a forward: req_to_token rows, scattered slot ids."""

    def __init__(self, model, max_len: int = 64):
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.model = model
        self.pool = ReqToTokenPool(size=8, max_context_len=max_len, device="cpu", enable_memory_saver=False)
        self.free = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:400].tolist()  # not contiguous
        self.backend = SimpleNamespace(req_to_token_pool=self.pool, token_to_kv_pool=None)  # stand-in, see module doc

    def alloc(self, n: int) -> torch.Tensor:
        out, self.free = self.free[:n], self.free[n:]
        return torch.tensor(out, dtype=torch.int64)

    def forward(self, mode, reqs, mm_inputs=None):
        """reqs: [(req_pool_idx, start_pos, token ids)] -> next_token_logits. ``mm_inputs``: one
        ``MultimodalInputs`` or None per request, as the scheduler attaches them to an EXTEND batch."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        locs = []
        for idx, start, tokens in reqs:
            loc = self.alloc(len(tokens))
            self.pool.write((idx, slice(start, start + len(tokens))), loc.to(torch.int32))
            locs.append(loc)
        lens = [len(t) for _, _, t in reqs]
        fb = ForwardBatch(
            forward_mode=getattr(ForwardMode, mode), batch_size=len(reqs),
            input_ids=torch.tensor([t for _, _, ts in reqs for t in ts]),
            req_pool_indices=torch.tensor([i for i, _, _ in reqs]),
            seq_lens=torch.tensor([s + n for (_, s, _), n in zip(reqs, lens)]),
            out_cache_loc=torch.cat(locs), seq_lens_sum=sum(s + n for (_, s, _), n in zip(reqs, lens)),
            positions=torch.cat([torch.arange(s, s + n) for (_, s, _), n in zip(reqs, lens)]),
            extend_seq_lens_cpu=lens if mode == "EXTEND" else None,
            extend_prefix_lens_cpu=[s for _, s, _ in reqs] if mode == "EXTEND" else None, mm_inputs=mm_inputs)
        with forward_context(ForwardContext(attn_backend=self.backend)):
            return self.model(fb.input_ids, fb.positions, fb).next_token_logits


def reference(core, tokens: list[int]) -> torch.Tensor:
    """The core model's logits for every position of a fresh sequence [T, vocab]."""
    with torch.no_grad():
        return core(torch.tensor(tokens))


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_forward_batches_match_core_model(models):
    adapter, core = models
    g = torch.Generator().manual_seed(1)
    vocab = core.args.vocab_size
    a = torch.randint(3, vocab - 8, (13,), generator=g).tolist()  # ids away from pad / image / noise ids
    b = torch.randint(3, vocab - 8, (7,), generator=g).tolist()
    eng = Engine(adapter)

    # EXTEND of two requests in one batch; A is chunked (9 now, 4 with a cached prefix next).
    out = eng.forward("EXTEND", [(1, 0, a[:9]), (2, 0, b)])
    close(out[0], reference(core, a[:9])[-1])
    close(out[1], reference(core, b)[-1])
    out = eng.forward("EXTEND", [(1, 9, a[9:])])
    close(out[0], reference(core, a)[-1])

    # DECODE one token for both.
    a.append(int(out[0].argmax()))
    b.append(5)
    out = eng.forward("DECODE", [(1, len(a) - 1, a[-1:]), (2, len(b) - 1, b[-1:])])
    close(out[0], reference(core, a)[-1])
    close(out[1], reference(core, b)[-1])

    # TARGET_VERIFY: anchor + 2 drafts per request, logits for every row.
    drafts_a, drafts_b = [7, 9], [11, 12]
    a_anchor, b_anchor = int(out[0].argmax()), int(out[1].argmax())
    out = eng.forward("TARGET_VERIFY", [(1, len(a), [a_anchor] + drafts_a), (2, len(b), [b_anchor] + drafts_b)])
    close(out[:3], reference(core, a + [a_anchor] + drafts_a)[-3:])
    close(out[3:], reference(core, b + [b_anchor] + drafts_b)[-3:])

    # Rollback: A keeps anchor + 1 draft, B keeps the anchor only; rejected slots are simply not referenced.
    a += [a_anchor, drafts_a[0]]
    b += [b_anchor]
    out = eng.forward("DECODE", [(1, len(a), [3]), (2, len(b), [4])])
    close(out[0], reference(core, a + [3])[-1])
    close(out[1], reference(core, b + [4])[-1])

    # Radix-cache style prefix sharing: C reuses A's first 10 slots and extends with its own tokens.
    c = a[:10] + [21, 22, 23]
    eng.pool.write((3, slice(0, 10)), eng.pool.req_to_token[1, :10].clone())
    out = eng.forward("EXTEND", [(3, 10, c[10:])])
    close(out[0], reference(core, c)[-1])


def test_rollback_into_a_group_pooled_during_verification(models):
    """An odd-length prefix: TARGET_VERIFY pools (anchor, draft 1) and (draft 2, draft 3) into ratio-2 entries;
    keeping the anchor and one draft leaves draft 1 alone in the open group of the next forward, whose compressor
    input must be read back from its slot."""
    adapter, core = models
    g = torch.Generator().manual_seed(5)
    a = torch.randint(3, core.args.vocab_size - 8, (9,), generator=g).tolist()
    eng = Engine(adapter)
    eng.forward("EXTEND", [(1, 0, a)])
    anchor, drafts = 17, [18, 19, 20]
    eng.forward("TARGET_VERIFY", [(1, len(a), [anchor] + drafts)])
    a += [anchor, drafts[0]]  # positions 9, 10 kept; 11, 12 rejected
    for token in (4, 5, 6, 7, 8, 9):  # the entry of (10, 11) stays visible to every later query
        out = eng.forward("DECODE", [(1, len(a), [token])])
        a.append(token)
        close(out[0], reference(core, a)[-1])


def test_host_reads_do_not_grow_with_the_batch(models):
    """Each host read of a tensor stalls a GPU: a forward makes the same few whatever its number of requests."""
    adapter, core = models
    g = torch.Generator().manual_seed(3)
    prompts = {i: torch.randint(3, core.args.vocab_size - 8, (5 + i,), generator=g).tolist() for i in (1, 2, 3, 4)}
    eng = Engine(adapter)
    eng.forward("EXTEND", [(i, 0, p) for i, p in prompts.items()])

    def reads(requests):
        watch = HostReadWatch()
        with watch:
            eng.forward("DECODE", [(i, len(prompts[i]), [5]) for i in requests])
        for i in requests:
            prompts[i].append(5)
        return dict(watch.sites)

    one, four = reads([1]), reads([1, 2, 3, 4])
    assert one == four
    assert set(four) <= {("sglang/model.py", "sequence_chunks"), TOKEN_CHECK}, four


def test_verify_translation_on_target_verify_logits(models):
    """spec_decode.verify_from_target_logits on a real TARGET_VERIFY forward: greedy drafts equal to the target's
    own greedy choices are all accepted (plus the bonus token); a wrong second draft stops acceptance at 1."""
    from deepinfer_plugins.sglang.spec_decode import verify_from_target_logits

    adapter, core = models
    prompt = list(range(10, 22))
    greedy = []
    seq = list(prompt)
    for _ in range(3):
        seq.append(int(reference(core, seq)[-1].argmax()))
        greedy.append(seq[-1])
    anchor, drafts = greedy[0], greedy[1:3]
    eng = Engine(adapter)
    eng.forward("EXTEND", [(1, 0, prompt)])
    logits = eng.forward("TARGET_VERIFY", [(1, len(prompt), [anchor] + drafts)])
    bonus = int(reference(core, prompt + [anchor] + drafts)[-1].argmax())
    result = verify_from_target_logits(logits, torch.tensor([drafts]), torch.tensor([2]))
    assert result.num_accepted.tolist() == [2] and result.is_bonus.tolist() == [True]
    assert result.committed[0].tolist() == drafts + [bonus]
    wrong = [drafts[0], (drafts[1] + 1) % core.args.vocab_size]
    result = verify_from_target_logits(logits, torch.tensor([wrong]), torch.tensor([2]))
    assert result.num_accepted.tolist() == [1] and result.committed[0].tolist() == [drafts[0], drafts[1], -1]
    assert result.kv_keep.tolist() == [2]
