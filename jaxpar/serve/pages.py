"""The page pool's bookkeeping on the host: which page of the paged KV cache (`jaxpar.model.PagedKVCache`) is free,
whose it is, and which full pages of prompt prefixes are kept for reuse (prefix caching).

    page 0          the junk page: no sequence owns it; every block-table entry past a row's pages names it, and
                    the writes nobody reads (an empty row's, a chunk's padding past the row's pages) land there
    pages 1 … P-1   free, or owned: ref[p] sequences hold p in their block tables

A full page of a prompt is named by a chained hash — of the previous page's hash and this page's tokens, so a page
matches only behind the same whole prefix (vLLM's automatic prefix caching). Its pages stay in `cached` (hash →
page) after their sequences finish, as long as no allocation needs them: a page no sequence holds but whose
contents are kept is *evictable*, and `allocate` takes free pages first, then evicts the least recently used
evictable page (and forgets its hash).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

JUNK = 0  # the page no sequence owns


def page_hashes(tokens: Sequence[int], page_size: int, n_pages: int) -> list[bytes]:
    """The chained hashes of the first n_pages full pages of `tokens`: h_i = H(h_{i-1} ‖ tokens of page i)."""
    out, prev = [], b""
    for i in range(n_pages):
        block = ",".join(map(str, tokens[i * page_size:(i + 1) * page_size])).encode()
        prev = hashlib.blake2b(prev + b"|" + block, digest_size=16).digest()
        out.append(prev)
    return out


class PagePool:
    """Pages 1 … n_pages-1 of a pool of n_pages (page 0: `JUNK`), with reference counts and the prefix cache."""

    def __init__(self, n_pages: int, page_size: int, prefix_caching: bool = True):
        self.n_pages, self.page_size, self.prefix_caching = n_pages, page_size, prefix_caching
        self.free: collections.deque[int] = collections.deque(range(1, n_pages))
        self.ref = [0] * n_pages
        self.cached: dict[bytes, int] = {}  # hash → page, for every page whose contents are kept
        self.hash_of: dict[int, bytes] = {}
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.hits = self.queries = 0  # prompt pages found / looked for (counted by the engine at admission)

    @property
    def available(self) -> int:
        """Pages an allocation can take now: free, or evictable."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        """Pages some sequence holds."""
        return self.n_pages - 1 - self.available

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest run of `hashes` from the first (a prompt's full pages), each now held
        once more (an evictable one leaves the LRU)."""
        got = []
        if self.prefix_caching:
            for h in hashes:
                page = self.cached.get(h)
                if page is None:
                    break
                got.append(page)
        for page in got:
            self._hold(page)
        return got

    def allocate(self) -> int:
        """One page, held once: a free page, else the least recently used evictable one (its hash forgotten)."""
        if self.free:
            page = self.free.popleft()
        elif self.evictable:
            page, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(page)]
        else:
            raise RuntimeError("no page to allocate: the engine reserves pages before it admits a request")
        self.ref[page] = 1
        return page

    def register(self, page: int, h: bytes) -> None:
        """Keep full page `page` (held by its sequence) under hash h for later prompts — unless another page
        already holds the same prefix (two requests prefilled it at once): then this one stays private."""
        if self.prefix_caching and h not in self.cached and page not in self.hash_of:
            self.cached[h] = page
            self.hash_of[page] = h

    def release(self, pages: Sequence[int]) -> None:
        """A finished sequence lets go of its pages: a page no one holds any more is evictable if cached, else
        free."""
        for page in pages:
            self.ref[page] -= 1
            if self.ref[page] == 0:
                if page in self.hash_of:
                    self.evictable[page] = None  # most recently used last
                else:
                    self.free.append(page)

    def _hold(self, page: int) -> None:
        if self.ref[page] == 0:
            self.evictable.pop(page, None)
        self.ref[page] += 1
