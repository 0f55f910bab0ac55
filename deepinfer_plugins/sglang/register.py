"""``sglang.srt.plugins`` entry point ``deepinfer`` (see pyproject.toml): what DeepInfer adds to SGLang.

SGLang's ``load_plugins()`` runs ``register()`` in every process it starts (engine, scheduler, detokenizer,
DP controller) and then applies the hooks plugins queued. ``register()`` is idempotent (once-guard) and adds:

* architectures in ``ModelRegistry``: ``DeepInferDeepseekV41ForCausalLM`` always, and the checkpoint's own
  name ``DeepseekV41ForCausalLM`` unless ``DEEPINFER_SGLANG_KEEP_UPSTREAM=1``. SGLang 0.5.23 registers no
  ``DeepseekV41ForCausalLM``; it renames that architecture to its ``DeepseekV4ForCausalLM`` while loading the
  config, so taking it over also needs patches/patch_v41_architecture_name.py (queued here, same switch).
  With the switch set, V4.1 checkpoints go to upstream's class, and ours stays selectable with
  ``--json-model-override-args '{"architectures": ["DeepInferDeepseekV41ForCausalLM"]}'``.
* the image processor (vision.py) for the same architectures, in SGLang's ``PROCESSOR_MAPPING``, which its
  tokenizer manager searches by the config's architecture name when the checkpoint has a vision tower.
* no speculative algorithm: DeepInfer's DSpark has no worker for SGLang's scheduler, so none is offered, and
  patches/patch_unavailable_spec_algorithm.py turns ``--speculative-algorithm DEEPINFER_DSPARK`` into an error
  that names what works instead (DSpark on vLLM; upstream's ``DSPARK``).

SGLang's model registry holds classes, not ``"module:Class"`` strings, so our model class (torch plus the
core model, no SGLang layers) is imported here.
"""

from __future__ import annotations

import logging

from .. import envs

logger = logging.getLogger(__name__)

KEEP_UPSTREAM_ENV = "DEEPINFER_SGLANG_KEEP_UPSTREAM"
V41_ARCH = "DeepseekV41ForCausalLM"

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    upstream = envs.keep_upstream_sglang()
    archs = register_models(upstream)
    register_image_processor(archs)
    from .patches import register_unavailable_spec_algorithm_hook, register_v41_architecture_name_hook

    if not upstream:
        register_v41_architecture_name_hook()
    register_unavailable_spec_algorithm_hook()
    _registered = True
    logger.info("deepinfer: registered SGLang architectures %s (%s)", ", ".join(archs),
                "upstream keeps DeepseekV41ForCausalLM" if upstream else "DeepseekV41ForCausalLM -> DeepInfer")


def register_models(keep_upstream_v41: bool) -> list[str]:
    """Add our classes to SGLang's ModelRegistry; an architecture some other plugin already owns is an error."""
    from sglang.srt.models.registry import ModelRegistry

    from .model import DeepInferDeepseekV41ForCausalLM, DeepseekV41ForCausalLM

    wanted = {DeepInferDeepseekV41ForCausalLM.__name__: DeepInferDeepseekV41ForCausalLM}
    if not keep_upstream_v41:
        wanted[V41_ARCH] = DeepseekV41ForCausalLM
    supported = ModelRegistry.get_supported_archs()  # loads SGLang's built-in models first
    for arch, cls in wanted.items():
        owner = ModelRegistry.models.get(arch) if arch in supported else None
        if owner is not None and owner is not cls:
            raise ValueError(f"SGLang architecture {arch} is already registered to {owner.__module__}."
                             f"{owner.__qualname__}; set {KEEP_UPSTREAM_ENV}=1 to leave it there")
    ModelRegistry.models.update(wanted)
    return list(wanted)



def register_image_processor(archs: list[str]) -> None:
    """Map each of our model classes in ``archs`` to our image processor in SGLang's ``PROCESSOR_MAPPING`` (keyed by
    model class, matched by class name against the config's architectures). An entry another processor holds
    for one of our classes is an error, as for the model registry."""
    from sglang.srt.managers.multimodal_processor import PROCESSOR_MAPPING
    from sglang.srt.models.registry import ModelRegistry

    from .vision import DeepInferImageProcessor

    for arch in archs:
        model_cls = ModelRegistry.models[arch]
        owner = next((proc for cls, proc in PROCESSOR_MAPPING.items() if cls.__name__ == arch), None)
        if owner is not None and owner is not DeepInferImageProcessor:
            raise ValueError(f"SGLang architecture {arch} already has the multimodal processor {owner.__module__}."
                             f"{owner.__qualname__}; set {KEEP_UPSTREAM_ENV}=1 to leave it there")
        PROCESSOR_MAPPING[model_cls] = DeepInferImageProcessor
