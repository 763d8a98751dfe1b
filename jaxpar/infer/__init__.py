"""Inference: token sampling and generation loops.

`generate` is the KV-cache decoder (`jaxpar.infer.decode`); `generate_uncached` is the cache-free reference it is
checked against, a full forward per token (`jaxpar.infer.sampling`).
"""

from jaxpar.infer.decode import generate
from jaxpar.infer.sampling import generate_uncached, sample_logits

__all__ = ["generate", "generate_uncached", "sample_logits"]
