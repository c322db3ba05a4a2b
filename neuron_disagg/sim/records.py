"""One record per request: the timestamps the model stamps as it moves, and what is derived from
them. Kept apart from the processes so tests and reports read results without knowing the model."""

from __future__ import annotations

from dataclasses import dataclass

from .workload import RequestSpec


@dataclass
class Record:
    spec: RequestSpec
    p_index: int = -1
    d_index: int = -1
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    registered_s: float | None = None   # push: D's registration reached P
    transfer_start_s: float | None = None
    kv_loaded_s: float | None = None    # D holds the whole prompt's KV
    first_token_s: float | None = None
    done_s: float | None = None
    descriptors: int = 0
    tokens_out: int = 0
    finished_count: int = 0             # conservation check: must end at exactly 1

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None, f"request {self.spec.rid} produced no token"
        return self.first_token_s - self.spec.arrival_s

    @property
    def tpot_s(self) -> float:
        assert self.done_s is not None and self.first_token_s is not None
        if self.spec.output_len <= 1:
            return 0.0
        return (self.done_s - self.first_token_s) / (self.spec.output_len - 1)

    def finish(self, now: float) -> None:
        self.done_s = now
        self.finished_count += 1
