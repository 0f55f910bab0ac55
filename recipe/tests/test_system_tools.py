"""V4.1 system messages that carry tools render `### Updated Tool Schemas` (V4 ignores them);
checked against the official Conversation API when it is installed."""
import pytest

import deepinfer_recipe as dr
from deepinfer_recipe.conversation import Conversation, Message, ModelVersion, ToolDefinition

F = ToolDefinition("f", "desc", {"type": "object", "properties": {"x": {"type": "number", "minimum": 1e-5}}})
H = ToolDefinition("h", "x", {"type": "object"}, defer_loading=True)
K = ToolDefinition("k", None, None)
G = ToolDefinition("g", None, {"type": "object"})


def _ours(msgs, thinking, tools, version):
    conv = Conversation(msgs, thinking, tools or [], "auto", None, "text", None)
    return dr.render_conversation(conv, version).prompt


def test_mid_conversation_system_tools_literal():
    msgs = [Message("system", ["S1"]), Message("user", ["u"]), Message("system", ["S2"], tools=[G]),
            Message("user", ["v"])]
    assert _ours(msgs, False, None, ModelVersion.V41) == (
        '<｜begin▁of▁sentence｜><｜System｜>S1<｜User｜>u<｜System｜>S2\n\n### Updated Tool Schemas\n\n'
        '{"name": "g", "description": "", "parameters": {"type": "object"}}<｜User｜>v<｜Assistant｜></think>')
    assert _ours(msgs, False, None, ModelVersion.V4) == \
        "<｜begin▁of▁sentence｜>S1\n\nS2<｜User｜>u\n\nv<｜Assistant｜></think>"


CASES = [
    ([("system", "S1", None), ("user", "u", None), ("system", "S2", [G]), ("user", "v", None)], True, None),
    ([("system", "S1", [F, H, K]), ("user", "u", None)], True, None),
    ([("system", "S1", [F, H, K]), ("user", "u", None), ("system", "", [G]), ("user", "v", None)], False, [G]),
    ([("system", "S1", [F]), ("user", "u", None)], False, [G, F]),
]


@pytest.mark.parametrize("spec,thinking,tools", CASES)
@pytest.mark.parametrize("version", [ModelVersion.V41, ModelVersion.V4])
def test_matches_official(spec, thinking, tools, version):
    d = pytest.importorskip("deepseek_recipe")

    def otool(t):
        return d.ToolDefinition(t.name, t.description, t.parameters, defer_loading=t.defer_loading)

    omsgs, msgs = [], []
    for role, text, ts in spec:
        if role == "system":
            omsgs.append(d.SystemMessage(text, tools=[otool(t) for t in ts] if ts else None))
        else:
            omsgs.append(d.UserMessage(text))
        msgs.append(Message(role, [text] if text else [], tools=ts))
    oconv = d.Conversation(omsgs, thinking_mode=thinking, tools=[otool(t) for t in tools] if tools else None)
    enc = d.DeepseekV41Encoding() if version is ModelVersion.V41 else d.DeepseekV4Encoding()
    assert _ours(msgs, thinking, tools, version) == enc.render_conversation(oconv).prompt
