"""DSpark speculative decoding in vLLM (custom_class proposer, V1 runner): greedy output with speculation is
token-identical to the core model's plain greedy decoding, and acceptance shows up in vLLM's spec-decode metrics.

Offline runs use the engine in-process in a subprocess of their own (as test_preemption.py); the /metrics check
starts a second ``vllm serve`` with the speculative config. References come from
``deepinfer_plugins.models.deepseek_v41.generate.generate`` on the fp32 core model.

Two proposers: the real one (random tiny drafter: it accepts almost nothing, but every step drafts from the
paged draft context) and a test-only subclass that plants the reference continuation (dspark_planted.py) with a
wrong last token every few steps, so vLLM's multi-token accepts and partial rejections both happen.

vLLM compiles the target's forward with speculation on (the drafter's features are outputs of the compiled body);
each run checks the log line that says so, and one run is ``enforce_eager``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from deepinfer_plugins.cli import stop_process_group
from deepinfer_plugins.models.deepseek_v41.generate import SamplingParams, generate

from .conftest import free_port

REPO = Path(__file__).resolve().parents[2]
PROPOSER = "deepinfer_plugins.vllm.spec_decode.DeepInferDSparkProposer"
PLANTED = "integration_tests.vllm.dspark_planted.PlantedDSparkProposer"
K = 3
NEW_TOKENS = 32
LOG = Path(os.environ.get("DEEPINFER_DSPARK_SERVER_LOG", "/tmp/deepinfer-dspark-server.log"))
COMPILED_LINE = ("vLLM compiles the model body and the DSpark drafter (compilation mode DYNAMO_TRACE_ONCE, DSpark "
                 "speculation)")

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    if __name__ == "__main__":
        batches, spec = json.loads(sys.argv[2]), json.loads(sys.argv[3])
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=1024, tokenizer_mode="deepinfer",
                  kv_cache_memory_bytes=int(sys.argv[4]), max_num_batched_tokens=96, disable_log_stats=False,
                  enable_prefix_caching=True, speculative_config=spec, enforce_eager=sys.argv[6] == "eager")
        params = SamplingParams(max_tokens=int(sys.argv[5]), temperature=0)
        outputs, after_batch = [], []
        for batch in batches:  # one generate call per batch: later batches hit the prefix cache of earlier ones
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
            outputs += [list(o.outputs[0].token_ids) for o in outs]
            after_batch.append({m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()})
        print("RESULT" + json.dumps({"outputs": outputs, "metrics": after_batch[-1], "after_batch": after_batch}))
""")

SHARED = [100 + (11 * j) % 4000 for j in range(260)]
# Prompt lengths 48..291; the last batch shares a 260-token prefix with the first batch's last prompt.
BATCHES = [
    [[0] + [200 + (7 * i + 13 * j) % 5000 for j in range(47 + 23 * i)] for i in range(4)]
    + [[0] + SHARED + [7, 8, 9, 10]],
    [[0] + SHARED + [300 + j for j in range(30)]],
]
PROMPTS = [p for batch in BATCHES for p in batch]


@pytest.fixture(scope="module")
def references(core_model):
    return [generate(core_model, p, SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=(1,))) for p in PROMPTS]


@pytest.fixture(scope="module")
def planted_file(references, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dspark") / "planted.json"
    path.write_text(json.dumps([p + r for p, r in zip(PROMPTS, references, strict=True)]))
    return path


def offline(checkpoint, tmp_path, proposer: str, planted_file: Path, kv_bytes: int = 64 * 2**20,
            env: dict | None = None, eager: bool = False) -> dict:
    script = tmp_path / "offline_dspark.py"
    script.write_text(SCRIPT)
    spec = {"method": "custom_class", "model": proposer, "num_speculative_tokens": K}
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               DEEPINFER_TEST_PLANTED=str(planted_file), **(env or {}))
    result = subprocess.run([sys.executable, str(script), str(checkpoint), json.dumps(BATCHES), json.dumps(spec),
                             str(kv_bytes), str(NEW_TOKENS), "eager" if eager else "compiled"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line, result.stderr[-4000:]
    log = result.stdout + result.stderr
    if eager:
        assert "the model body runs eagerly (compilation mode NONE, DSpark speculation)" in log
    else:
        assert COMPILED_LINE in log
    return json.loads(line[len("RESULT"):])


def assert_identical(outputs, references):
    assert len(outputs) == len(references), (len(outputs), len(references))
    for i, (got, want) in enumerate(zip(outputs, references)):
        first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert got == want, f"prompt {i} ({len(PROMPTS[i])} tokens): speculative output differs at token {first}"


def test_dspark_drafter_is_lossless_and_counted(checkpoint, references, planted_file, tmp_path):
    data = offline(checkpoint, tmp_path, PROPOSER, planted_file)
    assert_identical(data["outputs"], references)
    m = data["metrics"]
    assert m["vllm:prefix_cache_hits"] >= 256, "the second batch was meant to hit the prefix cache"
    # Every decode step after the first token drafts K tokens per request (fixed verify length).
    assert m["vllm:spec_decode_num_drafts"] >= len(PROMPTS) * (NEW_TOKENS - 1) // (K + 1)
    assert m["vllm:spec_decode_num_draft_tokens"] == K * m["vllm:spec_decode_num_drafts"]
    assert 0 <= m["vllm:spec_decode_num_accepted_tokens"] <= m["vllm:spec_decode_num_draft_tokens"]
    print("random drafter:", {k: v for k, v in m.items() if "spec_decode" in k})


def test_planted_drafts_are_accepted_several_at_a_time(checkpoint, references, planted_file, tmp_path):
    data = offline(checkpoint, tmp_path, PLANTED, planted_file)
    assert_identical(data["outputs"], references)
    m = data["metrics"]
    drafts, accepted = m["vllm:spec_decode_num_draft_tokens"], m["vllm:spec_decode_num_accepted_tokens"]
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert accepted > 0.5 * drafts, f"planted drafts should mostly be accepted: {accepted}/{drafts}"
    assert accepted < drafts, "every few steps a planted draft is wrong on purpose"
    assert per_pos[K - 1] > 0 and per_pos[1] > 0, f"multi-token accepts expected, per position {per_pos}"
    print("planted:", {k: v for k, v in m.items() if "spec_decode" in k})


def test_dynamic_lengths_follow_the_load(checkpoint, references, planted_file, tmp_path):
    """DEEPINFER_DSPARK_COST_TABLE switches the proposer to Algorithm B. On a table flat up to 8 batch tokens and
    steep beyond, a lone request (batch 2) has every draft verified, while five decoding together (batch 1) cannot
    all be: some steps verify fewer than K drafts of a request. Output stays the reference's, token for token."""
    table = tmp_path / "cost.json"
    table.write_text(json.dumps({"tokens": [1, 8, 9, 64], "ms": [10.0, 10.0, 200.0, 2000.0]}))
    data = offline(checkpoint, tmp_path, PLANTED, planted_file, env={"DEEPINFER_DSPARK_COST_TABLE": str(table)},
                   eager=True)
    assert_identical(data["outputs"], references)
    crowded, alone = data["after_batch"]
    drafts, tokens = crowded["vllm:spec_decode_num_drafts"], crowded["vllm:spec_decode_num_draft_tokens"]
    assert 0 < tokens < K * drafts, f"five requests: {tokens} draft tokens in {drafts} drafts"
    drafts_alone = alone["vllm:spec_decode_num_drafts"] - drafts
    tokens_alone = alone["vllm:spec_decode_num_draft_tokens"] - tokens
    assert drafts_alone > 0 and tokens_alone == K * drafts_alone, f"one request: {tokens_alone} in {drafts_alone}"
    assert alone["vllm:spec_decode_num_accepted_tokens"] > 0
    print("dynamic:", {"crowded": (drafts, tokens), "alone": (drafts_alone, tokens_alone)})


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_server_with_dspark_speculation_reports_spec_decode_metrics(checkpoint, references, planted_file):
    port = free_port()
    spec = {"method": "custom_class", "model": PLANTED, "num_speculative_tokens": K}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", DEEPINFER_TEST_PLANTED=str(planted_file),
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, "-m", "deepinfer_plugins.cli", "serve", "--plugin", "deepinfer", str(checkpoint),
               "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--served-model-name", "tiny",
               "--max-num-batched-tokens", "512", "--speculative-config", json.dumps(spec)]
    base = f"http://127.0.0.1:{port}"
    with LOG.open("w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   cwd=REPO)
        try:
            deadline = time.time() + 600
            while True:
                assert process.poll() is None, f"vllm serve exited; log: {LOG}\n{LOG.read_text()[-4000:]}"
                assert time.time() < deadline, f"vllm serve not ready after 600 s; log: {LOG}"
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(2)
            for prompt, want in list(zip(PROMPTS, references, strict=True))[:3]:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                        "return_token_ids": True}
                raw = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
                assert raw["choices"][0]["token_ids"] == want
            text = httpx.get(f"{base}/metrics", timeout=10).text
        finally:
            stop_process_group(process)
    assert COMPILED_LINE in LOG.read_text()
    drafts = metric(text, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and draft_tokens == K * drafts
    assert 0 < accepted < draft_tokens
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    print("server:", {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted})
