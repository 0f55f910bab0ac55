"""Random model outputs (valid, malformed and truncated) and random chunkings."""
from __future__ import annotations

import json
import random

PIECES = ["Hello", " world", "\n", "\n\n", "数据", "🔎", "<", "｜", "</th", "x < y", "END", "{\"a\": 1}",
          "```json\n", "\n```", "ink>", "</think>", "<｜DSML｜", "DSML"]


STRINGS = ["Pa\"ris", "a\nb", "数据", "x<y", ""]


def dsml_block(r: random.Random, v41: bool) -> str:
    D = "｜DSML｜"
    calls, inv, par = (" calls", " invoke", " parameter") if v41 else ("tool_calls", "invoke", "parameter")
    s = f"<{D}{calls}>\n"
    for _ in range(r.randint(0, 2)):
        s += f'<{D}{inv} name="tool_{r.randint(0, 2)}">\n'
        for k in range(r.randint(0, 3)):
            if r.random() < 0.5:
                v = r.choice(STRINGS)
                s += f'<{D}{par} name="p{k}" string="true">{v}</{D}{par}>\n'
            else:
                s += f'<{D}{par} name="p{k}" string="false">{json.dumps(r.choice([3, [1, 2], {"k": None}, 2.5]))}</{D}{par}>\n'
        s += f"</{D}{inv}>\n"
    s += f"</{D}{calls}>"
    return s


def text(r: random.Random) -> str:
    return "".join(r.choice(PIECES[:12]) for _ in range(r.randint(0, 6)))


def output(r: random.Random, req: dict, api: str):
    """-> (raw, pieces, engine finish reason)."""
    v41 = "4.1" in req["model"]
    raw = ""
    if r.random() < 0.8:
        raw += r.choice(["", "\n"]) + text(r) + r.choice(["\n", ""]) + "</think>"
    raw += r.choice(["", "\n\n"]) + text(r)
    if r.random() < 0.5:
        raw += r.choice(["\n\n", "\n", ""]) + dsml_block(r, r.random() < 0.8 if v41 else r.random() < 0.2)
        if r.random() < 0.2:
            raw += "trailing"
    if r.random() < 0.2:
        raw = raw[: r.randint(0, len(raw))]  # truncated output
    fin = r.choice(["stop", "stop", "stop", "length", "content_filter"])
    return raw, chunk(r, raw), fin


def chunk(r: random.Random, s: str) -> list:
    out, i = [], 0
    n = r.choice([1, 3, 8, 40])
    while i < len(s):
        k = r.randint(1, n)
        out.append(s[i:i + k])
        i += k
    return out
