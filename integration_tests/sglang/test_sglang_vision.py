"""Images in DeepInfer's SGLang adapter, on CPU: processor registration, span layout, bad images, and logits.

Guarantees (each test names the SGLang code it goes through):
  * after SGLang's own plugin loading, ``get_mm_processor_cls`` (what the tokenizer manager asks) finds our
    processor for the checkpoint's architecture ``DeepseekV41ForCausalLM`` and for
    ``DeepInferDeepseekV41ForCausalLM``, also after SGLang imports its built-in processors; with
    ``DEEPINFER_SGLANG_KEEP_UPSTREAM=1`` the checkpoint goes to upstream's processor and ours keeps only our name;
  * the processor's prompt equals the core's accounting: each placeholder becomes ``span_length`` copies of
    ``image_token_id`` (``plan_image_grid`` on the image's size) at the offsets it reports, and its pixels are
    the core's ``preprocess_image`` patches, for small, upscaled, wide, tall and over-budget images, and at the
    detail SGLang's ``ImageData`` carries (``low`` shrinks a large image);
  * bad images raise ``ImageDataError`` naming the image (corrupt bytes, bytes that are no image, bad base64,
    an object that is no image); placeholders that do not pair with the images raise ``ImagePlaceholderError``;
    audio is refused with ``ImageInputError``; a data URI and its bytes give the same patches;
  * the adapter's logits for hand-built EXTEND / DECODE ``ForwardBatch``es with one and with two images (the
    scheduler's own ``MultimodalInputs.from_processor_output`` and the model's ``pad_input_ids``; image rows
    through SGLang's ``prepare_mm_inputs`` and its embedding cache) equal the core model's on the same ids and
    pixels (rtol/atol 1e-4, fp32, as the text tests), including a prefill chunk that ends inside an image span
    and a batch that mixes an image request with a text one; two images of the same size give different pad
    values and different logits;
  * a checkpoint converted without vision tensors builds, loads and serves text, and refuses images with
    ``ImageInputError`` naming the missing tower.

No SGLang server runs (see test_sglang_registration.py): the processor is called directly with the
arguments the tokenizer manager passes, under a test config published through SGLang's runtime context.
"""

from __future__ import annotations

import asyncio
import base64
from array import array

import pytest

try:
    import sglang  # noqa: F401
except Exception as exc:  # ImportError, or a broken CUDA-only dependency
    pytest.skip(f"sglang is not importable ({exc!r}); run integration_tests/sglang/setup_sglang_venv.sh and use "
                ".venv-sglang/bin/python", allow_module_level=True)

import torch

from deepinfer_plugins.models.deepseek_v41 import DeepseekV41ForCausalLM as CoreModel
from deepinfer_plugins.models.deepseek_v41.checkpoint import write_random_checkpoint
from deepinfer_plugins.models.deepseek_v41.image_processing import plan_image_grid, preprocess_image
from deepinfer_plugins.models.deepseek_v41.model import ImageInputError

from ..images import png
from .test_sglang_registration import PRESET, Engine, close, reference, run_sglang

TEXT = [5, 17, 33, 9]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), PRESET)


@pytest.fixture(scope="module")
def text_only_checkpoint(tmp_path_factory):
    """Converted without its vision tensors; the config keeps ``vision_config``."""
    return write_random_checkpoint(tmp_path_factory.mktemp("text-only"), PRESET, text_only=True)


@pytest.fixture(scope="module")
def sglang_config():
    """A test config published in SGLang's runtime context (the processor and ``prepare_mm_inputs`` read it) and
    SGLang's multimodal embedding cache, which the model runner creates in a server."""
    from sglang.srt.managers import mm_schedule
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(mm_process_config={})
    override.install()
    previous = mm_schedule.embedding_cache
    mm_schedule.init_mm_embedding_cache(64 * 1024 * 1024)
    yield
    mm_schedule.embedding_cache = previous
    override.restore()


def sglang_config_of(path):
    from sglang.srt.utils.hf_transformers_utils import get_config

    return get_config(str(path), trust_remote_code=False)


def make_processor(path):
    from deepinfer_plugins.sglang.vision import DeepInferImageProcessor

    return DeepInferImageProcessor(sglang_config_of(path), None, None, "default")


@pytest.fixture(scope="module")
def processor(checkpoint, sglang_config):
    proc = make_processor(checkpoint)
    yield proc
    proc.shutdown()


def process(proc, token_ids, images):
    """What the tokenizer manager does with a request's ids and images."""
    return asyncio.run(proc.process_mm_data_async(image_data=images, input_text=list(token_ids), request_obj=None,
                                                  audio_data=None, max_req_input_len=4096))


@pytest.fixture(scope="module")
def models(checkpoint, sglang_config):
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    from deepinfer_plugins.sglang.model import DeepInferDeepseekV41ForCausalLM

    adapter = DeepInferDeepseekV41ForCausalLM(sglang_config_of(checkpoint)).eval()
    adapter.load_weights(safetensors_weights_iterator(sorted(str(f) for f in checkpoint.glob("*.safetensors"))))
    core = CoreModel.from_pretrained(checkpoint, with_drafter=False)
    assert adapter.model.has_vision and core.has_vision
    return adapter, core


# ---- registration (fresh subprocesses, SGLang's plugin loader) ---------------------------------------------
FIND = """
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.multimodal_processor import get_mm_processor_cls, import_processors
from sglang.srt.runtime_context import get_context
get_context().override_server_args(mm_process_config={{}}).install()
config = ModelConfig({ckpt!r})
import_processors("sglang.srt.multimodal.processors")  # what the tokenizer manager does before it looks
name = lambda cls: None if cls is None else cls.__module__ + "." + cls.__name__
hf = config.hf_config
found = dict(arch=hf.architectures[0], multimodal=config.is_multimodal, checkpoint=name(get_mm_processor_cls(hf)))
hf.architectures = ["DeepInferDeepseekV41ForCausalLM"]
found["ours"] = name(get_mm_processor_cls(hf))
print(json.dumps(found))
"""
OURS = "deepinfer_plugins.sglang.vision.DeepInferImageProcessor"


def test_sglang_finds_our_processor_for_our_architectures(checkpoint):
    out = run_sglang(FIND.format(ckpt=str(checkpoint)))
    assert out == {"arch": "DeepseekV41ForCausalLM", "multimodal": True, "checkpoint": OURS, "ours": OURS}


def test_keep_upstream_leaves_the_checkpoint_to_upstreams_processor(checkpoint):
    out = run_sglang(FIND.format(ckpt=str(checkpoint)), DEEPINFER_SGLANG_KEEP_UPSTREAM="1")
    assert out["arch"] == "DeepseekV4ForCausalLM"
    assert out["checkpoint"] == "sglang.srt.multimodal.processors.deepseek_v41.DeepseekV41ImageProcessor"
    assert out["ours"] == OURS


# ---- the processor against the core's accounting ---------------------------------------------------------
@pytest.mark.parametrize("size", [(40, 30), (14, 14), (200, 50), (30, 400), (1000, 1000)],
                         ids=["small", "upscaled", "wide", "tall", "over-budget"])
def test_processor_spans_equal_the_core_accounting(processor, checkpoint, size):
    vision = processor.args.vision
    image_id = processor.image_token_id
    image = png(3, size)
    out = process(processor, [5, image_id, 6], [image])
    span = plan_image_grid(*size, vision).span_length
    assert span == preprocess_image(image, vision).grid.span_length
    assert out.input_ids == [5] + [image_id] * span + [6]
    assert out.im_token_id == image_id
    [item] = out.mm_items
    assert item.offsets == [(1, span)]
    expected = preprocess_image(image, vision)
    assert (item.patch_rows, item.patch_cols) == (expected.grid.patch_rows, expected.grid.patch_cols)
    assert torch.equal(item.feature, expected.patches)


@pytest.mark.parametrize("detail", ["low", "high", "auto", None])
def test_each_image_is_planned_at_the_detail_its_part_asks(processor, detail):
    """SGLang's chat parsing hands the part's ``detail`` on in ``ImageData``: at ``low`` a large image is shrunk
    first (at this size and the tiny budget, another grid), every other detail plans it as it is."""
    from sglang.srt.utils import ImageData

    vision, image_id = processor.args.vision, processor.image_token_id
    image = png(5, (890, 411))
    sent = ImageData(url="data:image/png;base64," + base64.b64encode(image).decode(), detail=detail)
    out = process(processor, [5, image_id, 6], [sent])
    expected = preprocess_image(image, vision, detail=detail or "high")
    assert expected.grid == plan_image_grid(890, 411, vision, detail or "high")
    assert (expected.grid != plan_image_grid(890, 411, vision)) == (detail == "low")
    assert out.input_ids == [5] + [image_id] * expected.grid.span_length + [6]
    assert torch.equal(out.mm_items[0].feature, expected.patches)


def test_processor_lays_out_two_images_in_order(processor):
    image_id = processor.image_token_id
    a, b = png(1, (40, 30)), png(2, (100, 20))
    spans = [preprocess_image(x, processor.args.vision).grid.span_length for x in (a, b)]
    assert spans[0] != spans[1]
    out = process(processor, [5, image_id, 7, 8, image_id, 9], [a, b])
    assert out.input_ids == [5] + [image_id] * spans[0] + [7, 8] + [image_id] * spans[1] + [9]
    assert [item.offsets for item in out.mm_items] == [[(1, spans[0])],
                                                      [(spans[0] + 3, spans[0] + 2 + spans[1])]]


def test_placeholders_must_pair_with_images(processor):
    from deepinfer_plugins.sglang.vision import ImagePlaceholderError

    image_id = processor.image_token_id
    with pytest.raises(ImagePlaceholderError, match="2 image placeholders .* carries 1 images"):
        process(processor, [image_id, 5, image_id], [png(1)])
    with pytest.raises(ImagePlaceholderError, match="0 image placeholders .* carries 1 images"):
        process(processor, [5, 6], [png(1)])


@pytest.mark.parametrize("bad, problem", [
    (png(1)[:60], "is not an image that can be decoded"),  # a PNG cut short
    (b"this is not an image at all", "is not an image that can be decoded"),
    ("data:image/png;base64,%%%not-base64%%%", "is not an image that can be decoded"),
    ("data:image/png;base64," + base64.b64encode(b"plain text").decode(), "is not an image that can be decoded"),
    (12345, "is not an image that can be decoded"),
], ids=["truncated-png", "not-an-image", "bad-base64", "data-uri-of-text", "not-image-data"])
def test_bad_images_raise_a_typed_error(processor, bad, problem):
    from deepinfer_plugins.sglang.vision import ImageDataError

    image_id = processor.image_token_id
    with pytest.raises(ImageDataError, match=f"^image 2 of the request .*{problem}"):
        process(processor, [image_id, image_id], [png(1), bad])


def test_audio_and_video_are_refused(processor):
    image_id = processor.image_token_id
    with pytest.raises(ImageInputError, match="images only"):
        asyncio.run(processor.process_mm_data_async(image_data=[png(1)], input_text=[image_id], request_obj=None,
                                                    audio_data=[b"RIFF"]))


def test_data_uri_and_bytes_give_the_same_patches(processor):
    image = png(4)
    image_id = processor.image_token_id
    out = process(processor, [image_id, image_id],
                  [image, "data:image/png;base64," + base64.b64encode(image).decode()])
    assert torch.equal(out.mm_items[0].feature, out.mm_items[1].feature)


# ---- the adapter's logits against the core model --------------------------------------------------------
def scheduled(adapter, out):
    """The scheduler's side: MultimodalInputs from the processor output (hash, pad values), the padded prompt."""
    from sglang.srt.managers.schedule_batch import MultimodalInputs

    mm_inputs = MultimodalInputs.from_processor_output(out)
    padded = adapter.pad_input_ids(array("q", out.input_ids), mm_inputs)
    return mm_inputs, list(padded)


@torch.no_grad()
def core_logits(core, token_ids, images) -> torch.Tensor:
    """The core model on the same ids, each image's span embeddings at its positions in order [T, vocab]."""
    spans = []
    for image in images:
        pre = preprocess_image(image, core.args.vision)
        spans.append(core.embed_image(pre.patches, pre.grid.patch_rows, pre.grid.patch_cols))
    return core(torch.tensor(token_ids), image_embeds=torch.cat(spans) if spans else None)


def test_one_image_extend_and_decode_equal_the_core_model(models, processor):
    adapter, core = models
    image_id = core.args.image_token_id
    image = png(1)
    out = process(processor, TEXT[:2] + [image_id] + TEXT[2:], [image])
    mm_inputs, padded = scheduled(adapter, out)
    ids = out.input_ids
    assert padded != ids and [p for p, t in zip(padded, ids) if p == t] == [t for t in ids if t != image_id]
    expected = core_logits(core, ids, [image])

    eng = Engine(adapter)
    logits = eng.forward("EXTEND", [(1, 0, padded)], mm_inputs=[mm_inputs])
    close(logits[0], expected[-1])

    token = int(logits[0].argmax())
    logits = eng.forward("DECODE", [(1, len(ids), [token])])
    close(logits[0], core_logits(core, ids + [token], [image])[-1])


def test_two_images_and_a_chunk_ending_inside_a_span(models, processor):
    """Chunked prefill: the first EXTEND stops inside the second image's span, the next resumes there; the
    request shares the batch with a text-only one."""
    adapter, core = models
    image_id = core.args.image_token_id
    images = [png(1, (40, 30)), png(2, (100, 20))]
    out = process(processor, [5, image_id, 7, 8, image_id, 9, 10], images)
    mm_inputs, padded = scheduled(adapter, out)
    ids = out.input_ids
    expected = core_logits(core, ids, images)
    (_, second_end), = out.mm_items[1].offsets
    cut = second_end - 2  # inside the second span
    text = [11, 12, 13, 14, 15]

    eng = Engine(adapter)
    logits = eng.forward("EXTEND", [(1, 0, padded[:cut]), (2, 0, text)], mm_inputs=[mm_inputs, None])
    close(logits[0], expected[cut - 1])
    close(logits[1], reference(core, text)[-1])
    logits = eng.forward("EXTEND", [(1, cut, padded[cut:])], mm_inputs=[mm_inputs])
    close(logits[0], expected[-1])
    token = int(logits[0].argmax())
    logits = eng.forward("DECODE", [(1, len(ids), [token]), (2, len(text), [3])])
    close(logits[0], core_logits(core, ids + [token], images)[-1])
    close(logits[1], reference(core, text + [3])[-1])


def test_same_size_images_are_told_apart(models, processor):
    """Two images of one size share their token ids; their pad values (the radix cache's key) and the logits
    differ, so neither a prefix match nor the embedding cache can serve one for the other."""
    adapter, core = models
    image_id = core.args.image_token_id
    outs = [process(processor, [5, image_id, 6], [png(seed)]) for seed in (7, 8)]
    assert outs[0].input_ids == outs[1].input_ids
    scheduled_inputs = [scheduled(adapter, out) for out in outs]
    assert scheduled_inputs[0][1] != scheduled_inputs[1][1]
    eng = Engine(adapter)
    logits = [eng.forward("EXTEND", [(i + 1, 0, padded)], mm_inputs=[mm])[0]
              for i, (mm, padded) in enumerate(scheduled_inputs)]
    for seed, out in zip((7, 8), logits):
        close(out, core_logits(core, outs[0].input_ids, [png(seed)])[-1])
    assert not torch.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


# ---- a checkpoint without vision tensors -----------------------------------------------------------------
def test_text_only_checkpoint_serves_text_and_refuses_images(text_only_checkpoint, sglang_config):
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    from deepinfer_plugins.sglang.model import DeepInferDeepseekV41ForCausalLM

    config = sglang_config_of(text_only_checkpoint)
    assert config.vision_n_layers > 0  # SGLang still sees a vision config, so it builds the processor
    adapter = DeepInferDeepseekV41ForCausalLM(config).eval()
    files = sorted(str(f) for f in text_only_checkpoint.glob("*.safetensors"))
    adapter.load_weights(safetensors_weights_iterator(files))
    core = CoreModel.from_pretrained(text_only_checkpoint, with_drafter=False)
    assert not adapter.model.has_vision
    logits = Engine(adapter).forward("EXTEND", [(1, 0, TEXT)])
    close(logits[0], reference(core, TEXT)[-1])

    proc = make_processor(text_only_checkpoint)
    try:
        with pytest.raises(ImageInputError, match="no vision tower"):
            process(proc, [5, core.args.image_token_id], [png(1)])
    finally:
        proc.shutdown()
