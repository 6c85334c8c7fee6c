"""The persistent batch: one block-table row per scheduled request, kept across steps.

After vLLM V1's ``InputBatch`` and ``BlockTable`` (``vllm/v1/worker/gpu_input_batch.py``,
``block_table.py``): a request gets a row the first step it is scheduled and keeps it while it is
scheduled; each step copies into its row only the block ids its request gained since the last
step, so the host work of a step grows with the blocks added, not with the blocks held.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from weir.engine.host_transfer import to_device

# the largest span of rows copied in one piece; above it only the changed rows travel (2 copies and
# a scatter kernel). Not measured on a GPU: 256 KiB is ~5-10 us at 25-50 GB/s, about the host cost
# of the two extra launches.
SPAN_COPY_MAX_BYTES = 256 << 10
_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}


class BlockTable:
    """Block ids of every row, on the host and on the step's device.

    Owns ``block_table_cpu``, a ``[max_num_reqs + 1, max_num_blocks_per_req]`` int32 host tensor
    (pinned when the device is CUDA) with a numpy view ``block_table_np``, the number of valid
    ids of each row (``num_blocks_per_row``, ``[max_num_reqs + 1]`` int32), and, on CUDA,
    ``block_table_device``, its device copy. On the CPU the device copy is the host tensor.

    Invariants: entries past a row's ``num_blocks_per_row`` are 0; the last row
    (``zero_row``) is all zeros (the padding rows of a step read it). Both dimensions grow (doubling)
    when a row or a row's ids do not fit.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, device: torch.device):
        self.device = device
        self._pin = device.type == "cuda"
        self._alloc(max(max_num_reqs, 1), max(max_num_blocks_per_req, 1))
        self._copy_done = None  # CUDA event of the last host-to-device copy

    def _alloc(self, num_rows: int, width: int) -> None:
        old = getattr(self, "block_table_np", None)
        host = torch.zeros(num_rows + 1, width, dtype=torch.int32, pin_memory=self._pin)
        counts = np.zeros(num_rows + 1, dtype=np.int32)
        if old is not None:  # the old zero row lands in a normal row: it is all zeros, as a free row is
            host.numpy()[:old.shape[0], :old.shape[1]] = old
            counts[:old.shape[0]] = self.num_blocks_per_row
        self.block_table_cpu, self.block_table_np, self.num_blocks_per_row = host, host.numpy(), counts
        self.max_num_reqs, self.max_num_blocks_per_req = num_rows, width
        self.zero_row = num_rows
        self.block_table_device = host if not self._pin else torch.zeros_like(host, device=self.device)
        self._changed: set[int] = set()  # rows written since the last commit
        self._copy_all = old is not None  # a new device copy: every row

    def ensure_size(self, num_rows: int, width: int) -> None:
        """Grow (doubling) to at least ``num_rows`` rows of ``width`` ids."""
        if num_rows > self.max_num_reqs or width > self.max_num_blocks_per_req:
            self.wait_for_copy()
            rows, cols = self.max_num_reqs, self.max_num_blocks_per_req
            self._alloc(max(num_rows, 2 * rows) if num_rows > rows else rows,
                        max(width, 2 * cols) if width > cols else cols)

    def add_row(self, row: int, block_ids: list[int]) -> None:
        """Write the whole of ``row``: ``block_ids`` then zeros."""
        n = len(block_ids)
        self.ensure_size(row + 1, n)
        self.block_table_np[row, :n] = block_ids
        self.block_table_np[row, n:] = 0
        self.num_blocks_per_row[row] = n
        self._changed.add(row)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        """Append ``block_ids`` to ``row`` (vLLM's ``BlockTable.append_row``)."""
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        self.ensure_size(row + 1, end)
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end
        self._changed.add(row)

    def clear_row(self, row: int) -> None:
        n = int(self.num_blocks_per_row[row])
        self.block_table_np[row, :n] = 0
        self.num_blocks_per_row[row] = 0

    def wait_for_copy(self) -> None:
        """Block until the last host-to-device copy has read the host rows (before rewriting them).

        Returns at once when the GPU is not behind (the engine's step ends with a sync, the sampled
        tokens); it keeps the copies non-blocking safe should scheduling overlap the GPU.
        """
        if self._copy_done is not None:
            self._copy_done.synchronize()
            self._copy_done = None

    @property
    def changed_rows(self) -> list[int]:
        """The rows written since the last :meth:`commit`, ascending."""
        return sorted(self._changed)

    def commit(self) -> None:
        """Copy the rows changed since the last commit to the device, non-blocking, one of two ways.

        The span of whole rows from the first changed row to the last, in one copy (both ends
        contiguous), while it is at most ``SPAN_COPY_MAX_BYTES`` or twice the changed rows' bytes;
        else only the changed rows, staged in fresh pinned buffers (the caching host allocator
        keeps them until the copy has read them), copied and scattered with ``index_copy_``. A
        decode step at batch 256 changes about 16 rows (one block in 16 steps each) spread over
        the batch: the span is nearly the whole table, ``4 * max_num_blocks_per_req`` bytes a row.
        """
        if not self._changed and not self._copy_all:
            return
        rows = range(self.max_num_reqs) if self._copy_all else sorted(self._changed)
        self._changed.clear()
        self._copy_all = False
        if self.block_table_device is self.block_table_cpu:
            return
        lo, hi = rows[0], rows[-1] + 1
        row_bytes = 4 * self.max_num_blocks_per_req
        if (hi - lo) * row_bytes <= SPAN_COPY_MAX_BYTES or hi - lo <= 2 * len(rows):
            self.block_table_device[lo:hi].copy_(self.block_table_cpu[lo:hi], non_blocking=True)
        else:
            # staged rows: [num_changed, max_num_blocks_per_req]
            staged = torch.empty(len(rows), self.max_num_blocks_per_req, dtype=torch.int32, pin_memory=self._pin)
            np.take(self.block_table_np, rows, axis=0, out=staged.numpy())
            self.block_table_device.index_copy_(0, to_device(rows, self.device, torch.int64),
                                                staged.to(self.device, non_blocking=True))
        if self.device.type == "cuda":
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()

    def gather(self, rows: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The step's block table: row ``rows[i]``'s first ``width`` ids, on the device.

        Args:
            rows: ``[num_reqs]`` int32/int64 row indices on the device (``zero_row`` for padding).
            width: columns wanted, at most ``max_num_blocks_per_req``.
            dtype: the dtype of the result.

        Returns:
            A new ``[num_reqs, width]`` tensor (a later step's copies never change it).
        """
        if self.block_table_device is self.block_table_cpu:
            # host memory: numpy, single-threaded (torch's intra-op threads cost more than this copy)
            out = np.take(self.block_table_np[:, :width], rows.numpy(), axis=0)
            return torch.from_numpy(out if out.dtype == _NUMPY_DTYPES[dtype] else out.astype(_NUMPY_DTYPES[dtype]))
        out = torch.index_select(self.block_table_device[:, :width], 0, rows)
        return out if out.dtype == dtype else out.to(dtype)


class InputBatch:
    """The scheduled requests of the last step, one row of :class:`BlockTable` each.

    A request is known by identity (request ids may be reused after an abort, and the profiling
    step's prompts carry none). Its row mirrors its ``block_table`` list, which the
    :class:`~weir.engine.kv_cache_manager.KVCacheManager` only appends to while the request holds
    blocks and replaces (a new list object) when it frees or forks them: a longer list adds its
    tail to the row, another list object rewrites the row. Under a sliding window the manager also
    sets leading entries to ``NULL_BLOCK_ID`` in place; the row keeps the old ids there until it
    is rewritten, which is harmless because attention never reads entries before a query's window. A row is freed the first step that
    does not schedule its request (finished, preempted, aborted or out of token budget), and the
    next new request takes the lowest free row.

    Args:
        max_num_reqs: rows (``max_num_seqs``); grows if a step schedules more.
        max_num_blocks_per_req: ``ceil(max_model_len / block_size)``; grows if a request needs more.
        device: where the step runs; on CUDA the host table is pinned and copied non-blocking.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, device: torch.device):
        self.block_table = BlockTable(max_num_reqs, max_num_blocks_per_req, device)
        self._row_of: dict[int, int] = {}  # id(request) -> row
        self._requests: list = [None] * max(max_num_reqs, 1)  # row -> request (None: free)
        self._tables: list = [None] * max(max_num_reqs, 1)  # row -> the block_table list it mirrors
        self._num_blocks: list[int] = [0] * max(max_num_reqs, 1)  # row -> ids copied from that list
        self._last_step: list[int] = [0] * max(max_num_reqs, 1)  # row -> last step it was scheduled
        self._free_rows = list(range(max(max_num_reqs, 1)))  # a heap
        self._step = 0

    @property
    def num_reqs(self) -> int:
        return len(self._row_of)

    def row_of(self, req) -> int | None:
        """The row of ``req``, or None if it has none."""
        row = self._row_of.get(id(req))
        return row if row is not None and self._requests[row] is req else None

    def update(self, reqs: list) -> list[int]:
        """Give this step's requests their rows and bring each row up to its ``block_table``.

        Args:
            reqs: the step's requests (``block_table`` is a list of block ids), in packed order.

        Returns:
            The row of each request, in the order given.
        """
        self.block_table.wait_for_copy()
        self._step += 1
        step, row_of, tables = self._step, self._row_of, self._tables
        num_blocks, last = self._num_blocks, self._last_step
        rows: list[int] = []
        new: list[int] = []
        for i, r in enumerate(reqs):
            row = row_of.get(id(r))
            bt = r.block_table
            if row is None or tables[row] is not bt or len(bt) < num_blocks[row]:
                new.append(i)
                rows.append(-1)
                continue
            if len(bt) != num_blocks[row]:
                self.block_table.append_row(row, bt[num_blocks[row]:])
                num_blocks[row] = len(bt)
            last[row] = step
            rows.append(row)
        if len(rows) - len(new) != len(row_of):  # some rows' requests left the batch or were rewritten
            for row in [row_of[key] for key in row_of if last[row_of[key]] != step]:
                self._remove(row)
        for i in new:
            rows[i] = self._add(reqs[i])
        return rows

    def _add(self, req) -> int:
        if not self._free_rows:
            self._grow()
        row = heapq.heappop(self._free_rows)
        self._row_of[id(req)] = row
        self._requests[row], self._tables[row] = req, req.block_table
        self._num_blocks[row], self._last_step[row] = len(req.block_table), self._step
        self.block_table.add_row(row, req.block_table)
        return row

    def _remove(self, row: int) -> None:
        del self._row_of[id(self._requests[row])]
        self._requests[row] = self._tables[row] = None
        self._num_blocks[row] = 0
        self.block_table.clear_row(row)
        heapq.heappush(self._free_rows, row)

    def _grow(self) -> None:
        n = len(self._requests)
        self.block_table.ensure_size(2 * n, 1)
        for per_row in (self._requests, self._tables):
            per_row.extend([None] * n)
        self._num_blocks.extend([0] * n)
        self._last_step.extend([0] * n)
        for row in range(n, 2 * n):
            heapq.heappush(self._free_rows, row)
