"""The vLLM adapter's paged caches in-process, without an engine: the steps vLLM would run (chunked prefill, a
batch of decodes) go through the adapter's own ``paged_chunks`` over cache owners bound to small tensors, with
every owner's blocks scattered at random, and must give the logits of the in-memory cache run one sequence at a
time.

The same steps run under a watch for host reads of tensors (``.item()``, ``.tolist()``, ``int()``, ...): on a
GPU each one stalls the host until the device catches up. Outside the op kernels, a step may read the device
only in two places, once per step each: the token check and the stored-position audit. A read per request or per
layer anywhere else fails the test.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from integration_tests.host_reads import TOKEN_CHECK, HostReadWatch
from integration_tests.vllm.paged_caches import PagedCaches

ONCE_PER_STEP = {("vllm/cache.py", "verify"), TOKEN_CHECK}


PROMPTS = {0: 40, 1: 9, 2: 23}


def schedule(decode_steps: int):
    """Steps as vLLM might run them: request 0 prefilled in two chunks, request 2 joining in the second step,
    then decodes of all three. -> list of {request: (first position, number of tokens)}."""
    steps = [{0: (0, 24), 1: (0, 9)}, {0: (24, 16), 1: (9, 1), 2: (0, 23)}]
    steps += [{0: (40 + i, 1), 1: (10 + i, 1), 2: (23 + i, 1)} for i in range(decode_steps)]
    return steps


def run(model, steps, generator, watch: HostReadWatch | None = None, before_step=None, one_window_table=False):
    """Run ``steps`` on paged caches (greedy tokens after each prompt) and on one in-memory cache per request.
    -> largest logits difference."""
    caches = PagedCaches(model.args, len(PROMPTS), 64, generator, one_window_table)
    tokens = {r: torch.randint(0, model.args.vocab_size, (n,), generator=generator).tolist()
              for r, n in PROMPTS.items()}
    references = {r: model.new_cache() for r in PROMPTS}
    worst = 0.0
    for index, step in enumerate(steps):
        work = {r: (first, torch.tensor(tokens[r][first: first + n])) for r, (first, n) in step.items()}
        if before_step is not None:
            before_step(index, caches)
        with watch if watch is not None else contextlib.nullcontext():
            logits = caches.step(model, work)
        row = 0
        for r in sorted(work):
            n = work[r][1].numel()
            expected = model(work[r][1], references[r])
            worst = max(worst, float((logits[row: row + n] - expected).abs().max()))
            assert torch.equal(logits[row + n - 1].argmax(), expected[-1].argmax())
            if work[r][0] + n >= len(tokens[r]):
                tokens[r].append(int(logits[row + n - 1].argmax()))
            row += n
    return worst


@pytest.mark.parametrize("one_window_table", [False, True])
@torch.no_grad()
def test_paged_steps_give_the_in_memory_logits(core_model, one_window_table):
    assert run(core_model, schedule(decode_steps=8), torch.Generator().manual_seed(0),
               one_window_table=one_window_table) < 1e-4


@torch.no_grad()
def test_a_step_reads_the_device_only_once_per_step(core_model):
    """Outside the op kernels (whose device backends need no host reads: the grouped MoE kernel sizes its launch
    from shapes), a step reads the device for the token check and the stored-position audit only."""
    watch = HostReadWatch()
    steps = schedule(decode_steps=3)
    run(core_model, steps, torch.Generator().manual_seed(1), watch=watch)
    per_step = dict(watch.sites)
    assert set(per_step) <= ONCE_PER_STEP, f"host reads at {per_step}"
    for site in ONCE_PER_STEP:
        assert per_step.get(site, 0) <= len(steps), per_step


@pytest.mark.parametrize("layer", [0, 5])
@torch.no_grad()
def test_a_window_row_holding_another_position_fails_the_step(core_model, layer):
    def overwrite(index, caches):
        if index == 3:
            meta, slot_of = caches.window_positions(layer, request=1)
            meta[slot_of(5), 1] = 1000  # request 1 decodes position 11 in step 3: its window reaches back to 4

    wrong = f"layer {layer}: paged window cache does not hold position 5 \\(found 1000\\)"
    with pytest.raises(RuntimeError, match=wrong):
        run(core_model, schedule(decode_steps=3), torch.Generator().manual_seed(2), before_step=overwrite)
