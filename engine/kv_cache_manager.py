"""Maps requests to KV blocks: prefix-cache lookup, on-demand allocation, forking, freeing, and
the freeing of blocks that fell out of every layer's sliding window."""

from __future__ import annotations

from typing import Callable, Hashable, Optional

from weir.engine.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from weir.engine.request import Request


class KVCacheManager:
    """Gives each request the blocks its tokens need, and no more.

    A request's ``block_table`` covers exactly ``ceil(num_computed_tokens / block_size)`` blocks
    after each step: blocks are taken as tokens arrive and returned the moment it ends.

    Sliding windows (after vLLM's sliding-window manager): when every layer of the model has a
    window, ``sliding_window`` is the largest. A query at position ``p`` then reads no key before
    ``p - sliding_window + 1``, so once a request's next query is at ``num_computed_tokens`` its
    first ``(num_computed_tokens - sliding_window + 1) // block_size`` blocks are never read
    again: :meth:`allocate_slots` frees them (earliest first, so they are evicted first) and puts
    ``NULL_BLOCK_ID`` in their ``block_table`` entries (in place: the same list, the same length).
    A prefix hit then needs only the cached blocks its first computed query's window reaches; the
    blocks before them are not taken (their entries are ``NULL_BLOCK_ID`` too). With any global
    layer (``sliding_window`` None) nothing is freed early.

    A block's hash enters the prefix cache when the block is allocated for the step that fills
    it, so a request scheduled later in the same step already hits it (every layer writes the
    whole step's keys/values before any attention reads them). Until that step's execute has
    returned the hash is *uncommitted*: :meth:`commit_cached_blocks` keeps the step's hashes,
    :meth:`uncache_uncommitted` forgets them when the step raised (their blocks were never written).

    Args:
        block_pool: the shared :class:`BlockPool`.
        block_size: tokens per block.
        copy_block: ``copy_block(src_block_id, dst_block_id)`` copies one block's keys/values in
            every layer (used for copy-on-write of a shared partial block when forking).
        extra_key: mixed into every block hash so different models never share blocks.
        sliding_window: :func:`freeable_window` of the model's layers; None frees nothing early.
    """

    def __init__(self, block_pool: BlockPool, block_size: int,
                 copy_block: Optional[Callable[[int, int], None]] = None, extra_key: Hashable = None,
                 sliding_window: Optional[int] = None):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.pool = block_pool
        self.block_size = block_size
        self.copy_block = copy_block
        self.extra_key = extra_key
        self.sliding_window = sliding_window
        # per request its blocks, None where a block was freed (or never taken) under the window
        self.req_blocks: dict[str, list[Optional[KVCacheBlock]]] = {}
        # request id -> how many of its leading blocks were already looked at for freeing
        self.num_skipped_blocks: dict[str, int] = {}
        # request id -> how many of its leading blocks were offered to the prefix cache
        self.num_cached_block: dict[str, int] = {}
        self.num_queries_tokens = 0
        self.num_hit_tokens = 0
        self._uncommitted: list[KVCacheBlock] = []  # blocks whose hash this step registered

    def _update_block_hashes(self, req: Request) -> None:
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), req.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs]),
                                            self.extra_key))

    def num_skipped_blocks_at(self, num_computed_tokens: int) -> int:
        """How many leading blocks no query from position ``num_computed_tokens`` on reads (0
        without a window)."""
        if self.sliding_window is None:
            return 0
        return max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size

    def get_computed_blocks(self, req: Request) -> tuple[list[Optional[KVCacheBlock]], int]:
        """Longest cached prefix of the request's tokens, in whole blocks.

        Without a window it is the longest run of cached full blocks from the first. With one, a
        hit of ``k`` blocks needs only blocks ``num_skipped_blocks_at(k * block_size) .. k - 1``
        cached (the chain hash of block ``k - 1`` already pins every token before it); the longest
        such ``k`` wins and the blocks before are None.

        At least the last token is always left to compute (its logits are needed), so a prompt of
        exactly ``k * block_size`` tokens hits at most ``k - 1`` blocks.

        Returns:
            (blocks, number of tokens they cover). Counts the query in the hit-rate statistics.
        """
        if not self.pool.enable_caching:
            return [], 0
        self._update_block_hashes(req)
        limit = req.num_tokens - 1
        if req.scoring is not None and req.scoring.start is not None:  # scored positions must run
            limit = min(limit, req.scoring.start)
        if req.sampling_params.prompt_logprobs is not None:  # every prompt position needs logits
            limit = 0
        max_blocks = limit // self.block_size
        hits: list[Optional[KVCacheBlock]] = []
        if self.sliding_window is None:
            for h in req.block_hashes[:max_blocks]:
                b = self.pool.get_cached_block(h)
                if b is None:
                    break
                hits.append(b)
        else:
            hits = self._window_hit(req.block_hashes[:max_blocks])
        self.num_queries_tokens += req.num_tokens
        self.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def _window_hit(self, hashes: list[BlockHash]) -> list[Optional[KVCacheBlock]]:
        cached = [self.pool.get_cached_block(h) for h in hashes]
        best, run_start = 0, 0  # run_start: first block of the run of cached blocks ending here
        for i, b in enumerate(cached):
            if b is None:
                run_start = i + 1
            elif run_start <= self.num_skipped_blocks_at((i + 1) * self.block_size):
                best = i + 1
        skipped = self.num_skipped_blocks_at(best * self.block_size)
        return [None] * skipped + cached[skipped:best]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req`` (after any prefix-hit blocks).

        Appends the ids of the blocks it adds to ``req.block_table`` (the same list object for as
        long as the request holds blocks: :class:`~weir.engine.input_batch.InputBatch` copies only
        the new tail). Costs O(blocks added or freed) per call, whatever the request's context length.

        With a window it first frees the blocks that left it (see the class), whatever it returns:
        the step's queries start at ``req.num_computed_tokens`` and never read them.

        Returns:
            False, changing nothing else, when the pool lacks free blocks; True otherwise.
        """
        bs = self.block_size
        num_hits = len(new_computed_blocks) if new_computed_blocks else 0
        if self.sliding_window is not None and req.request_id in self.req_blocks:
            self._free_skipped_blocks(req)
        num_total = req.num_computed_tokens + num_hits * bs + num_new_tokens
        num_new_blocks = -(-num_total // bs) - len(req.block_table) - num_hits
        if num_new_blocks > 0 or num_hits:
            if not self._add_blocks(req, num_new_blocks, new_computed_blocks or []):
                return False
        if self.pool.enable_caching and num_total // bs > self.num_cached_block.get(req.request_id, 0):
            self._cache_full_blocks(req, num_total)
        return True

    def _add_blocks(self, req: Request, num_new_blocks: int, hits: list[Optional[KVCacheBlock]]) -> bool:
        # hit blocks that are free now stop counting as free once touched
        held = [b for b in hits if b is not None]
        num_evictable_hits = sum(1 for b in held if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            return False
        blocks = self.req_blocks.setdefault(req.request_id, [])
        self.pool.touch(held)
        added = hits + self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else hits
        blocks.extend(added)
        req.block_table.extend(NULL_BLOCK_ID if b is None else b.block_id for b in added)
        return True

    def _free_skipped_blocks(self, req: Request) -> None:
        """Free the blocks of ``req`` before its next query's window (earliest first, so the
        earliest is evicted first) and null their entries, in ``req_blocks`` and ``block_table``."""
        rid = req.request_id
        start = self.num_skipped_blocks.get(rid, 0)
        end = self.num_skipped_blocks_at(req.num_computed_tokens)
        if end <= start:
            return
        blocks = self.req_blocks[rid]
        freed = []
        for i in range(start, end):
            if blocks[i] is not None:
                freed.append(blocks[i])
                blocks[i] = None
                req.block_table[i] = NULL_BLOCK_ID
        self.num_skipped_blocks[rid] = end
        self.pool.free_blocks(freed)

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        # blocks full once this step's tokens are written; a same-step reader is safe because
        # every layer writes the whole step's keys/values before any attention reads them.
        # Blocks below num_cached_block were offered to the pool by an earlier call already.
        self._update_block_hashes(req)
        blocks = self.req_blocks[req.request_id]
        start = self.num_cached_block.get(req.request_id, 0)
        end = min(num_tokens // self.block_size, len(req.block_hashes))
        for i in range(start, end):  # a None block (not taken on a window hit) is cached already
            if blocks[i] is not None and self.pool.cache_full_block(blocks[i], req.block_hashes[i]):
                self._uncommitted.append(blocks[i])
        self.num_cached_block[req.request_id] = max(start, end)

    def commit_cached_blocks(self) -> None:
        """The step ran: every hash registered for it now describes written keys/values."""
        self._uncommitted.clear()

    def uncache_uncommitted(self) -> list[int]:
        """The step raised: forget the hashes registered for it (their blocks stay with their
        requests, to be freed as usual, but no later request can hit them).

        Returns:
            The ids of the blocks whose hash was forgotten, in registration order.
        """
        ids = [b.block_id for b in self._uncommitted]
        self.pool.uncache_blocks(self._uncommitted)
        self._uncommitted = []
        return ids

    def fork(self, parent: Request, child: Request, num_tokens: Optional[int] = None) -> bool:
        """Give ``child`` the parent's first ``num_tokens`` computed tokens (default: all of
        them): full blocks shared (ref count + 1), a partial last block copied into a fresh block
        (copy-on-write).

        ``child``'s first ``num_tokens`` tokens must equal the parent's. With a window the child
        takes only the blocks its next query's window reaches (None before them).

        Returns:
            False, changing nothing, if a block for the copy is not available, or if the parent
            already freed a block the child's window needs.
        """
        n = parent.num_computed_tokens if num_tokens is None else min(num_tokens, parent.num_computed_tokens)
        src = self.req_blocks[parent.request_id]
        num_full = n // self.block_size
        partial = n % self.block_size != 0
        if partial and self.pool.num_free_blocks < 1:
            return False
        skipped = self.num_skipped_blocks_at(n)
        shared = src[skipped:num_full]
        if any(b is None for b in shared) or (partial and src[num_full] is None):
            return False
        self.pool.touch(shared)
        blocks = [None] * skipped + shared
        if partial:
            (new,) = self.pool.get_new_blocks(1)
            self.copy_block(src[num_full].block_id, new.block_id)
            blocks.append(new)
        self.req_blocks[child.request_id] = blocks
        self.num_cached_block.pop(child.request_id, None)  # its first allocation offers them again
        self.num_skipped_blocks.pop(child.request_id, None)
        child.block_table = [NULL_BLOCK_ID if b is None else b.block_id for b in blocks]
        child.num_computed_tokens = n
        child.block_hashes = list(parent.block_hashes[:num_full])
        return True

    def free(self, req: Request) -> None:
        """Return every block of ``req`` (tail first, so the chain's tail is evicted first)."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_cached_block.pop(req.request_id, None)
        self.num_skipped_blocks.pop(req.request_id, None)
        self.pool.free_blocks([b for b in reversed(blocks) if b is not None])
        req.block_table = []


def freeable_window(sliding_windows: list[Optional[int]]) -> Optional[int]:
    """The ``sliding_window`` of :class:`KVCacheManager` for a model whose layers have these
    windows: the largest when every layer has one, None when any layer is global (or none are
    given)."""
    if not sliding_windows or any(w is None for w in sliding_windows):
        return None
    return max(sliding_windows)
