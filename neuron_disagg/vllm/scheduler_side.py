"""What the two roles' scheduler sides share: a ``Leg`` per engine request that carries our signed
``kv_transfer_params``, moved only by its role's table; the transfer its siblings share; the
parsing that turns params into a leg, refusing what is not this instance's to act on.

Runs in vLLM's engine-core process, on the engine loop, and does no I/O: every call is a few
dictionary operations, so the engine loop never waits on a transfer (I5).

One HTTP request becomes several engine requests — one per prompt of a list, one per sample with
``n`` > 1 — all carrying the same params. So each engine request's transfer is named by the router's
transfer id plus a digest of its prompt's tokens (``transfer_key``), which P and D compute alike:
each prompt's KV moves once. Engine requests that share a prompt are siblings: the first to need
the transfer owns it (P: hands its blocks over; D: loads them) and the others use what it brought.
A sibling may reach the scheduler only after the owner ended (vLLM adds each sample and each prompt
of a list as its own engine request), so transfers that ended recently (``ENDED_KEPT``) are
remembered for it.
"""

from __future__ import annotations

import array
import enum
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .. import kv_params as leg_params
from ..protocol.messages import TransferId
from ..timeline import OFF, Timeline
from .metadata import StepMetadata

log = logging.getLogger(__name__)
#: Transfers remembered after their owner ended, for siblings that come later (a few hundred bytes each).
ENDED_KEPT = 16384
#: Signed param sets remembered until they expire (``SingleUse``); past this, the oldest go first.
USES_KEPT = 65536
#: An engine request that repeats a prompt its params were already used for is a sibling (a sample
#: of ``n`` > 1) if it arrived within this long of the first: vLLM adds one HTTP request's engine
#: requests together. Later, it is a replay.
SIBLING_WINDOW_S = 10.0


def transfer_key(transfer_id: TransferId, prompt_token_ids) -> TransferId:
    """The transfer of one engine request: the router's transfer id and its prompt's digest."""
    digest = hashlib.blake2b(array.array("q", prompt_token_ids).tobytes(), digest_size=6).hexdigest()
    return TransferId(transfer_id.request, transfer_id.attempt, prompt=digest)


@dataclass
class _Use:
    first_arrival: float
    prompts: set[str]


class SingleUse:
    """Signed params are good for the prompts of one HTTP request (``kv_params``). Remembers, until
    they expire, each set acted on and the prompts it was used for: another prompt beyond the
    count the router signed, or a prompt already used arriving later than its siblings would, is a
    replay (a captured set sent again to make P hold KV no D will take)."""

    def __init__(self, kept: int = USES_KEPT):
        self._uses: OrderedDict[str, _Use] = OrderedDict()  # signature -> its use; oldest first
        self._expiry: dict[str, float] = {}
        self._kept = kept

    def admit(self, params: leg_params.LegParams, prompt: str, arrived: float, now: float) -> bool:
        while self._uses and self._expiry[next(iter(self._uses))] < now:  # signed with one TTL: in order
            self._expiry.pop(self._uses.popitem(last=False)[0])
        use = self._uses.get(params.signature)
        if use is None:
            self._uses[params.signature], self._expiry[params.signature] = _Use(arrived, {prompt}), params.expires_at
            if len(self._uses) > self._kept:
                self._expiry.pop(self._uses.popitem(last=False)[0])
            return True
        if prompt in use.prompts:  # a sample of a prompt taken (n > 1), or the same request again
            return arrived - use.first_arrival <= SIBLING_WINDOW_S
        if len(use.prompts) < params.prompts:  # another prompt of the request's list
            use.prompts.add(prompt)
            return True
        return False


class LegEvent(enum.Enum):
    ASKED = "asked"                    # D: vLLM asked how much of the prompt comes from outside
    ALLOCATED = "allocated"            # D: vLLM allocated the blocks the KV goes into
    LOADED = "loaded"                  # D: the worker finished receiving
    LOAD_FAILED = "load_failed"        # D: the worker finished receiving, without the KV
    OWNER_DONE = "owner_done"          # D: the sibling that loads this prompt is done with it
    HANDED_OFF = "handed_off"          # P: prefill finished; blocks go to the writer or lender
    LAST_CHUNK = "last_chunk"          # P, push, async scheduling: the prompt's last tokens were scheduled
    PREEMPTED = "preempted"            # P: vLLM freed the blocks of a request before its hand-off
    SIBLING_HANDED_OFF = "sibling"     # P: another engine request handed this prompt's KV over
    SENT = "sent"                      # P: the worker released the blocks
    ENDED = "ended"                    # either: vLLM finished the request (done, aborted, error)


END = None  # the leg is forgotten


@dataclass
class Leg:
    """One engine request of a disaggregated HTTP request, on one side."""

    request_id: str
    params: leg_params.LegParams
    key: TransferId  # this engine request's transfer (``transfer_key``)
    state: enum.Enum  # its role's state: decode.DecodeState or prefill.PrefillState
    prompt_tokens: int = 0
    block_ids: tuple[int, ...] = ()  # the blocks held for the transfer (D: registered, P: handed over)
    local_hit_tokens: int = 0        # D: the prompt's tokens vLLM found in the local prefix cache
    # P, push: hand the KV over when the forward that computes the prompt's last tokens is done, not
    # at the request's end a step later. Only for a request that ends with that step (max_tokens 1,
    # as the router sends), whose blocks are followed from the scheduler's output since it started.
    early: bool = False
    streamed_blocks: int = 0  # P, push, streaming: the leading blocks handed to the writer as chunks
    awaiting_first_step: bool = False  # D, timeline on: loaded and not yet scheduled
    kv_blocks: list[Any] = field(default_factory=list)  # D: vLLM's KVCacheBlock objects behind block_ids
    request: Any = None  # D: vLLM's request, whose failed load restarts in fresh blocks (compat)


class SchedulerSide:
    """The role-independent half of a scheduler side; ``prefill.PrefillScheduler`` and
    ``decode.DecodeScheduler`` add their role's table and vLLM calls."""

    role: ClassVar[str]
    TABLE: ClassVar[dict]
    HOLDING: ClassVar[frozenset]  # states in which a leg holds blocks for its transfer (the gauge)

    def __init__(self, block_size: int, signer: leg_params.ParamsSigner, timeline: Timeline = OFF):
        self.block_size = block_size
        self.signer = signer  # only the router's signed kv_transfer_params are acted on
        self.timeline = timeline
        self.legs: dict[str, Leg] = {}
        self.owner: dict[TransferId, str] = {}  # a live transfer -> the leg moving its KV
        # Transfers whose owner ended (D: its load over; P: its blocks handed over), oldest first,
        # with what P answered in pull mode: a sibling arriving after that uses what the owner brought.
        self.ended: OrderedDict[TransferId, dict[str, Any] | None] = OrderedDict()
        self.uses = SingleUse()
        self.counts: Counter[str] = Counter()  # metrics (stats.COUNTS) since the last report
        self.unexpected: Counter[str] = Counter()  # transitions missing from the table (bugs)
        self._step = StepMetadata()
        self._held_changed = True  # a leg started or stopped holding blocks since the last report

    def block_count(self, tokens: int) -> int:
        """The blocks that hold ``tokens`` tokens, the last of them perhaps part-full."""
        return -(-tokens // self.block_size)

    # -- legs ------------------------------------------------------------------------------------------
    def _leg(self, request) -> Leg | None:
        """The request's leg, created the first time vLLM asks about the request; None when the
        request is not one of ours to move (it runs as a plain request, computed here)."""
        leg = self.legs.get(request.request_id)
        if leg is not None:
            return leg
        try:
            parsed = leg_params.parse(getattr(request, "kv_transfer_params", None), self.signer)
        except leg_params.BadTransferParams as exc:  # never raise on the engine loop
            return self._refuse(request, "params_rejected", str(exc))
        if parsed is None:
            parsed = self._unsigned(request)
        if parsed is None:
            return None
        if parsed.role != self.role:  # a router that took this instance for the other role
            return self._refuse(request, "params_for_other_role",
                                f"a {parsed.role} leg sent to a {self.role} instance (are the router's "
                                "--prefill and --decode addresses swapped?)")
        if request.prompt_token_ids is None:  # prompt embeddings: nothing to name the KV by
            return self._refuse(request, "params_rejected", "a prompt given as embeddings")
        key = transfer_key(parsed.transfer_id, request.prompt_token_ids)
        now = time.time()
        arrived = getattr(request, "arrival_time", None)
        if not self.uses.admit(parsed, key.prompt, now if arrived is None else arrived, now):
            return self._refuse(request, "params_replayed", f"kv_transfer_params of transfer {parsed.transfer_id} "
                                "were already used by another request (signed params are good for one request)")
        leg = self.legs[request.request_id] = self._new_leg(request, parsed, key)
        if arrived is not None:
            self.timeline.mark(key, f"{self.role[0]}_arrived", arrived)
        return leg

    def _unsigned(self, request) -> leg_params.LegParams | None:
        """A leg for params not signed by us, where this role takes one (P: ``accept_unsigned_prefill_legs``)."""
        return None

    def _refuse(self, request, count: str, why: str) -> None:
        self.counts[count] += 1
        log.warning("request %s runs without disaggregation: %s", request.request_id, why)
        return None

    def _new_leg(self, request, parsed: leg_params.LegParams, key: TransferId) -> Leg:
        raise NotImplementedError

    def _fire(self, leg: Leg, event: LegEvent) -> bool:
        """Moves ``leg`` as the role's table says; False (logged, counted) for a pair not in it."""
        pair = (leg.state, event)
        if pair not in self.TABLE:
            self.unexpected[f"{leg.state.value}:{event.value}"] += 1
            self.counts["connector_bugs"] += 1
            log.error("request %s: no transition from %s on %s (a bug; the leg is left as it is)",
                      leg.request_id, leg.state.value, event.value)
            return False
        state = self.TABLE[pair]
        if state is END:
            self._forget(leg)
        else:
            self._held_changed |= (leg.state in self.HOLDING) != (state in self.HOLDING)
            leg.state = state
        return True

    def _forget(self, leg: Leg) -> None:
        del self.legs[leg.request_id]
        self._held_changed |= leg.state in self.HOLDING
        if self.owner.get(leg.key) == leg.request_id:
            del self.owner[leg.key]
            self.ended[leg.key] = self._answer(leg.key)
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)

    def _answer(self, key: TransferId) -> dict[str, Any] | None:
        """What siblings of an ended transfer answer vLLM with (P, pull: the owner's offer)."""
        return None

    # -- every step --------------------------------------------------------------------------------------
    def _take_step(self, scheduler_output) -> StepMetadata:
        step, self._step = self._step, StepMetadata()
        step.no_forward = scheduler_output is not None and not scheduler_output.total_num_scheduled_tokens
        return step

    def stats(self) -> dict[str, Any] | None:
        """Since the last call: the blocks held for transfers now (P: handed to the writer or lender;
        D: registered or fenced) if that may have changed, and the counts (rejected params, early
        hand-offs, bugs); None when neither (so idle steps cost nothing)."""
        out: dict[str, Any] = {}
        if self._held_changed:
            self._held_changed = False
            out["held_blocks"] = sum(len(leg.block_ids) for leg in self.legs.values() if leg.state in self.HOLDING)
        if self.counts:
            out["counts"], self.counts = dict(self.counts), Counter()
        return out or None
