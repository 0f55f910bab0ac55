"""`deepinfer-recipe render|parse`: exit code 2 and a JSON error on invalid input."""
from __future__ import annotations

import argparse
import json
import sys

from .convert import render
from .errors import RecipeError
from .output import parse


def _one(args, text: str, request_text: str | None):
    if args.cmd == "render":
        r = render(json.loads(text), args.api, tokenizer=args.tokenizer)
        return {"prompt": r.prompt, "token_ids": r.token_ids} if args.tokenizer or args.jsonl else r.prompt
    req = json.loads(request_text)
    return parse(text, req, args.api, stream=args.stream, finish_reason=args.finish_reason)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="deepinfer-recipe")
    ap.add_argument("cmd", choices=["render", "parse"])
    ap.add_argument("--api", choices=["chat", "responses", "messages"], default="chat")
    ap.add_argument("--tokenizer", help="tokenizer.json or model directory (render)")
    ap.add_argument("--request", help="request JSON file (parse)")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--finish-reason", default="stop", choices=["stop", "length", "content_filter"])
    ap.add_argument("--jsonl", action="store_true", help="one item per line (parse: {request, output})")
    args = ap.parse_args(argv)
    data = sys.stdin.read()
    try:
        if args.jsonl:
            for line in data.splitlines():
                if not line.strip():
                    continue
                if args.cmd == "parse":
                    item = json.loads(line)
                    res = _one(args, item["output"], json.dumps(item["request"]))
                else:
                    res = _one(args, line, None)
                print(json.dumps(res, ensure_ascii=False))
            return 0
        if args.cmd == "parse" and not args.request:
            raise RecipeError("--request: required for parse")
        req_text = open(args.request, encoding="utf-8").read() if args.request else None
        res = _one(args, data, req_text)
        print(res if isinstance(res, str) else json.dumps(res, ensure_ascii=False, indent=1))
        return 0
    except RecipeError as e:
        print(json.dumps({"error": {"status": e.status, "message": e.message}}, ensure_ascii=False))
        return 2
    except (ValueError, KeyError, OSError) as e:
        print(json.dumps({"error": {"status": 400, "message": f"input: {e}"}}, ensure_ascii=False))
        return 2


if __name__ == "__main__":
    sys.exit(main())
