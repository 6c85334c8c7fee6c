"""Hand-built steps for the step-input builder and the graph runners: requests reduced to what
the builder reads of them."""

from __future__ import annotations

from dataclasses import dataclass

from weir.engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class Req:
    """What the step builder reads of a request."""

    all_token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int


def mixed_step() -> SchedulerOutput:
    """10 tokens, scheduled as fresh prompt B, long chunk C, decode A, short chunk D."""
    a = Req(list(range(10, 16)), [7, 2], 5)   # decode of token 15 at position 5
    b = Req([20, 21, 22], [3], 0)            # fresh prompt, 3 tokens
    c = Req(list(range(30, 40)), [5, 1], 4)  # chunk of 4 over a 4-token prefix
    d = Req(list(range(40, 44)), [6], 2)     # chunk of 2 over a 2-token prefix
    return SchedulerOutput([ScheduledRequest(b, 3), ScheduledRequest(c, 4), ScheduledRequest(a, 1),
                            ScheduledRequest(d, 2)])
