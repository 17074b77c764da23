"""transformers built on our loaded weights: the baseline of `bench engine` and a reference for tests."""

from __future__ import annotations

import torch

from engine.hf_loader import hf_config_dict
from engine.loader import LoadedModel


def hf_model_from(loaded: LoadedModel) -> torch.nn.Module:
    """A transformers causal LM holding exactly `loaded`'s weights (fp32, eval mode)."""
    import transformers

    cfg_dict = hf_config_dict(loaded.config)
    arch = cfg_dict["architectures"][0]
    config = transformers.AutoConfig.for_model(**cfg_dict)
    model = getattr(transformers, arch)(config).eval()
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    allowed_missing = {"lm_head.weight"} if loaded.config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"weights do not fit {arch}: missing {missing}, unexpected {unexpected}")
    if loaded.config.tie_word_embeddings:
        model.tie_weights()
    return model
