"""Inference: token sampling and generation loops.

`generate` is the KV-cache decoder (`jaxpar.infer.decode`); `generate_uncached` is the cache-free reference it is
checked against, a full forward per token (`jaxpar.infer.sampling`); `speculative_generate` is greedy decoding with
the model's multi-token prediction modules as the draft (`jaxpar.infer.speculative`: the same tokens); `pipeline`
is transformers' text-generation pipeline over a loaded model (`jaxpar.infer.pipelines`, imported on first use: it
loads models, which the decoders here do not need).
"""

from jaxpar.infer.decode import generate
from jaxpar.infer.sampling import generate_uncached, sample_logits
from jaxpar.infer.speculative import speculative_generate

__all__ = ["generate", "generate_uncached", "pipeline", "sample_logits", "speculative_generate"]


def __getattr__(name: str):
    if name == "pipeline":
        from jaxpar.infer.pipelines import pipeline

        return pipeline
    raise AttributeError(f"module 'jaxpar.infer' has no attribute {name!r}")
