"""Test-only DSpark proposer for vLLM: proposes the target's own greedy continuation, so drafts are accepted.

The random tiny drafter accepts almost nothing, which leaves vLLM's multi-token accept path (and our caches under
it) unexercised. This subclass still runs the real drafter on the paged draft context every step (so that path is
exercised too), then replaces its tokens by the reference continuation read from the JSON file named by
``DEEPINFER_TEST_PLANTED`` (a list of full reference sequences, prompt + greedy output, computed with the core
model). On every step whose committed length is a multiple of 3 the last proposed token is made wrong on purpose,
so partial accepts (and the rollback of the rejected positions) happen as well.
"""

from __future__ import annotations

import json
import os

from deepinfer_plugins.vllm.spec_decode import DeepInferDSparkProposer

PLANTED_ENV = "DEEPINFER_TEST_PLANTED"


class PlantedDSparkProposer(DeepInferDSparkProposer):
    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        with open(os.environ[PLANTED_ENV]) as f:
            self.references = [list(map(int, r)) for r in json.load(f)]

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        drafts = super().propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings, **kwargs)
        for i, draft in enumerate(drafts):
            if not draft:
                continue
            n = int(num_tokens_no_spec[i])
            seq = token_ids_cpu[i, :n].tolist()
            ref = next((r for r in self.references if len(r) > n and r[:n] == seq), None)
            if ref is None:
                continue  # off the reference (or at its end): keep the drafter's own tokens
            planted = ref[n: n + len(draft)]
            planted += draft[len(planted):]
            if n % 3 == 0 and len(planted) > 1:
                planted[-1] = (planted[-1] + 1) % self.args.vocab_size
                if planted[-1] == self.args.image_token_id:
                    planted[-1] = 0
            drafts[i] = planted
        return drafts
