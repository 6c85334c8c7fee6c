"""Choice scoring over a label set, sharing the prompt and every common label prefix.

The labels' token sequences form a trie with compressed edges. Scoring walks it: the request of a
node computes its edge's tokens on blocks forked from its parent's request (so the prompt and each
shared prefix are computed once, in the KV cache), scores the edge's tokens after the first, and
returns the log-probabilities of its children's first tokens after its last token. A label's score
is the sum of its tokens' log-probabilities as a continuation of the prompt (nats).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from weir.engine.kv_cache_manager import KVCacheManager
from weir.engine.outputs import ClassificationOutput, softmax
from weir.engine.request import Request, ScoringTask
from weir.engine.sampling_params import SamplingParams

# a scoring request samples nothing; these params only keep the scheduler's generation rules inert
SCORING_PARAMS = SamplingParams(temperature=0, max_tokens=1)


@dataclass
class LabelNode:
    """A trie node: ``edge`` is the token run from the parent to here (the prompt for the root),
    ``labels`` the label indices ending here, ``children`` keyed by their edge's first token."""

    edge: list[int]
    labels: list[int] = field(default_factory=list)
    children: dict[int, "LabelNode"] = field(default_factory=dict)
    score: float = 0.0  # log-probability of the path from the prompt's end to here

    @property
    def child_list(self) -> list["LabelNode"]:
        return list(self.children.values())


def build_label_trie(prompt_token_ids: list[int], label_token_ids: list[list[int]]) -> LabelNode:
    """Trie of the labels below a root whose edge is the prompt, with single-child chains merged.

    Raises:
        ValueError: a label with no tokens.
    """
    root = LabelNode(list(prompt_token_ids))
    for i, ids in enumerate(label_token_ids):
        if not ids:
            raise ValueError(f"label {i} has no tokens")
        node = root
        for t in ids:
            node = node.children.setdefault(t, LabelNode([t]))
        node.labels.append(i)

    def compress(node: LabelNode) -> None:
        for key, child in list(node.children.items()):
            while len(child.children) == 1 and not child.labels:
                (only,) = child.children.values()
                child.edge += only.edge
                child.labels, child.children = only.labels, only.children
            compress(child)

    compress(root)
    return root


class Classification:
    """State of one prompt's choice scoring: the trie, the node requests in flight, the scores.

    Owns ``active`` (id of each node request in flight -> its trie node) and ``scores`` (label
    index -> summed log-probability, set once the label's last node finished). Done when every
    label has a score and no node request is in flight.

    Args:
        request_id: the id returned to the caller.
        labels: the label names, in the order returned.
        label_token_ids: the tokens scored for each label.
        prompt_token_ids: the prompt.
        length_normalize: rank and normalize by the mean log-probability per label token
            instead of the sum (removes the bias toward short labels).
    """

    def __init__(self, request_id: str, labels: list[str], label_token_ids: list[list[int]],
                 prompt_token_ids: list[int], length_normalize: bool = False):
        self.request_id = request_id
        self.labels = list(labels)
        self.priority = 0  # the scheduling priority of every sequence it queues
        self.label_lengths = [len(t) for t in label_token_ids]
        self.root = build_label_trie(prompt_token_ids, label_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.length_normalize = length_normalize
        self.scores: dict[int, float] = {}
        self.active: dict[str, LabelNode] = {}
        self.num_cached_tokens = 0
        self.num_label_tokens = 0
        self._ids = 0

    def next_id(self) -> str:
        self._ids += 1
        return f"{self.request_id}/{self._ids}"

    @property
    def done(self) -> bool:
        return len(self.scores) == len(self.labels) and not self.active

    def root_request(self) -> Request:
        """The request that computes the prompt and the first label tokens' log-probabilities."""
        root = self.root
        return self._node_request(self.request_id, root, root.edge,
                                  ScoringTask(None, [], [c.edge[0] for c in root.child_list]))

    def _node_request(self, request_id: str, node: LabelNode, tokens: list[int], task: ScoringTask) -> Request:
        self.active[request_id] = node
        return Request(request_id, tokens, SCORING_PARAMS, scoring=task)

    def expand(self, req: Request, kv: KVCacheManager) -> list[Request]:
        """A node request finished (its blocks still held): add its scored tokens to the node's
        score, record the labels ending there, and fork one request per child that still has
        tokens to score onto its blocks (a fork that finds no free block for its copy of the
        partial block recomputes through the prefix cache).

        Returns:
            The new node requests, in trie order (to be scheduled before any waiting request).
        """
        node = self.active.pop(req.request_id)
        task = req.scoring
        if node is self.root:
            self.num_cached_tokens = req.num_cached_tokens or 0
        else:
            node.score += sum(task.logprobs[j] for j in range(len(task.targets)))
        for i in node.labels:
            self.scores[i] = node.score
        forks = []
        for child, first_lp in zip(node.child_list, task.final_logprobs or []):
            child.score = node.score + first_lp
            num_new, targets, final_ids = node_request_plan(req.num_tokens, child)
            if num_new == 0:
                for i in child.labels:
                    self.scores[i] = child.score
                continue
            fork = self._node_request(self.next_id(), child, req.all_token_ids + child.edge[:num_new],
                                      ScoringTask(req.num_tokens, targets, final_ids))
            if not kv.fork(req, fork):
                fork.num_computed_tokens = 0
            self.num_label_tokens += num_new
            forks.append(fork)
        return forks

    def output(self) -> ClassificationOutput:
        raw = [self.scores[i] for i in range(len(self.labels))]
        scores = [s / n for s, n in zip(raw, self.label_lengths)] if self.length_normalize else raw
        by_label = dict(zip(self.labels, scores))
        best = max(range(len(scores)), key=lambda i: scores[i])
        return ClassificationOutput(
            label=self.labels[best], probs=softmax(by_label), logprobs=by_label,
            num_prompt_tokens=self.prompt_len, num_cached_tokens=self.num_cached_tokens,
            num_label_tokens=self.num_label_tokens, request_id=self.request_id,
        )


def node_request_plan(parent_len: int, node: LabelNode) -> tuple[int, list[int], Optional[list[int]]]:
    """How a non-root node is computed after its parent's ``parent_len`` tokens.

    Returns:
        (number of the edge's tokens the node's request appends, score targets, ids whose
        log-probabilities are wanted after the request's last token or None). A leaf leaves out its
        last token (nothing follows it); the targets are the edge's tokens after the first, whose
        log-probabilities the positions from ``parent_len`` on give.
    """
    edge = node.edge
    if node.children:
        return len(edge), edge[1:], [c.edge[0] for c in node.child_list]
    return len(edge) - 1, edge[1:], None
