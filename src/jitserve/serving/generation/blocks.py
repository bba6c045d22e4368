"""The blocks of a paged KV cache, on plain data: which are free, who holds each, and the prefix cache.

A pool of ``count`` blocks of ``size`` token positions each; block 0 is
reserved (idle rows and padding write there, and nothing reads it). A sequence
holds a list of blocks (its block table). A full block that holds a prompt's
tokens is registered under a key: the hash of its tokens and of the key of the
block before it, so that a key names a whole prefix (vLLM's prefix caching).
A later sequence whose prompt starts with the same tokens takes those blocks
(their reference count rises) and computes only the rest. A block whose count
falls to zero stays in the prefix cache, evictable, least recently used first,
until a block is wanted and no other is free.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_KEY = b""  # the key "before" a sequence's first block


def block_keys(tokens: np.ndarray, size: int) -> list[bytes]:
    """The keys of the full blocks of ``tokens`` (a 1-D int32 array of token ids), in order: SHA-256 digests,
    as a collision would give one prompt another's keys and values."""
    keys, key = [], ROOT_KEY
    for start in range(0, tokens.size - size + 1, size):
        key = hashlib.sha256(key + tokens[start:start + size].tobytes()).digest()
        keys.append(key)
    return keys


class BlockPool:
    """The blocks of one paged cache (see the module) and its counters: prefix ``lookups`` (blocks looked
    up), ``hits`` (blocks reused), ``evictions``."""

    def __init__(self, count: int, size: int) -> None:
        self.count = count
        self.size = size
        self.clear()
        self.lookups = 0
        self.hits = 0
        self.evictions = 0

    def clear(self) -> None:
        """Every block free and out of the prefix cache (the cache's contents are gone); the counters stay."""
        self.free: collections.deque[int] = collections.deque(range(1, self.count))  # held by none, in no cache
        self.references = [0] * self.count
        self.cached: dict[bytes, int] = {}  # key -> block
        self.key_of: dict[int, bytes] = {}  # block -> key
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, held by none; LRU

    @property
    def usable(self) -> int:
        """Blocks a sequence may hold (all but the reserved one)."""
        return self.count - 1

    @property
    def available(self) -> int:
        """Blocks that can be handed out now: free, or cached and held by none."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        return self.usable - self.available

    def blocks_for(self, tokens: int) -> int:
        """The blocks ``tokens`` positions take."""
        return -(-tokens // self.size)

    def take(self, count: int) -> list[int]:
        """``count`` blocks for one sequence (the caller checked :attr:`available`): free ones first, then
        the least recently used cached ones, which leave the cache."""
        taken = []
        for _ in range(count):
            if self.free:
                block = self.free.popleft()
            else:
                block, _ = self.evictable.popitem(last=False)
                del self.cached[self.key_of.pop(block)]
                self.evictions += 1
            self.references[block] = 1
            taken.append(block)
        return taken

    def share(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys``, each now held once more."""
        shared = []
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            if self.references[block] == 0:
                del self.evictable[block]
            self.references[block] += 1
            shared.append(block)
        return shared

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are cached now (nothing changes)."""
        found = 0
        while found < len(keys) and keys[found] in self.cached:
            found += 1
        return found

    def count_lookup(self, looked: int, found: int) -> None:
        """A sequence looked up ``looked`` blocks of its prefix and took the ``found`` cached ones."""
        self.lookups += looked
        self.hits += found

    def register(self, block: int, key: bytes) -> None:
        """``block``, now full of the tokens ``key`` names, joins the prefix cache (unless that prefix is
        cached in another block already, or this block is)."""
        if key not in self.cached and block not in self.key_of:
            self.cached[key] = block
            self.key_of[block] = key

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence gives up ``blocks``: each held by none afterwards is free again, or evictable if
        cached (the last released is the most recently used)."""
        for block in reversed(blocks):
            self.references[block] -= 1
            if self.references[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
