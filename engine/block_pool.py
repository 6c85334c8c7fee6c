"""The pool of fixed-size KV-cache blocks, with prefix caching.

A block is ``block_size`` token slots in every layer's cache. ``BlockPool`` is the only code that
changes reference counts and the free list.

Prefix caching (after vLLM's automatic prefix caching): a *full* block is identified by a chain
hash — the hash of (parent block's hash, the block's token ids, extra keys) — so equal prefixes
map to equal hashes and a new request reuses every cached block of its prompt.

Eviction order: free blocks sit in an LRU queue. A block whose ref count drops to zero is appended
at the tail *keeping its hash* (it may be hit again); new blocks are taken from the head, and the
hash of a taken block is forgotten then. Callers free a request's blocks in reverse order, so among
blocks freed together the tail of a chain is evicted first. A cache hit on a free block takes it
back out of the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional

# the block-table entry of a block a request no longer holds (it fell out of every layer's sliding
# window, or a prefix hit never needed it); attention never reads such an entry
NULL_BLOCK_ID = -1


class BlockHash(tuple):
    """``(parent_hash, token_ids, extra_keys)``: compared in full, so distinct prefixes never collide."""


def hash_block_tokens(parent: Optional[BlockHash], token_ids: tuple, extra: Hashable = None) -> BlockHash:
    """Chain hash of one full block.

    Args:
        parent: the previous block's hash, None for the first block.
        token_ids: exactly ``block_size`` token ids.
        extra: keys that must also match (model id, cache salt); None when unused.
    """
    return BlockHash((hash(parent) if parent is not None else None, token_ids, extra))


class KVCacheBlock:
    """Metadata of one block: id, ref count and (when full and cached) its hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    """Owns every ``KVCacheBlock``, the LRU free queue and the hash -> block map.

    Invariants: a block is in the free queue iff its ref count is 0; ``cached`` maps each hash to
    exactly one block that currently carries it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks in use (ref count > 0), in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue (ref count 1, no hash).

        Raises:
            ValueError: fewer than ``n`` blocks are free.
        """
        if n > len(self.free_queue):
            raise ValueError(f"cannot get {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, b = self.free_queue.popitem(last=False)
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Record that ``block`` holds the full block ``block_hash`` (first holder wins).

        Returns:
            True when ``block`` took the hash now (False: caching is off or it already had one).
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)
        return True

    def uncache_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Forget the hash of each block (its contents are not what the hash says); ref counts and
        the free queue are unchanged."""
        for b in blocks:
            if b.block_hash is not None and self.cached.get(b.block_hash) is b:
                del self.cached[b.block_hash]
            b.block_hash = None

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free-queue tail in the
        order given (pass a request's blocks reversed so its chain tail is evicted first)."""
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} ref count went negative"
            if b.ref_cnt == 0:
                if b.block_hash is not None and self.cached.get(b.block_hash) is not b:
                    b.block_hash = None  # a duplicate of a cached block: nothing to keep
                self.free_queue[b.block_id] = b

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (vLLM's ``reset_prefix_cache``).

        Returns:
            False, changing nothing, while any block is in use.
        """
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        return True
