"""n > 1 sampling: one request, ``n`` sequences sharing the prompt's KV blocks.

Sequence 0 computes the prompt alone. Once it has sampled its first token, sequences 1..n-1 are
forked from its blocks: each shares the prompt's full blocks and gets a copy of the partial one
(:meth:`weir.engine.kv_cache_manager.KVCacheManager.fork`), then recomputes only the last prompt
token to sample a first token of its own (after vLLM V1's ``ParentRequest``, which fans a request
out into child requests and gathers their outputs).
"""

from __future__ import annotations

from typing import Callable

from weir.engine.kv_cache_manager import KVCacheManager
from weir.engine.request import Request, RequestStatus

# makes the sequence with this id and sample index of a request (sampling state included)
NewSequence = Callable[[str, int], Request]


class ParentRequest:
    """The ``n`` sequences of one generation request.

    Owns the sequences in sample-index order; ``sequences[0]`` is the one that computes the
    prompt. Invariant: ``len(sequences) <= n``; the others are added by :meth:`fork_children`.
    """

    def __init__(self, request_id: str, n: int, first: Request):
        self.request_id = request_id
        self.n = n
        self.priority = 0  # the scheduling priority of every sequence it queues
        self.sequences: list[Request] = [first]

    @property
    def is_finished(self) -> bool:
        return len(self.sequences) == self.n and all(s.is_finished for s in self.sequences)

    def child_id(self, index: int) -> str:
        return f"{self.request_id}/{index}"

    def sequence_ids(self) -> list[str]:
        return [self.request_id] + [self.child_id(i) for i in range(1, self.n)]

    def needs_children(self, seq: Request) -> bool:
        """True when ``seq`` is sequence 0 and has just sampled its first token."""
        return seq is self.sequences[0] and len(self.sequences) < self.n and len(seq.output_token_ids) == 1

    def fork_children(self, new_sequence: NewSequence, kv: KVCacheManager) -> list[Request]:
        """Make sequences 1..n-1 on sequence 0's prompt blocks (all but the last prompt token's).

        A child that finds no free block for its copy of the partial block starts from nothing and
        recomputes its prompt through the prefix cache.

        Returns:
            The children, in sample-index order (to be scheduled before any waiting request).
        """
        first = self.sequences[0]
        children = []
        for i in range(1, self.n):
            child = new_sequence(self.child_id(i), i)
            child.deadline = first.deadline
            child.metrics = {"arrival_time": first.metrics["arrival_time"]}
            if not kv.fork(first, child, first.num_prompt_tokens - 1):
                child.num_computed_tokens = 0
            children.append(child)
        self.sequences += children
        return children

    def sequence_ended(self, seq: Request) -> None:
        """``seq`` finished; a sequence 0 aborted before the fork ends the request without children."""
        if seq.status == RequestStatus.FINISHED_ABORTED and len(self.sequences) < self.n:
            self.n = len(self.sequences)
