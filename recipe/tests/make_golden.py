"""Regenerate test-data/ golden files from the official package (run by hand).

Each case: test-data/<api>/<name>.json (request) and <name>.txt (exact prompt from
deepseek_recipe 0.2.0). The golden test reads them without the official package.
"""
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))
import gen  # noqa: E402
import oracle  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "test-data")
HAND = {
    "chat": {
        "plain_v41": {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "Hello"}]},
        "plain_v4_nothink": {"model": "DeepSeek-V4-Pro", "thinking": {"type": "disabled"},
                             "messages": [{"role": "user", "content": "Hello"}]},
        "effort_max_v4": {"model": "DeepSeek-V4-Pro", "reasoning_effort": "max",
                          "messages": [{"role": "user", "content": "Hi"}]},
        "json_mode_v4": {"model": "DeepSeek-V4-Pro", "thinking": {"type": "disabled"},
                         "response_format": {"type": "json_object"},
                         "messages": [{"role": "user", "content": "Give me a JSON with key a."}]},
        "prefix_v41": {"model": "DeepSeek-V4.1-Flash", "messages": [
            {"role": "user", "content": "Write a haiku"},
            {"role": "assistant", "content": "Autumn", "reasoning_content": "A seasonal haiku.",
             "prefix": True}]},
        "required_tool_v41": {"model": "DeepSeek-V4.1-Flash", "thinking": {"type": "disabled"},
                              "tool_choice": "required", "messages": [{"role": "user", "content": "go"}],
                              "tools": [{"type": "function", "function": {
                                  "name": "f", "parameters": {"type": "object"}}}]},
    },
}


def main():
    for api in ("chat", "responses", "messages"):
        d = os.path.join(ROOT, api)
        os.makedirs(d, exist_ok=True)
        cases = dict(HAND.get(api, {}))
        for seed in range(12):
            cases[f"generated_{seed:02d}"] = gen.GENERATORS[api](random.Random(1000 + seed))
        for name, req in cases.items():
            res = oracle.render(req, api)
            if res[0] != "ok":
                continue
            with open(os.path.join(d, name + ".json"), "w", encoding="utf-8") as f:
                json.dump(req, f, ensure_ascii=False, indent=1)
            with open(os.path.join(d, name + ".txt"), "w", encoding="utf-8", newline="") as f:
                f.write(res[1])


if __name__ == "__main__":
    main()
