"""farsight models in the Hugging Face and lm-evaluation-harness ecosystems.

`import farsight.hf` registers each farsight model type (`"drt"`, `"transformer"`: the
`model_type` farsight writes to config.json) with `AutoConfig`, `AutoModelForCausalLM` and
`AutoTokenizer`, so a farsight model directory loads as it is:

    model = AutoModelForCausalLM.from_pretrained("models/demo-drt", memory="disk")
    tokenizer = AutoTokenizer.from_pretrained("models/demo-drt")

When lm-eval is installed it also registers the lm-eval model `"farsight"`
(`lm_eval.simple_evaluate(model="farsight", model_args="pretrained=DIR,memory=disk")`); lm-eval's
own model "hf" loads a farsight directory through the Auto classes too, and so does a process that
never imports this package, with `trust_remote_code=True`: config.json's auto_map names the classes
of the directory's farsight_hf.py, which imports them from here. See docs/huggingface.md.
"""

from __future__ import annotations

from farsight.errors import MissingDependencyError

try:
    import transformers
except ImportError as exc:
    raise MissingDependencyError(f"farsight.hf needs transformers ({exc}); run: pip install farsight[hf]") from None

from farsight.errors import ConfigError
from farsight.hf.configuration import CONFIG_CLASSES, FarsightConfig, FarsightDRTConfig, FarsightTransformerConfig
from farsight.hf.modeling import (
    MODEL_CLASSES,
    FarsightDRTForCausalLM,
    FarsightForCausalLM,
    FarsightTransformerForCausalLM,
)
from farsight.hf.tokenization import FarsightTokenizerFast

LM_EVAL_MODEL_NAME = "farsight"


def _register_auto_classes() -> None:
    """Map each farsight model type to its config, model and tokenizer classes (again on re-import)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, config_class in CONFIG_CLASSES.items():
        taken = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
        if taken is not None and taken.__qualname__ != config_class.__qualname__:
            raise ConfigError(
                f"transformers already has a model type {model_type!r} ({taken.__module__}.{taken.__name__}); "
                "farsight cannot register its own under that name — use farsight.models.load_model instead"
            )
        transformers.AutoConfig.register(model_type, config_class, exist_ok=True)
        transformers.AutoModelForCausalLM.register(config_class, MODEL_CLASSES[model_type], exist_ok=True)
        transformers.AutoTokenizer.register(config_class, FarsightTokenizerFast, exist_ok=True)


def _register_lm_eval_model() -> None:
    """Register "farsight" with lm-eval as a placeholder, imported when lm-eval first asks for it.
    lm-eval's own models ("hf", "vllm", ...) are registered first: lm-eval registers them only
    while its registry is empty, so "farsight" alone in it would hide them."""
    try:
        import lm_eval.models  # noqa: F401  (registers lm-eval's models as placeholders: cheap)
        from lm_eval.api.registry import model_registry
    except ImportError:
        return
    if LM_EVAL_MODEL_NAME not in model_registry:
        model_registry.register(LM_EVAL_MODEL_NAME, target="farsight.hf.harness:FarsightLM")


_register_auto_classes()
_register_lm_eval_model()

__all__ = [
    "CONFIG_CLASSES",
    "LM_EVAL_MODEL_NAME",
    "MODEL_CLASSES",
    "FarsightConfig",
    "FarsightDRTConfig",
    "FarsightDRTForCausalLM",
    "FarsightForCausalLM",
    "FarsightTokenizerFast",
    "FarsightTransformerConfig",
    "FarsightTransformerForCausalLM",
]
