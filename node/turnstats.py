"""What a client learned about one answer: shared by the client (which builds it from the
FINAL frame) and the chat terminal (which prints it), so neither imports the other."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["TurnStats"]


@dataclass(frozen=True)
class TurnStats:
    """What the client learned about one answer (from the FINAL frame and its own clock)."""

    served_by: str  # base58 peer id of the node that ran the model
    entry: str = ""  # the node the client talked to
    hops: int = 0  # forwarding hops (0: the entry node served it)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from a cache
    completion_tokens: int = 0
    ttft_s: float = math.nan  # measured by the client
    total_s: float = math.nan
    finish_reason: str = ""
    route: tuple[str, ...] = ()  # one "peer: action (reason)" per hop
    # decoded in a shared batch (a throughput-mode engine): a greedy answer may differ
    # from a deterministic run of the same prompt (docs/bench/engine.md, section 5)
    batched: bool = False

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["route"] = list(self.route)
        for k in ("ttft_s", "total_s"):
            if not math.isfinite(d[k]):
                d[k] = None
        return d
