"""Batches of next-token windows from a token stream, deterministic and resumable, sliced per process.

The stream (length N) is cut into W = (N - 1) // T windows of T + 1 tokens (T = seq_len); window i covers
tokens[i*T : i*T + T + 1], so neighbours share one token and each token after the first (up to the last whole
window) is a target exactly once per epoch:

    tokens   t0 t1 ... tT tT+1 ... t2T ...
    window 0 [t0 ............ tT]
    window 1                 [tT ......... t2T]
    inputs = window[:-1], targets = window[1:]

The grain pipeline, all on random-access `MapDataset`s so that element k of every stage is a pure function of k:

    source(W windows) -> shuffle(seed) -> repeat(num_epochs) -> batch(B, drop_remainder) -> rows [p*B/P, (p+1)*B/P)

With `place` (rows -> a device array laid out for the step) the loader also prefetches: a background thread
(grain's `ThreadPrefetchIterDataset`) takes the next `prefetch` batches through the pipeline and onto their devices
while the current step runs, so the training loop never waits for host slicing or a host-to-device copy. Its
state is still the one integer: grain's prefetch iterator reports the position of the last batch *handed out*, not of
the batches in its buffer, and `set_state` drops the buffer and refills it from the restored position.

`shuffle` folds the epoch into its seed (epoch e uses seed + e), so each epoch has a new order. Batching after
`repeat` lets a batch run across an epoch boundary instead of dropping a partial batch every epoch. Because the
global batch k depends only on (tokens, B, T, seed, shuffle) and never on the process count P, every process
computes the same global batches and keeps only its own rows; the iterator state is one integer (the next global
batch index), the same on every process, and a run can resume with a different P.
"""

from __future__ import annotations

import functools
from typing import Callable

import grain
import numpy as np


class _Windows:
    """Random-access view of the stream as W windows of T + 1 tokens; element i is a no-copy slice."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


class _Rows:
    """Random-access view of whole documents ({"tokens", "mask"} [N, T + 1], each document padded to a row, and
    "lengths" [N]: `jaxpar.data.chat`). Element i is document i: its row with "segments" (1 on the document, 0 on
    the padding; rows that bring their own — a preference pair's two documents — keep them), or with `trimmed`
    the document alone ({"tokens", "mask"} [lengths[i]]), for packing."""

    def __init__(self, rows: dict[str, np.ndarray], seq_len: int, trimmed: bool = False):
        arrays = {k: a for k, a in rows.items() if k != "lengths"}
        if any(a.ndim != 2 or a.shape != rows["tokens"].shape for a in arrays.values()) or \
                rows["tokens"].shape[1] != seq_len + 1 or rows["lengths"].shape != rows["tokens"].shape[:1]:
            raise ValueError(f"rows must all be [N, seq_len + 1 = {seq_len + 1}] with lengths [N], got "
                             f"{ {k: a.shape for k, a in rows.items()} }")
        self.arrays, self.lengths, self.trimmed = arrays, rows["lengths"], trimmed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        n = int(self.lengths[i])
        if self.trimmed:
            return {k: a[i, :n] for k, a in self.arrays.items()}
        row = {k: a[i] for k, a in self.arrays.items()}
        if "segments" not in row:  # (preference pairs bring theirs: 1 chosen, 2 rejected)
            row["segments"] = (np.arange(len(row["tokens"])) < n).astype(np.int32)
        return row


def _packed(element: dict) -> dict[str, np.ndarray]:
    """A row of grain's packer → {"tokens", "mask", "segments"}: its segment ids (1, 2, … a document; 0 padding)
    are what the step reads; the positions it derives from them itself (`jaxpar.train.step.segment_positions`)."""
    return {"tokens": element["tokens"], "mask": element["mask"], "segments": element["tokens_segment_ids"]}


def _take_rows(windows, lo: int, hi: int) -> np.ndarray | dict[str, np.ndarray]:
    """Stack only this process's rows of a global batch -> int32 [hi - lo, T + 1] (one copy, from any int dtype),
    or a dict of them for whole rows."""
    if isinstance(windows[0], dict):
        return {k: np.array([w[k] for w in windows[lo:hi]], dtype=np.int32) for k in windows[0]}
    return np.array(windows[lo:hi], dtype=np.int32)


class Loader:
    """Grain-based iterator over global batches; each process gets its contiguous slice of rows.

    `tokens` is a stream, or whole documents {"tokens", "mask"} int [N, seq_len + 1] with "lengths" [N] (chat data):
    a batch is then a dict {"tokens", "mask", "segments"} of rows, one document a row, or with `pack` several
    (best-fit, grain's `BestFitPackIterDataset`; `segments` numbers them, 0 the padding).

    `next(loader)` -> int32 [batch_size // process_count, seq_len + 1], or `place` of it (then `prefetch` batches
    ahead on a background thread; `close()` stops it). Infinite when num_epochs is None,
    otherwise StopIteration after floor(num_epochs * W / batch_size) batches.
    `get_state()` is a JSON-serializable dict; `set_state` on a loader built from the same stream, batch size,
    seq_len, seed and shuffle resumes at exactly the next batch (any process_index/process_count).
    """

    def __init__(self, tokens: np.ndarray | dict[str, np.ndarray], *, batch_size: int, seq_len: int, seed: int,
                 shuffle: bool = True, process_index: int = 0, process_count: int = 1, num_epochs: int | None = None,
                 place: Callable[[np.ndarray], object] | None = None, prefetch: int = 2, pack: bool = False):
        rows = isinstance(tokens, dict)
        if pack and not rows:
            raise ValueError("packing takes whole documents (chat rows with their lengths), not a token stream")
        if not rows and (tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer)):
            raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if batch_size <= 0 or seq_len <= 0:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        if batch_size % process_count:
            raise ValueError(f"batch_size {batch_size} must be divisible by process_count {process_count} "
                             "(every process takes an equal slice of rows)")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} must lie in [0, {process_count})")
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed must lie in [0, 2**32), got {seed}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 batches, got {prefetch}")
        windows = _Rows(tokens, seq_len, trimmed=pack) if rows else _Windows(tokens, seq_len)
        self.n_windows = len(windows)
        if self.n_windows == 0:
            raise ValueError(f"{len(tokens)} tokens do not fill one window of seq_len + 1 = {seq_len + 1}")
        if num_epochs is not None and num_epochs * self.n_windows < batch_size and not pack:
            raise ValueError(f"{num_epochs} epoch(s) of {self.n_windows} windows do not fill one batch of "
                             f"{batch_size}; use num_epochs=None or a smaller batch")
        self.batch_size, self.seq_len, self.local_batch_size = batch_size, seq_len, batch_size // process_count
        # Everything a saved state depends on; set_state refuses a state taken from a different stream or order.
        self._fingerprint = dict(batch_size=batch_size, seq_len=seq_len, seed=seed, shuffle=shuffle,
                                 n_windows=self.n_windows, num_epochs=num_epochs, pack=pack)

        ds = grain.MapDataset.source(windows)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        ds = ds.repeat(num_epochs)
        lo = process_index * self.local_batch_size
        take = functools.partial(_take_rows, lo=lo, hi=lo + self.local_batch_size)
        # No reader threads: a batch is a few slices of an in-memory (or page-cached) array, which costs
        # microseconds; a pool would only contend for the GIL with the training loop. One prefetch thread does the
        # slicing and the device placement together, `prefetch` batches ahead.
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        if pack:
            # Best-fit packing of the (shuffled) documents into rows of T + 1, a batch's worth of open rows at a
            # time: each document goes to the open row it leaves the least room in. Every process runs the same
            # packer and keeps its own rows, so the packed batches do not depend on the process count; the state
            # is the packer's (its source position and open rows), which grain checkpoints.
            it = grain.experimental.BestFitPackIterDataset(
                ds.to_iter_dataset(options), length_struct={"tokens": seq_len + 1, "mask": seq_len + 1},
                num_packing_bins=batch_size, seed=seed, shuffle_bins=shuffle)
            it = it.map(_packed).batch(batch_size, drop_remainder=True, batch_fn=take)
        else:
            it = ds.batch(batch_size, drop_remainder=True, batch_fn=take).to_iter_dataset(options)
        if place is not None:
            it = it.map(place)
            if prefetch:
                it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=prefetch)
        self._iter = it.__iter__()

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> np.ndarray:
        return next(self._iter)  # int32 [B/P, T + 1] (or its placed array)

    def close(self) -> None:
        """Stop the prefetch thread (if any) and drop its buffered batches; the loader cannot be used after."""
        if self._iter is not None:
            self._iter.close()
            self._iter = None  # freed now, not in interpreter shutdown (where grain's __del__ would fail noisily)

    def get_state(self) -> dict:
        """{"grain": {"next_index": k}, ...fingerprint}: k is the index of the next global batch."""
        return {"grain": dict(self._iter.get_state()), **self._fingerprint}

    def set_state(self, state: dict) -> None:
        """Resume at the batch `state` was taken before. Raises ValueError if the loader differs from the saved one."""
        diff = {k: (state.get(k), v) for k, v in self._fingerprint.items() if state.get(k) != v}
        if diff:
            raise ValueError("loader state was saved from a different loader; (saved, now) per key: "
                             + ", ".join(f"{k}={a!r}/{b!r}" for k, (a, b) in diff.items()))
        self._iter.set_state(dict(state["grain"]))


def make_loader(tokens: np.ndarray | dict[str, np.ndarray], *, batch_size: int, seq_len: int, seed: int,
                shuffle: bool = True, process_index: int = 0, process_count: int = 1, num_epochs: int | None = None,
                place: Callable[[np.ndarray], object] | None = None, prefetch: int = 2, pack: bool = False) -> Loader:
    """A `Loader` over `tokens` (see `Loader` for the contract); shuffle=False yields windows in stream order;
    `place` puts each batch on its devices, `prefetch` batches ahead (0: in the caller's thread); `pack`: whole
    documents packed several a row (chat rows)."""
    return Loader(tokens, batch_size=batch_size, seq_len=seq_len, seed=seed, shuffle=shuffle,
                  process_index=process_index, process_count=process_count, num_epochs=num_epochs, place=place,
                  prefetch=prefetch, pack=pack)


__all__ = ["Loader", "make_loader"]
