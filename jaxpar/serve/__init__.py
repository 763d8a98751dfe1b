"""Serving: a continuous-batching engine over the paged KV cache (`Engine`; jaxpar.serve.engine), its page pool and
prefix cache (jaxpar.serve.pages)."""

from jaxpar.serve.engine import Engine, EngineConfig, Request, SamplingParams

__all__ = ["Engine", "EngineConfig", "Request", "SamplingParams"]
