"""transformers built on our loaded weights: the baseline of `bench engine` and a reference for tests."""

from __future__ import annotations

import torch

from engine.hf_loader import hf_config_dict
from engine.loader import LoadedModel


def hf_model_from(loaded: LoadedModel) -> torch.nn.Module:
    """A transformers causal LM holding exactly `loaded`'s weights (eval mode): fp32 on the CPU for CPU float32
    weights; otherwise built on the weights' device in their dtype, sharing their tensors (no second copy of an 8B
    model on the GPU)."""
    import transformers

    cfg_dict = hf_config_dict(loaded.config)
    arch = cfg_dict["architectures"][0]
    config = transformers.AutoConfig.for_model(**cfg_dict)
    first = next(iter(loaded.weights.values()))
    if first.device.type == "cpu" and first.dtype == torch.float32:
        model = getattr(transformers, arch)(config).eval()
        missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    else:
        # NOTE: built under the weights' device (its random init is quick there) and then pointed at our tensors
        with torch.device(first.device):
            model = getattr(transformers, arch)._from_config(config, dtype=first.dtype).eval()
        missing, unexpected = model.load_state_dict(loaded.weights, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if loaded.config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"weights do not fit {arch}: missing {missing}, unexpected {unexpected}")
    if loaded.config.tie_word_embeddings:
        model.tie_weights()
    return model
