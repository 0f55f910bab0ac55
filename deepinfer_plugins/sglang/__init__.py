"""SGLang integration: translation only (docs/architecture.md#one-copy-of-the-model-math). The model math lives
in models/deepseek_v41.

register.py   the ``sglang.srt.plugins`` entry point (architectures, image processor, patches)
model.py      SGLang model class: ForwardBatch + req_to_token slots -> SequenceChunk / SequenceState
vision.py     multimodal processor: images -> the core's patches, placeholders -> the core's image spans
spec_decode.py TARGET_VERIFY logits -> DSpark verification (no speculative algorithm is registered)
patches/      one file per patch to SGLang, with a ledger in patches/__init__.py

Nothing here imports sglang at package import time.
"""
