"""``sglang.srt.plugins`` entry point ``deepinfer`` (see pyproject.toml): what DeepInfer adds to SGLang.

SGLang's ``load_plugins()`` runs ``register()`` in every process it starts (engine, scheduler, detokenizer,
DP controller) and then applies the hooks plugins queued. ``register()`` is idempotent (once-guard) and adds:

* architectures in ``ModelRegistry``: ``DeepInferDeepseekV41ForCausalLM`` always, and the checkpoint's own
  name ``DeepseekV41ForCausalLM`` unless ``DEEPINFER_SGLANG_KEEP_UPSTREAM=1``. SGLang 0.5.23 registers no
  ``DeepseekV41ForCausalLM``; it renames that architecture to its ``DeepseekV4ForCausalLM`` while loading the
  config, so taking it over also needs patches/patch_v41_architecture_name.py (queued here, same switch).
  With the switch set, V4.1 checkpoints go to upstream's class, and ours stays selectable with
  ``--json-model-override-args '{"architectures": ["DeepInferDeepseekV41ForCausalLM"]}'``.
* the speculative algorithm ``DEEPINFER_DSPARK`` (``--speculative-algorithm DEEPINFER_DSPARK``), distinct from
  upstream's ``DSPARK``, through ``SpeculativeAlgorithm.register``; worker and validation in spec_decode.py.

SGLang's model registry holds classes, not ``"module:Class"`` strings, so our model class (torch plus the
core model, no SGLang layers) is imported here; the worker is imported only when SGLang builds it.
"""

from __future__ import annotations

import logging

from .. import envs
from .names import SPEC_ALGORITHM, V41_ARCH

logger = logging.getLogger(__name__)

KEEP_UPSTREAM_ENV = "DEEPINFER_SGLANG_KEEP_UPSTREAM"

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    upstream = envs.keep_upstream_sglang()
    archs = register_models(upstream)
    if not upstream:
        from .patches import register_v41_architecture_name_hook

        register_v41_architecture_name_hook()
    register_spec_algorithm()
    _registered = True
    logger.info("deepinfer: registered SGLang architectures %s (%s), speculative algorithm %s",
                ", ".join(archs), "upstream keeps DeepseekV41ForCausalLM" if upstream
                else "DeepseekV41ForCausalLM -> DeepInfer", SPEC_ALGORITHM)


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


def register_spec_algorithm() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(SPEC_ALGORITHM) is not None:  # registered by an earlier import of this module in this process
        return
    from .spec_decode import DeepInferDSparkAlgo, validate_server_args

    @SpeculativeAlgorithm.register(SPEC_ALGORITHM, supports_overlap=False,
                                   validate_server_args=validate_server_args, spec_class=DeepInferDSparkAlgo)
    def _worker_class(server_args):
        from .spec_decode import DeepInferDSparkWorker

        return DeepInferDSparkWorker
