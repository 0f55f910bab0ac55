"""Output parsing: chunking independence (ours), never raising on malformed output, strict
mode, and the official package's final responses for well-formed outputs."""
import json
import random
import re

import pytest

import deepinfer_recipe as dr
import outgen
import gen

M = "DeepSeek-V4.1-Flash"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
RAW = ('Need tool.\n</think>Let me check.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
       '<｜DSML｜ parameter name="city" string="true">Pa"ris</｜DSML｜ parameter>\n'
       '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
       '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def _norm(x):
    s = json.dumps(x, sort_keys=True)
    s = re.sub(r'call_(\d\d)_[^"]+', r"call_\1_X", s)
    return json.loads(s)


def _json_mode(req):
    return req.get("response_format", {}).get("type") == "json_object" or \
        req.get("text", {}).get("format", {}).get("type") == "json_object"


def test_tool_call_parsed():
    req = {"model": M, "messages": [{"role": "user", "content": "w"}], "tools": TOOLS}
    r = dr.parse(RAW, req, "chat", created=0)
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "Need tool."
    assert msg["content"] == "Let me check."
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": 'Pa"ris', "days": 3}
    assert r["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_result_independent_of_chunking(api, seed):
    """A request that conversion refuses is refused by parsing with the same error. In JSON mode
    each chunk of prose outside the JSON becomes one space, so there the results agree once runs
    of spaces are collapsed."""
    r = random.Random(seed)
    req = gen.GENERATORS[api](r)
    try:
        dr.convert(req, api)
    except dr.RecipeError as refused:
        with pytest.raises(dr.RecipeError) as parsed:
            dr.parse("x", req, api)
        assert (parsed.value.status, parsed.value.message) == (refused.status, refused.message)
        return
    raw, _, fin = outgen.output(r, req, api)
    one = dr.parse([raw], req, api, finish_reason=fin, created=0)
    for _ in range(3):
        pieces = outgen.chunk(r, raw)
        many = dr.parse(pieces, req, api, finish_reason=fin, created=0)
        a, b = _norm(one), _norm(many)
        for x in (a, b):  # usage counts pieces
            x.pop("usage", None)
            if isinstance(x.get("response"), dict):
                x["response"].pop("usage", None)
        if _json_mode(req):
            a, b = (re.sub(" +", " ", json.dumps(x, sort_keys=True)) for x in (a, b))
        assert a == b


@pytest.mark.parametrize("strict", [False, True])
def test_strict_flag(strict):
    opts = dr.ParsingOptions(parse_tool_calls=True, thinking_initial_stage=None)
    p = dr.StreamParser(opts, strict=strict)
    p.feed('<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="q" ')
    tail = 'string="maybe">x</｜DSML｜ parameter>'
    if strict:
        with pytest.raises(dr.ParseError):
            p.feed(tail)
    else:
        p.feed(tail)
        _, res = p.finish("length")
        assert res.tool_calls[0].arguments.startswith('{"q": ')


def test_truncated_never_raises():
    req = {"model": M, "messages": [{"role": "user", "content": "w"}], "tools": TOOLS}
    for cut in range(0, len(RAW), 7):
        r = dr.parse(RAW[:cut], req, "chat", finish_reason="length")
        assert r["choices"][0]["finish_reason"] in ("length", "tool_calls")


oracle = None
try:
    import oracle  # noqa: F811
except ImportError:
    pass


@pytest.mark.skipif(oracle is None, reason="deepseek_recipe (official package) not installed")
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_wellformed_output_matches_official(api):
    req = {"model": M, "messages": [{"role": "user", "content": "w"}], "tools": TOOLS} \
        if api == "chat" else None
    if api == "messages":
        req = {"model": M, "max_tokens": 100, "messages": [{"role": "user", "content": "w"}],
               "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}
    if api == "responses":
        req = {"model": M, "input": "w", "tools": [{"type": "function", "name": "get_weather",
                                                   "parameters": {"type": "object"}}]}
    r = random.Random(0)
    for _ in range(5):
        pieces = outgen.chunk(r, RAW)
        want = _norm(oracle.parse(req, api, pieces, created=0))
        got = _norm(dr.parse(pieces, req, api, prompt_tokens=10, created=0))
        for x in (want, got):
            for k in ("created_at", "completed_at"):
                x.pop(k, None)
        assert got == want
