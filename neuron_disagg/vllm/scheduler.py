"""The connector's scheduler side: runs in vLLM's engine-core process, on the engine loop.

It translates vLLM's scheduler calls into work for the worker side (``StepMetadata``) and keeps one
``Leg`` per disaggregated request with an explicit state. It does no I/O: every call is a few
dictionary operations, so the engine loop never waits on a transfer (I5).

One HTTP request becomes several engine requests — one per prompt of a list, one per sample with
``n`` > 1 — all carrying the same ``kv_transfer_params``. So each engine request's transfer is named
by the router's transfer id and a digest of its prompt's tokens (``transfer_key``), which P and D
compute alike: each prompt's KV moves once. Engine requests that share a prompt are siblings: on P
the first to finish hands its blocks over and the others free theirs; on D the first registers and
the others wait for its KV, then compute from D's prefix cache as vLLM shares any prefix. A sibling
may reach the scheduler only after the first one ended (vLLM adds each sample and each prompt of a
list as its own engine request); the transfers that ended recently (``ENDED_KEPT``) are remembered
for it, since asking again for a transfer that ended would get nothing.
"""

from __future__ import annotations

import array
import base64
import enum
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from ..protocol.messages import PullOffer, RankRegions, TransferId
from ..protocol.wire import WireCodec
from ..timeline import OFF, Timeline

from . import compat
from .. import kv_params as leg_params
from .metadata import Abort, AllocatedBlocks, Expect, KvReady, Lend, ReadOffer, StepMetadata

log = logging.getLogger(__name__)
#: Transfers remembered after their owner ended, for siblings that come later (a few hundred bytes each).
ENDED_KEPT = 16384


class OfferMaker:
    """P, pull mode: signed offers naming every P rank's agent and regions (from the handshake)."""

    def __init__(self, codec: WireCodec, engine_id: str, side_channel: str, ranks: tuple[RankRegions, ...],
                 lease_s: float):
        self.codec, self.engine_id, self.side_channel = codec, engine_id, side_channel
        self.ranks, self.lease_s = ranks, lease_s

    def offer(self, transfer_id: TransferId, block_ids: tuple[int, ...]) -> tuple[PullOffer, bytes]:
        """The offer for our own workers, and its signed frame for the router to carry to D."""
        now = time.time()
        offer = PullOffer(transfer_id, self.engine_id, self.side_channel, len(self.ranks), self.ranks,
                          block_ids, now + self.lease_s, now)
        return offer, self.codec.encode(offer)


def transfer_key(transfer_id: TransferId, prompt_token_ids) -> TransferId:
    """The transfer of one engine request: the router's transfer id and its prompt's digest."""
    digest = hashlib.blake2b(array.array("q", prompt_token_ids).tobytes(), digest_size=6).hexdigest()
    return TransferId(f"{transfer_id.request}/{digest}", transfer_id.attempt)


class DecodeState(enum.Enum):
    NEW = "new"                                # created by vLLM's first question, answered at once
    WAITING_FOR_BLOCKS = "waiting_for_blocks"  # the worker expects the transfer (push: heartbeats P)
    FOLLOWING = "following"                    # a sibling loads this prompt's KV; then reuse it
    LOADING = "loading"                        # blocks registered with P (push) or being read (pull)
    ABORTING = "aborting"                      # ended while loading; the worker fences the blocks
    LOADED = "loaded"                          # KV arrived; decoding
    FAILED = "failed"                          # no KV; vLLM's kv_load_failure_policy applies


class PrefillState(enum.Enum):
    PREFILLING = "prefilling"
    LAST_CHUNK = "last_chunk"                  # async scheduling: the forward ending the prompt is in flight
    HANDED_OFF = "handed_off"                  # blocks held until the writer or lender is done


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
_D, _P, _E = DecodeState, PrefillState, LegEvent
#: D's every transition. A pair missing here is a bug, logged and counted, never raised on the engine loop.
DECODE_TABLE: dict[tuple[DecodeState, LegEvent], DecodeState | None] = {
    (_D.NEW, _E.ASKED): _D.WAITING_FOR_BLOCKS,        # in the call that created the leg
    (_D.WAITING_FOR_BLOCKS, _E.ALLOCATED): _D.LOADING,
    (_D.WAITING_FOR_BLOCKS, _E.ENDED): END,            # tells the worker to stop expecting it
    (_D.FOLLOWING, _E.OWNER_DONE): END,                # computes from the prefix cache the KV filled
    (_D.FOLLOWING, _E.ENDED): END,
    (_D.LOADING, _E.LOADED): _D.LOADED,
    (_D.LOADING, _E.LOAD_FAILED): _D.FAILED,
    (_D.LOADING, _E.ENDED): _D.ABORTING,               # vLLM holds the blocks until the worker reports
    (_D.ABORTING, _E.LOADED): END,
    (_D.ABORTING, _E.LOAD_FAILED): END,
    (_D.LOADED, _E.ENDED): END,
    (_D.FAILED, _E.ENDED): END,
}
#: P's every transition.
PREFILL_TABLE: dict[tuple[PrefillState, LegEvent], PrefillState | None] = {
    (_P.PREFILLING, _E.HANDED_OFF): _P.HANDED_OFF,     # at the step end (push) or the request's end
    (_P.PREFILLING, _E.LAST_CHUNK): _P.LAST_CHUNK,
    (_P.PREFILLING, _E.SIBLING_HANDED_OFF): END,       # freed at once; the sibling's KV is the one sent
    (_P.PREFILLING, _E.ENDED): END,                    # aborted, failed, or nothing to send
    (_P.LAST_CHUNK, _E.HANDED_OFF): _P.HANDED_OFF,     # the next step, or the request's end if sooner
    (_P.LAST_CHUNK, _E.PREEMPTED): _P.PREFILLING,      # its blocks are gone: computed again, sent at its end
    (_P.LAST_CHUNK, _E.SIBLING_HANDED_OFF): END,
    (_P.LAST_CHUNK, _E.ENDED): END,
    (_P.HANDED_OFF, _E.ENDED): _P.HANDED_OFF,          # ended after an early hand-off: still held
    (_P.HANDED_OFF, _E.SENT): END,
}
#: States in which a leg holds blocks for its transfer (the held-blocks gauge).
HOLDING = frozenset({_D.LOADING, _D.ABORTING, _P.HANDED_OFF})


@dataclass
class Leg:
    """One engine request of a disaggregated HTTP request, on one side."""

    request_id: str
    params: leg_params.LegParams
    key: TransferId  # this engine request's transfer (``transfer_key``)
    state: DecodeState | PrefillState
    local_hit_tokens: int = 0
    block_ids: tuple[int, ...] = ()  # the blocks held for the transfer (D: registered, P: handed over)
    prompt_tokens: int = 0
    # P, push: hand the KV over when the forward that computes the prompt's last tokens is done, not
    # at the request's end a step later. Only for a request that ends with that step (max_tokens 1,
    # as the router sends), whose blocks are followed from the scheduler's output since it started.
    early: bool = False


class SchedulerSide:
    def __init__(self, block_size: int, signer: leg_params.ParamsSigner, offers: "OfferMaker | None" = None,
                 timeline: Timeline = OFF, async_scheduling: bool = False):
        self.block_size = block_size
        # vLLM schedules step N+1 before step N's output is in: a prefill that ends in step N is
        # handed over at step N+1's start (once we know N+1 did not preempt it), not after N's forward.
        self.async_scheduling = async_scheduling
        self.signer = signer  # only the router's signed kv_transfer_params are acted on
        self.timeline = timeline
        self.offers = offers  # pull mode on P: None until the workers' handshake arrived
        self.legs: dict[str, Leg] = {}
        self.owner: dict[TransferId, str] = {}  # a transfer -> the leg moving its KV (siblings share it)
        self.offered: dict[TransferId, dict[str, Any]] = {}  # P, pull: the params siblings answer with
        # Transfers whose owner ended (D: its load over; P: its blocks handed over), oldest first,
        # with P's pull answer: a sibling arriving after that uses what the owner brought.
        self.ended: OrderedDict[TransferId, dict[str, Any] | None] = OrderedDict()
        self.counts: Counter[str] = Counter()  # metrics (stats.COUNTS) since the last report
        self._following: dict[str, None] = {}  # P: legs followed for an early hand-off, in arrival order
        self._first_step: dict[str, TransferId] = {}  # D, timeline on: loaded, not yet scheduled
        self.unexpected: Counter[str] = Counter()  # transitions missing from the tables (bugs)
        self._step = StepMetadata()
        self._held_changed = True  # a leg started or stopped holding blocks since the last report

    def _leg(self, request) -> Leg | None:
        leg = self.legs.get(request.request_id)
        if leg is None:
            try:
                parsed = leg_params.parse(getattr(request, "kv_transfer_params", None), self.signer)
            except leg_params.BadTransferParams as exc:  # never raise on the engine loop
                self.counts["params_rejected"] += 1
                log.warning("request %s runs without disaggregation: %s", request.request_id, exc)
                return None
            if parsed is None:
                return None
            if request.prompt_token_ids is None:  # prompt embeddings: nothing to name the KV by
                self.counts["params_rejected"] += 1
                log.warning("request %s runs without disaggregation: a prompt given as embeddings",
                            request.request_id)
                return None
            key = transfer_key(parsed.transfer_id, request.prompt_token_ids)
            state: DecodeState | PrefillState = _P.PREFILLING if parsed.role == "prefill" else _D.NEW
            if parsed.role == "decode" and (self.owner.get(key) in self.legs or key in self.ended):
                state = _D.FOLLOWING  # a sibling has (or is getting, or got) this prompt's KV
            leg = self.legs[request.request_id] = Leg(request.request_id, parsed, key, state,
                                                      prompt_tokens=len(request.prompt_token_ids))
            sampling = getattr(request, "sampling_params", None)
            leg.early = (parsed.role == "prefill" and parsed.mode == "push"
                         and getattr(sampling, "max_tokens", None) == 1)
            if leg.early:
                self._following[request.request_id] = None
            if state is _D.NEW:
                self.owner[key] = request.request_id
            arrived = getattr(request, "arrival_time", None)
            if arrived is not None:
                self.timeline.mark(key, f"{parsed.role[0]}_arrived", arrived)
        return leg

    def _busy(self, request_id: str | None) -> bool:
        """D: that leg is still getting its KV (a sibling must wait for it)."""
        leg = self.legs.get(request_id) if request_id is not None else None
        return leg is not None and leg.state in (_D.NEW, _D.WAITING_FOR_BLOCKS, _D.LOADING)

    def _fire(self, leg: Leg, event: LegEvent) -> bool:
        """Moves ``leg`` as its side's table says; False (logged, counted) for a pair not in it."""
        table: dict = PREFILL_TABLE if isinstance(leg.state, PrefillState) else DECODE_TABLE
        key = (leg.state, event)
        if key not in table:
            self.unexpected[f"{leg.state.value}:{event.value}"] += 1
            self.counts["connector_bugs"] += 1
            log.error("request %s: no transition from %s on %s (a bug; the leg is left as it is)",
                      leg.request_id, leg.state.value, event.value)
            return False
        state = table[key]
        if state is END:
            self._forget(leg)
        else:
            self._held_changed |= (leg.state in HOLDING) != (state in HOLDING)
            leg.state = state
        return True

    def _forget(self, leg: Leg) -> None:
        del self.legs[leg.request_id]
        self._stop_following(leg)
        self._first_step.pop(leg.request_id, None)
        self._held_changed |= leg.state in HOLDING
        if self.owner.get(leg.key) == leg.request_id:
            del self.owner[leg.key]
            # On P only a leg that handed its blocks over is an owner, so its end means "sent".
            self.ended[leg.key] = self.offered.pop(leg.key, None)
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)

    def _taken(self, key: TransferId, request_id: str) -> bool:
        """P: another engine request hands (or handed) this prompt's KV over."""
        return self.owner.get(key, request_id) != request_id or key in self.ended

    # -- D ---------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """D: the whole prompt beyond our local prefix hit comes from P, asynchronously. A sibling of
        a request that loads the same prompt waits (None: ask again next step), then computes from
        the local prefix cache the loaded KV filled."""
        leg = self._leg(request)
        if leg is not None and leg.state is _D.FOLLOWING:
            if self._busy(self.owner.get(leg.key)):
                return None, False
            self._fire(leg, _E.OWNER_DONE)
            return 0, False
        if leg is None or leg.params.role != "decode" or leg.state not in (_D.NEW, _D.WAITING_FOR_BLOCKS):
            return 0, False  # not ours, or loaded (a preempted request) or failed: compute locally
        if leg.state is _D.NEW:
            self._fire(leg, _E.ASKED)
            if leg.params.mode == "push":  # the worker heartbeats P from now on
                self._step.expect.append(Expect(leg.key, leg.params.p_side_channel, leg.params.p_tp_size))
        leg.local_hit_tokens = num_computed_tokens
        return len(request.prompt_token_ids) - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        leg = self.legs.get(request.request_id)
        if leg is not None and leg.state is _P.PREFILLING:
            self.timeline.mark(leg.key, "p_scheduled")
        if leg is None or num_external_tokens == 0 or leg.state is not _D.WAITING_FOR_BLOCKS:
            return
        first = leg.local_hit_tokens // self.block_size
        prompt_blocks = -(-len(request.prompt_token_ids) // self.block_size)
        block_ids = tuple(blocks.get_block_ids()[0][first:prompt_blocks])
        allocated = AllocatedBlocks(leg.key, request.request_id, block_ids, first)
        leg.block_ids = block_ids
        if leg.params.mode == "push":
            self._step.register.append(allocated)
        else:  # the worker picks the offer for this prompt's transfer
            self._step.read.append(ReadOffer(allocated, tuple(base64.b64decode(o) for o in leg.params.offers)))
        self._fire(leg, _E.ALLOCATED)
        self.timeline.mark(leg.key, "d_allocated")

    # -- both ------------------------------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        leg = self.legs.get(request.request_id)
        if leg is None:
            return False, None
        if leg.params.role == "prefill":
            return self._prefill_finished(leg, request, block_ids)
        if leg.state is _D.LOADING:
            # vLLM holds the blocks until our worker reports this request finished receiving,
            # which it does only once P confirmed or the fence passed (I2).
            self._step.abort.append(Abort(leg.key, "decode", "decode request aborted"))
        elif leg.state is _D.WAITING_FOR_BLOCKS:
            self._step.abort.append(Abort(leg.key, "decode", "decode request aborted before it had blocks"))
        self._fire(leg, _E.ENDED)
        return False, None

    def _prefill_finished(self, leg: Leg, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tid, status = leg.key, str(getattr(request, "status", ""))
        self._stop_following(leg)  # ended: nothing left to follow
        # vLLM 0.24 passes every block of the request, later versions those of computed tokens:
        # the prompt's KV is in the first blocks either way.
        block_ids = block_ids[:-(-len(request.prompt_token_ids) // self.block_size)]
        finished = "ABORTED" not in status and "ERROR" not in status and bool(block_ids)
        if leg.state is _P.HANDED_OFF:  # handed over when its last forward ended; the writer has them
            if tuple(block_ids) != leg.block_ids and finished:
                self.unexpected["early_blocks_differ"] += 1
                self.counts["connector_bugs"] += 1
                log.error("request %s: handed over blocks %s, vLLM ends it with %s (a bug)",
                          request.request_id, leg.block_ids, block_ids)
            if not finished:
                self._step.abort.append(Abort(tid, "prefill", f"prefill request ended: {status}"))
            self._fire(leg, _E.ENDED)
            return True, None
        if finished and self._taken(tid, request.request_id):
            answer = self.offered.get(tid) or self.ended.get(tid)  # a sibling handed this prompt's KV over
            self._fire(leg, _E.SIBLING_HANDED_OFF)
            return False, answer
        if finished and (leg.params.mode == "push" or self.offers is not None):
            leg.block_ids = tuple(block_ids)
            self._fire(leg, _E.HANDED_OFF)
            self.owner[tid] = request.request_id
            self.timeline.mark(tid, "p_kv_ready")
            if leg.params.mode == "push":
                self._step.kv_ready.append(KvReady(tid, request.request_id, leg.block_ids))
                return True, None  # the writer frees them; we hear of it in finished_sending
            offer, frame = self.offers.offer(tid, leg.block_ids)
            self._step.lend.append(Lend(tid, request.request_id, offer))
            self.offered[tid] = leg_params.prefill_answer(base64.b64encode(frame).decode())
            return True, self.offered[tid]
        if finished:
            log.warning("request %s: no pull offer possible before the workers' handshake", request.request_id)
        self._step.abort.append(Abort(tid, "prefill", f"prefill request ended: {status}"))
        self._fire(leg, _E.ENDED)
        return False, None

    def build_connector_meta(self, scheduler_output) -> StepMetadata:
        if scheduler_output is not None and self._following:  # D's steps never walk their legs
            self._follow_prefills(scheduler_output)
        if scheduler_output is not None and self._first_step:
            self._mark_first_steps(scheduler_output.num_scheduled_tokens)
        step, self._step = self._step, StepMetadata()
        step.no_forward = scheduler_output is not None and not scheduler_output.total_num_scheduled_tokens
        return step

    def _mark_first_steps(self, scheduled: dict[str, int]) -> None:
        """D, timeline on: loaded requests this step schedules. From their ``d_loaded`` to here is
        vLLM's own engine loop (after a step that computed nothing it sleeps 1 ms), which the bench
        shows apart from D's first step."""
        for request_id in [r for r in self._first_step if r in scheduled]:
            self.timeline.mark(self._first_step.pop(request_id), "d_scheduled")

    def _follow_prefills(self, out) -> None:
        """P, push: follows the blocks of each prefill the scheduler runs, and hands them over in the
        step whose forward computes the prompt's last tokens — after that forward (synchronous
        scheduling), or at the next step's start unless that step preempted it (async scheduling,
        where vLLM schedules step N+1 before step N's output, and so before the request's end)."""
        scheduled, preempted = out.num_scheduled_tokens, out.preempted_req_ids or ()
        new = {r.req_id: r for r in out.scheduled_new_reqs}
        cached, index = out.scheduled_cached_reqs, None
        for leg in [self.legs[rid] for rid in list(self._following)]:
            rid = leg.request_id
            if rid in preempted:  # its blocks are gone; what it gets next is not followed here
                self._stop_following(leg)
                if leg.state is _P.LAST_CHUNK:
                    self._fire(leg, _E.PREEMPTED)
                continue
            if leg.state is _P.LAST_CHUNK:  # its forward is done by this step's start
                self._hand_off_early(leg, after_forward=False)
                continue
            if leg.state is not _P.PREFILLING or not scheduled.get(rid):
                continue
            if rid in new:
                request = new[rid]
                leg.block_ids, computed = tuple(request.block_ids[0]), request.num_computed_tokens
            else:
                index = index or {r: i for i, r in enumerate(cached.req_ids)}
                i = index[rid]
                added = cached.new_block_ids[i]
                if added is not None:
                    resumed = rid in (cached.resumed_req_ids or ())
                    leg.block_ids = tuple(added[0]) if resumed else leg.block_ids + tuple(added[0])
                computed = cached.num_computed_tokens[i]
            if computed + scheduled[rid] < leg.prompt_tokens:
                continue
            if self.async_scheduling:
                self._fire(leg, _E.LAST_CHUNK)
                if not self._taken(leg.key, rid):  # the writer plans while this forward runs
                    self._step.kv_coming.append(KvReady(leg.key, rid, self._prompt_blocks(leg)))
            else:
                self._hand_off_early(leg, after_forward=True)

    def _prompt_blocks(self, leg: Leg) -> tuple[int, ...]:
        return leg.block_ids[:-(-leg.prompt_tokens // self.block_size)]

    def _stop_following(self, leg: Leg) -> None:
        leg.early = False
        self._following.pop(leg.request_id, None)

    def _hand_off_early(self, leg: Leg, after_forward: bool) -> None:
        self._stop_following(leg)
        if self._taken(leg.key, leg.request_id):
            return  # a sibling's KV is sent; this one is freed at its end
        leg.block_ids = self._prompt_blocks(leg)
        self.owner[leg.key] = leg.request_id
        self._fire(leg, _E.HANDED_OFF)
        self.counts["early_hand_offs"] += 1
        ready = KvReady(leg.key, leg.request_id, leg.block_ids)
        if after_forward:  # the worker marks p_kv_ready when that forward is done
            self._step.kv_ready_after_forward.append(ready)
        else:
            self._step.kv_ready.append(ready)
            self.timeline.mark(leg.key, "p_kv_ready")

    def update_connector_output(self, output) -> None:
        failed = compat.failed_loads(output, {leg.request_id: leg.block_ids for leg in self.legs.values()
                                              if leg.state is _D.LOADING})
        for request_id in output.finished_recving or ():
            leg = self.legs.get(request_id)
            if leg is not None:
                self._fire(leg, _E.LOAD_FAILED if request_id in failed else _E.LOADED)
                if leg.state is _D.LOADED:
                    self.timeline.mark(leg.key, "d_loaded")
                    if self.timeline.enabled:
                        self._first_step[request_id] = leg.key
        for request_id in output.finished_sending or ():
            leg = self.legs.get(request_id)
            if leg is not None:
                self._fire(leg, _E.SENT)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a P request's blocks wait for the writer."""
        return any(leg.state is _P.HANDED_OFF for leg in self.legs.values())

    def stats(self) -> dict[str, Any] | None:
        """Since the last call: the blocks held for transfers now (P: handed to the writer; D:
        registered or fenced) if that may have changed, and its counts (rejected params, early
        hand-offs, bugs); None when neither (so idle steps cost nothing)."""
        out: dict[str, Any] = {}
        if self._held_changed:
            self._held_changed = False
            out["held_blocks"] = sum(len(leg.block_ids) for leg in self.legs.values() if leg.state in HOLDING)
        if self.counts:
            out["counts"], self.counts = dict(self.counts), Counter()
        return out or None
