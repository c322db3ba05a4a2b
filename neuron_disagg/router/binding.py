"""When a push request's D is chosen: the binding horizon.

Push needs D's registration before P can write, not at arrival: P holds finished KV under its lease
until D registers, then writes what it has at once. So the router sends P's leg at arrival and D's
leg only when P's predicted remaining time falls to ``bind_horizon_ms``, and picks D then, from its
load at that moment. ``None`` ("arrival") sends both at once; 0 waits for P's answer.

The prediction is the router's own: each P serves its legs first come, first served, at a pace
measured from its answers (seconds per prompt token, the time between an answer and the later of
the leg's dispatch and P's previous answer). A P that has not answered yet has no pace, and its
legs bind when it answers. Pure: time in, predictions out; ``flows.py`` owns the waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The weight of the newest answer in the pace's moving average.
PACE_WEIGHT = 0.2


@dataclass
class PrefillPace:
    """One P's pace as this router sees it."""

    seconds_per_token: float | None = None  # None until an answer was measured
    busy_until: float = 0.0                 # when the legs sent so far are predicted to be answered
    last_answer: float = 0.0                # monotonic time of P's latest answer

    def dispatch(self, now: float, tokens: int) -> float | None:
        """A leg of ``tokens`` prompt tokens sent at ``now``: when it should be answered, or None
        with no pace measured yet."""
        if self.seconds_per_token is None:
            return None
        finish = max(now, self.busy_until) + max(tokens, 1) * self.seconds_per_token
        self.busy_until = finish
        return finish

    def answered(self, sent: float, now: float, tokens: int, predicted: float | None) -> None:
        """P answered a leg sent at ``sent``: its service time updates the pace, and the legs queued
        behind it move by how far off its prediction was."""
        service = now - max(sent, self.last_answer)
        self.last_answer = now
        if service > 0 and tokens > 0:
            pace = service / tokens
            self.seconds_per_token = (pace if self.seconds_per_token is None
                                      else (1 - PACE_WEIGHT) * self.seconds_per_token + PACE_WEIGHT * pace)
        self.ended(now, predicted)

    def ended(self, now: float, predicted: float | None) -> None:
        """A leg ended at ``now`` (answered or failed): what was predicted for it after ``now`` is
        no longer ahead of the others."""
        if predicted is not None and predicted > now:
            self.busy_until = max(now, self.busy_until - (predicted - now))


def bind_at(predicted: float | None, horizon_s: float | None, arrived: float) -> float | None:
    """When D's leg goes out: at arrival without a horizon, ``horizon_s`` before P's predicted
    answer with one; None: when P answers (a horizon of 0, or no prediction). A horizon of 0 never
    trusts the prediction: it is pull's timing."""
    if horizon_s is None:
        return arrived
    if predicted is None or horizon_s == 0:
        return None
    return max(arrived, predicted - horizon_s)
