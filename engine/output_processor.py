"""From finished sequences to what the caller gets: text, stop strings, ``RequestOutput``.

Owns each text-tracking sequence's :class:`weir.engine.detokenizer.IncrementalDetokenizer`. The
engine hands it the sequences that got a token in a step (:meth:`OutputProcessor.find_stop_strings`,
which returns the sequences a stop string ended) and the requests whose sequences have all finished
(:meth:`OutputProcessor.make_request_output`). After vLLM V1's ``OutputProcessor``.
"""

from __future__ import annotations

import time
from typing import Optional

from weir.engine.detokenizer import IncrementalDetokenizer
from weir.engine.outputs import CompletionOutput, Logprob, RequestOutput
from weir.engine.parallel_sampling import ParentRequest
from weir.engine.request import Request, RequestStatus

# (duration, start metric, end metric): durations in seconds added to a finished request's metrics
DURATIONS = (("queue_time_s", "arrival_time", "first_scheduled_time"),
             ("time_to_first_token_s", "arrival_time", "first_token_time"),
             ("e2e_latency_s", "arrival_time", "finished_time"))


class OutputProcessor:
    """Detokenizes, applies stop strings and builds outputs.

    Args:
        tokenizer: a transformers tokenizer, or None (then text is ``""`` and logprob entries have
            no ``decoded_token``; stop strings are refused earlier, by the engine).
    """

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_sequence(self, seq: Request) -> None:
        """Start tracking the text of ``seq`` when it has stop strings."""
        p = seq.sampling_params
        if p.stop and self.tokenizer is not None:
            self._detokenizers[seq.request_id] = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
                stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)

    def remove_sequence(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)

    def find_stop_strings(self, seqs: list[Request]) -> list[Request]:
        """Feed the new tokens of ``seqs`` to their detokenizers.

        Returns:
            The sequences whose text now ends in a stop string (``stop_reason`` set to it). A
            stop string is searched for only once ``min_tokens`` tokens exist.
        """
        stopped = []
        for seq in seqs:
            det = self._detokenizers.get(seq.request_id)
            if det is None or len(det.token_ids) == len(seq.output_token_ids):
                continue
            matched = det.update(seq.output_token_ids[len(det.token_ids):],
                                 check_stop=len(seq.output_token_ids) >= seq.sampling_params.min_tokens)
            if matched is not None:
                seq.stop_reason = matched
                stopped.append(seq)
        return stopped

    def finish_sequence(self, seq: Request) -> None:
        """``seq`` ended: stamp ``finished_time`` and release its held text."""
        seq.metrics["finished_time"] = time.time()
        det = self._detokenizers.get(seq.request_id)
        if det is not None:
            det.finish()

    def make_request_output(self, parent: ParentRequest) -> RequestOutput:
        """The output of a request whose sequences have all finished; adds the durations of
        :data:`DURATIONS` to sequence 0's metrics and forgets the sequences' text state."""
        first = parent.sequences[0]
        m = first.metrics
        m["finished_time"] = max(s.metrics.get("finished_time", 0.0) for s in parent.sequences)
        for key, start, end in DURATIONS:
            if start in m and end in m:
                m[key] = m[end] - m[start]
        out = RequestOutput(parent.request_id, first.prompt, first.prompt_token_ids,
                            [self._completion(s) for s in parent.sequences], True,
                            first.num_cached_tokens or 0, dict(m))
        if first.sampling_params.prompt_logprobs is not None:
            out.prompt_logprobs = [None] + [self.logprob_dict(first.prompt_logprobs[p])
                                            for p in range(1, first.num_prompt_tokens)]
        for s in parent.sequences:
            self.remove_sequence(s.request_id)
        return out

    def logprob_dict(self, entries: list) -> dict[int, Logprob]:
        """Sampler entries ``(token_id, logprob, rank)`` as vLLM's ``{token_id: Logprob}``."""
        tok = self.tokenizer
        return {t: Logprob(lp, rank, tok.decode([t]) if tok is not None else None) for t, lp, rank in entries}

    def _completion(self, seq: Request) -> CompletionOutput:
        sp = seq.sampling_params
        det: Optional[IncrementalDetokenizer] = self._detokenizers.get(seq.request_id)
        if det is not None:
            text = det.output_text
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=sp.skip_special_tokens)
        else:
            text = ""
        comp = CompletionOutput(seq.sample_index, text, list(seq.output_token_ids),
                                RequestStatus.finish_reason(seq.status), seq.stop_reason)
        if sp.logprobs is not None:
            comp.logprobs = [self.logprob_dict(e) for e in seq.logprobs]
            comp.cumulative_logprob = sum(e[0][1] for e in seq.logprobs)
        return comp
