"""TEMPORARY (branch hfds only): a stand-in for the deepseek family so that jaxpar.interop.hf finds the DeepSeek
architectures while the Hugging Face mapping is written. The family itself (multi-head latent attention, its
parameters and checks) is the MLA branch's jaxpar/families/deepseek.py, which replaces this file at merge; the one
line it must hold from here is `hf=deepseek_hf.HF`."""

from __future__ import annotations

from jaxpar.errors import ConfigError
from jaxpar.families import deepseek_hf, llama
from jaxpar.families.base import Family


def _not_here(cfg, *_):
    raise ConfigError("model.family", "deepseek", "the deepseek layers are not on this branch (hfds: the Hugging "
                      "Face mapping only)", "use the merged tree")


FAMILY = Family(name="deepseek", summary="TEMPORARY stand-in (branch hfds)", norm="rms", positions="rope",
                mlp="swiglu", layer_params=_not_here, default_d_ff=llama.default_d_ff, check=_not_here,
                hf=deepseek_hf.HF, attention="mla")
