"""The prefill instance (vLLM's ``kv_producer``): its leg table, its scheduler side and its worker side.

Scheduler side (engine-core process): follows each prefill leg from its arrival to the hand-off of
its blocks — to the push writer when the forward that computes its prompt's last tokens ends, or at
the request's end — and holds them until the worker says the threads are done with them. In pull
mode the hand-off is an offer, signed here and answered to the router with the request's output.

Worker side (each worker process): hands the step's work to the rank's writer and lender (queue
puts only) and reports to vLLM the requests whose blocks the threads released.
"""

from __future__ import annotations

import base64
import enum
import logging
import time
from typing import Any

from .. import kv_params as leg_params
from ..platforms.fence import LayerFences
from ..platforms.kv_layout import LayerGroups, layer_groups
from ..protocol.messages import PullOffer, RankRegions, Region, TransferId
from ..protocol.wire import WireCodec
from . import compat
from .scheduler_side import END, Leg, LegEvent, SchedulerSide
from .metadata import Abort, HandOff, OfferMade, StepMetadata
from .worker import WorkerSide

log = logging.getLogger(__name__)


class PrefillState(enum.Enum):
    PREFILLING = "prefilling"
    LAST_CHUNK = "last_chunk"                  # async scheduling: the forward ending the prompt is in flight
    HANDED_OFF = "handed_off"                  # blocks held until the writer or lender is done


_P, _E = PrefillState, LegEvent
#: P's every transition. A pair missing here is a bug, logged and counted, never raised on the engine loop.
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


class PrefillScheduler(SchedulerSide):
    role, TABLE, HOLDING = "prefill", PREFILL_TABLE, frozenset({_P.HANDED_OFF})

    def __init__(self, block_size: int, signer: leg_params.ParamsSigner, offers: OfferMaker | None = None,
                 async_scheduling: bool = False, accept_unsigned: bool = False, stream: bool = True, **kwargs):
        super().__init__(block_size, signer, **kwargs)
        self.stream = stream  # push: each step's finished blocks go to the writer as the prefill runs
        self.accept_unsigned = accept_unsigned  # llm-d's sidecar: legs with vLLM's do_remote_decode only
        # vLLM schedules step N+1 before step N's output is in: a prefill that ends in step N is
        # handed over at step N+1's start (once we know N+1 did not preempt it), not after N's forward.
        self.async_scheduling = async_scheduling
        self.offers = offers  # pull mode: None until the workers' handshake arrived
        self.offered: dict[TransferId, dict[str, Any]] = {}  # pull: the params siblings answer with
        self._following: dict[str, Leg] = {}  # legs followed for an early hand-off, in arrival order
        # Siblings (a prompt list, n > 1) share one transfer: only the first to stream it streams it.
        self._streamer: dict[TransferId, str] = {}

    def _new_leg(self, request, parsed: leg_params.LegParams, key: TransferId) -> Leg:
        leg = Leg(request.request_id, parsed, key, _P.PREFILLING, prompt_tokens=len(request.prompt_token_ids))
        sampling = getattr(request, "sampling_params", None)
        leg.early = parsed.mode == "push" and getattr(sampling, "max_tokens", None) == 1
        if leg.early:
            self._following[request.request_id] = leg
        return leg

    def _unsigned(self, request) -> leg_params.LegParams | None:
        if not self.accept_unsigned:
            return None
        return leg_params.unsigned_prefill(getattr(request, "kv_transfer_params", None), request.request_id,
                                           self.signer.ttl_s)

    def _forget(self, leg: Leg) -> None:
        self._stop_following(leg)
        super()._forget(leg)

    def _answer(self, key: TransferId) -> dict[str, Any] | None:
        return self.offered.pop(key, None)  # on P only a leg that handed its blocks over owns a transfer

    def _taken(self, key: TransferId, request_id: str) -> bool:
        """Another engine request hands (or handed) this prompt's KV over."""
        return self.owner.get(key, request_id) != request_id or key in self.ended

    # -- vLLM's calls ------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """P computes its prompts itself: nothing comes from outside. (Asking creates the leg.)"""
        self._leg(request)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        leg = self.legs.get(request.request_id)
        if leg is not None and leg.state is _P.PREFILLING:
            self.timeline.mark(leg.key, "p_scheduled")

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM ends the request: its blocks stay ours (True) while the writer or lender has them."""
        leg = self.legs.get(request.request_id)
        if leg is None:
            return False, None
        tid, status = leg.key, str(getattr(request, "status", ""))
        self._stop_following(leg)  # ended: nothing left to follow
        # vLLM 0.24 passes every block of the request, later versions those of computed tokens:
        # the prompt's KV is in the first blocks either way.
        block_ids = block_ids[:self.block_count(len(request.prompt_token_ids))]
        finished = "ABORTED" not in status and "ERROR" not in status and bool(block_ids)
        if leg.state is _P.HANDED_OFF:  # handed over when its last forward ended; the writer has them
            if tuple(block_ids) != leg.block_ids and finished:
                self.unexpected["early_blocks_differ"] += 1
                self.counts["connector_bugs"] += 1
                log.error("request %s: handed over blocks %s, vLLM ends it with %s (a bug)",
                          request.request_id, leg.block_ids, block_ids)
            if not finished:
                self._step.abort.append(Abort(tid, f"prefill request ended: {status}"))
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
                self._step.kv_ready.append(HandOff(tid, request.request_id, leg.block_ids))
                return True, None  # the writer frees them; we hear of it in finished_sending
            offer, frame = self.offers.offer(tid, leg.block_ids)
            self._step.lend.append(OfferMade(tid, request.request_id, offer))
            answer = leg_params.prefill_answer(base64.b64encode(frame).decode())
            if leg.params.answers_decode:  # no router to write D's params: they are this answer
                request_tid = leg.params.transfer_id
                answer = leg_params.pull_decode(self.signer, leg_params.format_transfer_id(request_tid.request, request_tid.attempt), [answer])
            self.offered[tid] = answer
            return True, answer
        if finished:
            log.warning("request %s: no pull offer possible before the workers' handshake", request.request_id)
        self._step.abort.append(Abort(tid, f"prefill request ended: {status}"))
        self._fire(leg, _E.ENDED)
        return False, None

    def build_connector_meta(self, scheduler_output) -> StepMetadata:
        if scheduler_output is not None and self._following:
            self._follow_prefills(scheduler_output)
        return self._take_step(scheduler_output)

    def update_connector_output(self, output) -> None:
        for request_id in output.finished_sending or ():
            leg = self.legs.get(request_id)
            if leg is not None:
                self._fire(leg, _E.SENT)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a request's blocks wait for the writer or lender."""
        return any(leg.state is _P.HANDED_OFF for leg in self.legs.values())

    # -- the early hand-off ------------------------------------------------------------------------------
    def _follow_prefills(self, out) -> None:
        """Push: follows the blocks of each prefill the scheduler runs, and hands them over in the
        step whose forward computes the prompt's last tokens — after that forward (synchronous
        scheduling), or at the next step's start unless that step preempted it (async scheduling,
        where vLLM schedules step N+1 before step N's output, and so before the request's end)."""
        scheduled, preempted = out.num_scheduled_tokens, out.preempted_req_ids or ()
        new = {r.req_id: r for r in out.scheduled_new_reqs}
        cached, index = out.scheduled_cached_reqs, None
        for leg in list(self._following.values()):
            rid = leg.request_id
            if rid in preempted:  # its blocks are gone; what it gets next is not followed here
                self._stop_following(leg)
                # Written from blocks vLLM may reuse now: written again. The last chunk's forward
                # may have streamed the whole prompt by layers (the worker's choice, unseen here).
                if leg.streamed_blocks or (self.stream and leg.state is _P.LAST_CHUNK):
                    leg.streamed_blocks = 0
                    self._step.preempted.append(leg.key)
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
                    resumed = rid in compat.resumed_request_ids(cached)
                    leg.block_ids = tuple(added[0]) if resumed else leg.block_ids + tuple(added[0])
                computed = cached.num_computed_tokens[i]
            if computed + scheduled[rid] < leg.prompt_tokens:
                self._stream_chunk(leg, computed + scheduled[rid])
                continue
            if self.async_scheduling:
                self._fire(leg, _E.LAST_CHUNK)
                if not self._taken(leg.key, rid):  # the writer plans while this forward runs
                    self._step.kv_coming.append(HandOff(leg.key, rid, self._prompt_blocks(leg)))
            else:
                self._hand_off_early(leg, after_forward=True)

    def _stream_chunk(self, leg: Leg, computed_after_step: int) -> None:
        """Streaming: the prompt's blocks this step's forward fills go to the writer once it ends."""
        full = computed_after_step // self.block_size
        if (not self.stream or full <= leg.streamed_blocks or self._taken(leg.key, leg.request_id)
                or self._streamer.setdefault(leg.key, leg.request_id) != leg.request_id):
            return
        leg.streamed_blocks = full
        self._step.chunks_after_forward.append(HandOff(leg.key, leg.request_id, leg.block_ids[:full]))
        self.counts["chunks_streamed"] += 1

    def _prompt_blocks(self, leg: Leg) -> tuple[int, ...]:
        return leg.block_ids[:self.block_count(leg.prompt_tokens)]

    def _stop_following(self, leg: Leg) -> None:
        leg.early = False
        self._following.pop(leg.request_id, None)
        if self._streamer.get(leg.key) == leg.request_id:
            del self._streamer[leg.key]

    def _hand_off_early(self, leg: Leg, after_forward: bool) -> None:
        self._stop_following(leg)
        if self._taken(leg.key, leg.request_id):
            return  # a sibling's KV is sent; this one is freed at its end
        leg.block_ids = self._prompt_blocks(leg)
        self.owner[leg.key] = leg.request_id
        self._fire(leg, _E.HANDED_OFF)
        self.counts["early_hand_offs"] += 1
        ready = HandOff(leg.key, leg.request_id, leg.block_ids)
        if after_forward:  # the worker marks p_kv_ready when that forward is done
            self._step.kv_ready_after_forward.append(ready)
        else:
            self._step.kv_ready.append(ready)
            self.timeline.mark(leg.key, "p_kv_ready")


class PrefillWorker(WorkerSide):
    role = "prefill"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._after_forward: list[HandOff] = []  # this step's hand-offs, for after its forward
        self._chunks_after_forward: list[HandOff] = []  # this step's streamed chunks, the same
        self._layer_groups: LayerGroups | None = None  # streaming by layers (register_kv_caches)

    def _join(self, layer_names: list[str], regions: tuple[Region, ...]) -> tuple[int, ...] | None:
        """Picks how this rank streams (``Config.stream``, as the platform allows) and, streaming by
        layers, builds the groups: then a write's descriptors join across regions of one group
        only, since each group's part is posted once its layers ran."""
        stream = self.platform.stream_mode(self.config.stream, self.layer_hook_once)
        log.info("neuron-disagg prefill rank %d streams push writes by %s", self.tp_rank, stream)
        if stream != "layers":
            return None
        self._layer_groups = layer_groups(layer_names, regions, self.config.stream_layer_groups)
        return self._layer_groups.group_of_region

    def hand_off(self, step: StepMetadata) -> None:
        """Before the step's forward (``bind_connector_metadata``): queue puts only."""
        if self._after_forward or self._chunks_after_forward or self.layers_in_forward:  # the last forward ended without after_forward (never seen)
            self.after_forward()
        # One fence per step, recorded on the engine thread (never waited on here): the writer waits
        # on it before reading finished KV.
        self._to_writer(step.kv_ready, self.platform.wait_for_kv() if step.kv_ready else None)
        self._after_forward = step.kv_ready_after_forward
        for tid in step.preempted:  # before this step's forward reuses any of their blocks
            self.rank.push.preempted(tid)
        if self._layer_groups is None:
            self._chunks_after_forward = step.chunks_after_forward
        else:
            self._stream_layers(step)
        for r in (*step.kv_coming, *self._after_forward):  # this forward computes their last tokens:
            self.rank.push.kv_coming(r.transfer_id, r.block_ids)  # the writer plans their writes meanwhile
        for lend in step.lend:  # our own scheduler's offer: no need to verify it
            self._track(lend.transfer_id, lend.request_id)
            if self.rank.staging:  # D's read fails (it needs registered KV); the blocks go back now
                self._ended(lend.transfer_id)
                continue
            self.rank.pull.lend(lend.offer)
        for abort in step.abort:
            self.rank.push.abort(abort.transfer_id, abort.reason)
            self.rank.pull.abort(abort.transfer_id, abort.reason)

    def _stream_layers(self, step: StepMetadata) -> None:
        """The blocks this forward completes go to the writer before it runs, each group of layers
        posted once the forward wrote it (``save_kv_layer``). Of a prompt this forward ends, all
        but the last block: the last write carries that block and the notification, so that, as
        ever, the notification rides a NIXL write to every D rank it concerns, after every byte."""
        last = {r.transfer_id for r in (*step.kv_coming, *step.kv_ready_after_forward)}
        handed: dict[TransferId, tuple[int, ...]] = {}
        for c in (*step.chunks_after_forward, *step.kv_coming, *step.kv_ready_after_forward):
            blocks = c.block_ids[:-1] if c.transfer_id in last else c.block_ids
            if blocks:  # one chunk a transfer: siblings ending in one forward share their KV
                handed.setdefault(c.transfer_id, blocks)
        if not handed:
            return
        g = self._layer_groups
        assert g is not None  # streaming by layers
        self.layers_in_forward = LayerFences(g.group_of_layer, g.group_of_region, g.groups,
                                             self.platform.wait_for_kv, self.rank.push.layers_fenced)
        for tid, blocks in handed.items():
            self.rank.push.kv_chunk(tid, blocks, self.layers_in_forward)

    def after_forward(self) -> None:
        """After the step's forward (``wait_for_save``): prefills that forward completed go to the
        writer now, not a step later, with a fence recorded behind the forward."""
        ready, self._after_forward = self._after_forward, []
        chunks, self._chunks_after_forward = self._chunks_after_forward, []
        layers, self.layers_in_forward = self.layers_in_forward, None
        if ready or chunks or layers:
            fence = self.platform.wait_for_kv()  # one for the step: everything below was computed in it
            if layers is not None:
                hooked = layers.finish(fence)
                self._totals["layer_groups_hooked"] += hooked
                self._totals["layer_groups_at_step_end"] += layers.groups - hooked
            for c in chunks:
                self.rank.push.kv_chunk(c.transfer_id, c.block_ids, fence)
            if ready:
                self._to_writer(ready, fence, time.time())

    def _to_writer(self, ready: list[HandOff], fence, ready_at: float | None = None) -> None:
        # The puts wake the writer last: once it runs, anything here that waits (a lock, a file
        # write) may give it the GIL, and the engine loop waits out the writer's turn. For the same
        # reason the writer, not the engine loop, writes the timeline's p_kv_ready (at ready_at).
        for r in ready:
            self._track(r.transfer_id, r.request_id)
        for r in ready:
            self.rank.push.kv_ready(r.transfer_id, r.block_ids, fence, ready_at)

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, -, -): requests whose blocks the threads released, once vLLM listed
        them finished on this worker (it accepts no other). Raises ``TransferThreadDied`` if a
        transfer thread died: the engine stops rather than hang every request it held."""
        self.rank.check()
        self._take_results()
        if finished_req_ids:  # most steps finish nothing: skip the scan on the engine loop
            for record in self._transfers.values():
                if record.request_id in finished_req_ids:
                    record.finished_by_vllm = True
        if not self._unreported:
            return set(), set(), set()
        sent = [tid for tid in self._unreported if self._transfers[tid].finished_by_vllm]
        self._unreported = [tid for tid in self._unreported if not self._transfers[tid].finished_by_vllm]
        return {self._transfers.pop(tid).request_id for tid in sent}, set(), set()
