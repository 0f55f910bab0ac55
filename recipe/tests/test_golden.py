"""Golden prompts (test-data/<api>/<case>.json -> .txt), produced by deepseek-recipe 0.2.0.

Runs without the official package: our renderer must reproduce every file byte for byte.
"""
import glob
import json
import os

import pytest

import deepinfer_recipe as dr

ROOT = os.path.join(os.path.dirname(__file__), "..", "test-data")
CASES = sorted(glob.glob(os.path.join(ROOT, "*", "*.json")))


@pytest.mark.parametrize("path", CASES, ids=[os.path.relpath(p, ROOT) for p in CASES])
def test_golden_prompt(path):
    api = os.path.basename(os.path.dirname(path))
    with open(path, encoding="utf-8") as f:
        req = json.load(f)
    with open(path[:-5] + ".txt", encoding="utf-8", newline="") as f:
        want = f.read()
    got = dr.render(req, api).prompt
    assert got == want, f"first difference at {next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"


def test_golden_files_present():
    assert len(CASES) >= 30
