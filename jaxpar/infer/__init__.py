"""Inference: token sampling and generation loops."""

from jaxpar.infer.sampling import generate, sample_logits

__all__ = ["generate", "sample_logits"]
