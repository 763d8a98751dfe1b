"""Data: tokenizers, token streams from four sources, and the resumable per-process batch loader.

    tokenizer = make_tokenizer(cfg.data.tokenizer)                       # "bytes" or a tokenizer.json
    check_vocab(tokenizer, cfg.model.vocab_size)
    train = load_tokens(cfg.data, tokenizer, "train", seq_len=T, seed=cfg.train.seed)   # int [N]
    loader = make_loader(train, batch_size=B, seq_len=T, seed=cfg.train.seed,
                         process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(loader)                                                 # int32 [B / P, T + 1]
"""

from jaxpar.data.loader import Loader, make_loader
from jaxpar.data.sources import load_tokens
from jaxpar.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, check_vocab, make_tokenizer

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "make_tokenizer", "check_vocab", "load_tokens", "make_loader",
           "Loader"]
