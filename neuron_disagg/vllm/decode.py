"""The decode instance (vLLM's ``kv_consumer``): its leg table, its scheduler side and its worker side.

Scheduler side (engine-core process): tells vLLM that a decode leg's prompt comes from P,
asynchronously; once vLLM allocated the blocks, has the worker register them with P (push) or read
P's offer into them (pull); reports each load, or its failure, for vLLM's ``kv_load_failure_policy``.

Worker side (each worker process): hands the step's work to the rank's receiver and reader (queue
puts only), waits briefly for KV in flight in a step that computes nothing (``landing_wait_s``), and
reports loads — a failed load only once its blocks are fenced (I2).
"""

from __future__ import annotations

import base64
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any

from .. import kv_params as leg_params
from ..protocol.messages import Registration, TransferId
from . import compat
from .failures import router_transfer_id
from .scheduler_side import END, Leg, LegEvent, SchedulerSide
from .metadata import Abort, AllocatedBlocks, Expect, QuarantineNotices, ReadOffer, StepMetadata
from .worker import TransferRecord, TransferState, WorkerSide

log = logging.getLogger(__name__)


class DecodeState(enum.Enum):
    NEW = "new"                                # created by vLLM's first question, answered at once
    WAITING_FOR_BLOCKS = "waiting_for_blocks"  # the worker expects the transfer (push: heartbeats P)
    FOLLOWING = "following"                    # a sibling loads this prompt's KV; then reuse it
    LOADING = "loading"                        # blocks registered with P (push) or being read (pull)
    ABORTING = "aborting"                      # ended while loading; the worker fences the blocks
    LOADED = "loaded"                          # KV arrived; decoding
    FAILED = "failed"                          # no KV; vLLM's kv_load_failure_policy applies


_D, _E = DecodeState, LegEvent
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


@dataclass
class _Quarantine:
    """A failed load's blocks, kept out of vLLM's pool (one reference of ours on each) until every
    worker that holds them in quarantine released them."""

    blocks: list[Any]  # vLLM's KVCacheBlock objects
    since: float       # monotonic
    held: int = 0      # workers that said the blocks wait for their fence
    released: int = 0  # of those, the ones that said they no longer do


class DecodeScheduler(SchedulerSide):
    role, TABLE, HOLDING = "decode", DECODE_TABLE, frozenset({_D.LOADING, _D.ABORTING})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.block_pool: Any = None  # vLLM's, bound at start-up (bind_gpu_block_pool)
        self.notes: dict[str, _Quarantine] = {}        # request -> what workers said, until its load ends
        self.quarantine: dict[str, _Quarantine] = {}   # request -> the blocks we keep from vLLM's pool
        self._quarantine_changed = False

    def _new_leg(self, request, parsed: leg_params.LegParams, key: TransferId) -> Leg:
        sibling = self.owner.get(key) in self.legs or key in self.ended  # has, is getting or got its KV
        leg = Leg(request.request_id, parsed, key, _D.FOLLOWING if sibling else _D.NEW,
                  prompt_tokens=len(request.prompt_token_ids))
        if not sibling:
            self.owner[key] = request.request_id
        return leg

    def _busy(self, request_id: str | None) -> bool:
        """That leg is still getting its KV (a sibling must wait for it)."""
        leg = self.legs.get(request_id) if request_id is not None else None
        return leg is not None and leg.state in (_D.NEW, _D.WAITING_FOR_BLOCKS, _D.LOADING)

    # -- vLLM's calls ------------------------------------------------------------------------------------
    def may_load_async(self, request) -> bool:
        """vLLM 0.34+, as it queues a waiting request: whether it may start loading while the running
        batch is full (``--max-num-inflight-kv-loads``). Ours are asynchronous loads."""
        leg = self._leg(request)
        return leg is not None and leg.state in (_D.NEW, _D.WAITING_FOR_BLOCKS)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The whole prompt beyond our local prefix hit comes from P, asynchronously. A sibling of a
        request that loads the same prompt waits (None: ask again next step), then computes from the
        local prefix cache the loaded KV filled."""
        leg = self._leg(request)
        if leg is not None and leg.state is _D.FOLLOWING:
            if self._busy(self.owner.get(leg.key)):
                return None, False
            self._fire(leg, _E.OWNER_DONE)
            return 0, False
        if leg is None or leg.state not in (_D.NEW, _D.WAITING_FOR_BLOCKS):
            return 0, False  # not ours, or loaded (a preempted request) or failed: compute locally
        if leg.state is _D.NEW:
            self._fire(leg, _E.ASKED)
            if leg.params.mode == "push":  # the worker heartbeats P from now on
                self._step.expect.append(Expect(leg.key, leg.params.p_side_channel, leg.params.p_tp_size))
        leg.local_hit_tokens = num_computed_tokens
        return len(request.prompt_token_ids) - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: the fresh ones are registered with P (push) or read
        into (pull) by the worker, in the next step."""
        leg = self.legs.get(request.request_id)
        if leg is None or num_external_tokens == 0 or leg.state is not _D.WAITING_FOR_BLOCKS:
            return
        first = leg.local_hit_tokens // self.block_size
        prompt_blocks = self.block_count(len(request.prompt_token_ids))
        block_ids = tuple(blocks.get_block_ids()[0][first:prompt_blocks])
        allocated = AllocatedBlocks(leg.key, request.request_id, block_ids, first)
        leg.block_ids = block_ids
        leg.kv_blocks = list(compat.kv_cache_blocks(blocks)[first:prompt_blocks])
        leg.request = request
        if leg.params.mode == "push":
            self._step.register.append(allocated)
        else:  # the worker picks the offer for this prompt's transfer
            self._step.read.append(ReadOffer(allocated, tuple(base64.b64decode(o) for o in leg.params.offers)))
        self._fire(leg, _E.ALLOCATED)
        self.timeline.mark(leg.key, "d_allocated")

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM ends the request. While loading, vLLM holds its blocks until our worker reports it
        finished receiving, which it does only once P confirmed or the fence passed (I2)."""
        leg = self.legs.get(request.request_id)
        if leg is None:
            return False, None
        if leg.state is _D.LOADING:
            self._step.abort.append(Abort(leg.key, "decode request aborted"))
        elif leg.state is _D.WAITING_FOR_BLOCKS:
            self._step.abort.append(Abort(leg.key, "decode request aborted before it had blocks"))
        self._fire(leg, _E.ENDED)
        return False, None

    def build_connector_meta(self, scheduler_output) -> StepMetadata:
        if scheduler_output is not None and self.timeline.enabled:
            self._mark_first_steps(scheduler_output.num_scheduled_tokens)
        return self._take_step(scheduler_output)

    def update_connector_output(self, output) -> None:
        """Before vLLM acts on the step's loads. A failed load whose blocks a worker still holds in
        quarantine (P gone: the request goes on now) keeps them from vLLM's pool: vLLM frees the
        request's blocks and computes it in fresh ones (``compat.restart_failed_load``), while ours
        wait, with one reference of ours each, until every worker released them."""
        notices = compat.worker_meta(output)
        if notices is not None:
            self._note(notices)
        failed = compat.failed_loads(output, {leg.request_id: leg.block_ids for leg in self.legs.values()
                                              if leg.state is _D.LOADING})
        for request_id in output.finished_recving or ():
            leg = self.legs.get(request_id)
            note = self.notes.pop(request_id, None)
            if leg is None:
                continue
            if note is not None and note.held > note.released and leg.kv_blocks:
                # Whether vLLM goes on computing the request or, under the fail policy, ended it already.
                self._hold(leg, note)
            self._fire(leg, _E.LOAD_FAILED if request_id in failed else _E.LOADED)
            if leg.state is _D.LOADED:
                self.timeline.mark(leg.key, "d_loaded")
                leg.awaiting_first_step = self.timeline.enabled

    def bind_block_pool(self, block_pool: Any) -> None:
        self.block_pool = block_pool

    def _note(self, notices) -> None:
        for request_id in notices.held:
            self.notes.setdefault(request_id, _Quarantine([], time.monotonic())).held += 1
        for request_id in notices.released:
            held = self.quarantine.get(request_id) or self.notes.get(request_id)
            if held is None:
                continue
            held.released += 1
            if request_id in self.quarantine and held.released >= held.held:
                self._release(request_id)

    def _hold(self, leg: Leg, note: _Quarantine) -> None:
        for block in leg.kv_blocks:
            block.ref_cnt += 1  # vLLM's free of the request leaves these out of its free queue
        note.blocks = leg.kv_blocks
        self.quarantine[leg.request_id] = note
        self._quarantine_changed = True
        self.counts["blocks_quarantined"] += len(note.blocks)
        if leg.state is _D.LOADING and leg.request is not None:
            compat.restart_failed_load(leg.request)

    def _release(self, request_id: str) -> None:
        held = self.quarantine.pop(request_id)
        self.block_pool.free_blocks(held.blocks)
        self._quarantine_changed = True
        self.counts["quarantined_block_seconds"] += len(held.blocks) * (time.monotonic() - held.since)

    def has_pending_push_work(self) -> bool:
        """D owes no writes, but while it keeps blocks in quarantine the engine must keep stepping:
        the workers' word that frees them comes only with a step's output."""
        return bool(self.quarantine)

    def stats(self) -> dict[str, Any] | None:
        out = super().stats() or {}
        if self._quarantine_changed:
            self._quarantine_changed = False
            out["quarantined_blocks"] = sum(len(q.blocks) for q in self.quarantine.values())
        return out or None

    def _mark_first_steps(self, scheduled: dict[str, int]) -> None:
        """Timeline on: loaded requests this step schedules. From their ``d_loaded`` to here is vLLM's
        own engine loop (after a step that computed nothing it sleeps 1 ms), which the bench shows
        apart from D's first step."""
        for request_id in scheduled:
            leg = self.legs.get(request_id)
            if leg is not None and leg.awaiting_first_step:
                leg.awaiting_first_step = False
                self.timeline.mark(leg.key, "d_scheduled")


PULL_NEEDS_REGISTERED_KV = "pull reads device memory directly, and this instance stages KV through host memory"


class DecodeWorker(WorkerSide):
    role = "decode"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._no_forward = False   # the step in hand runs no forward (StepMetadata.no_forward)
        self._reported = False     # the last transfer_results reported something
        self._told_reasons: dict[str, str] = {}  # policy fail: router transfer id -> why
        self._notices = QuarantineNotices()  # for the scheduler side, with the next step's output

    def hand_off(self, step: StepMetadata) -> None:
        """Before the step's forward (``bind_connector_metadata``): queue puts only."""
        self._no_forward = step.no_forward
        rank = self.rank
        # One fence per step, recorded on the engine thread (never waited on here): nothing lands in
        # freshly allocated blocks before the engine's own work on them (zeroing) is done.
        fence = self.platform.wait_for_kv() if (step.register or step.read) else None
        for expected in step.expect:
            rank.push.expect(expected.transfer_id, expected.p_side_channel, expected.p_tp_size)
        for alloc in step.register:
            self._track(alloc.transfer_id, alloc.request_id, alloc.block_ids)
            rank.push.allocated(Registration(
                alloc.transfer_id, self.engine_id, alloc.request_id, self.address, self.tp_size,
                (self.rank_regions,), alloc.block_ids, alloc.first_block_index, 0.0), fence)
        for read in step.read:
            alloc = read.allocated
            self._track(alloc.transfer_id, alloc.request_id, alloc.block_ids)
            if rank.staging:
                record = self._transfers[alloc.transfer_id]
                self._failed(alloc.transfer_id, record, f"{PULL_NEEDS_REGISTERED_KV}; use push")
                record.released_blocks = alloc.block_ids
                self._ended(alloc.transfer_id)
                continue
            rank.pull.offered(alloc.transfer_id, read.offers)  # verified on the reader thread
            rank.pull.allocated(alloc.transfer_id, self.rank_regions, alloc.block_ids, alloc.first_block_index,
                                fence)
        for abort in step.abort:
            rank.push.abort(abort.transfer_id, abort.reason)
            rank.pull.abort(abort.transfer_id, abort.reason)

    def wait_for_landing(self) -> None:
        """Before ``transfer_results`` in a step that runs no forward: while a write or read into our
        blocks is in flight, wait up to ``landing_wait_s`` for it to land, so that this step reports
        it rather than the next. Without it a CPU D reported a landing 2 ms after it on average (the
        next step began 2.4 ms after the last, 1 ms of it vLLM's sleep); with it, 0.9 ms (measured).
        Not after a step that reported (its requests are being scheduled), and never in a step with a
        forward."""
        wait_s = self.config.landing_wait_s
        if not wait_s or not self._no_forward or self._reported or not self.rank.expecting_a_landing():
            return
        self._take_results()
        if self._unreported:  # already here: nothing to wait for
            return
        started = time.perf_counter()
        deadline = started + wait_s
        while not self._unreported and self.rank.outbox.wait(deadline - time.perf_counter()):
            self._take_results()  # a failure alone ends nothing: its blocks wait for their fence
        if self._unreported:
            self._totals["landings_awaited"] += 1
        # I5: reported beside the per-step series, which it would swamp on an idle D
        self._totals["landing_wait_us"] += int((time.perf_counter() - started) * 1e6)

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(-, finished receiving, failed receiving) since the last call; the failed loads' blocks
        are in ``failed_blocks`` until the next call (vLLM < 0.32 takes those). Raises
        ``TransferThreadDied`` if a transfer thread died: the engine stops rather than hang every
        request whose KV that thread held."""
        self.rank.check()
        self._take_results()
        ended, self._unreported = self._unreported, []
        self._reported = bool(ended)
        if not ended:
            self.failed_blocks = set()
            return set(), set(), set()
        records = [self._report(tid) for tid in ended]
        failed = [r for r in records if r.failure is not None]
        self.failed_blocks = {b for r in failed for b in r.released_blocks}
        return set(), {r.request_id for r in records}, {r.request_id for r in failed}

    def _report(self, tid: TransferId) -> TransferRecord:
        """The record of a transfer vLLM is told of now: forgotten, unless its blocks are quarantined."""
        record = self._transfers[tid]
        if record.state is TransferState.QUARANTINED:
            record.reported = True
            return record
        return self._transfers.pop(tid)

    def _loaded(self, tid: TransferId, record: TransferRecord) -> None:
        self._totals["transfers"] += 1
        self._ended(tid)

    def _failed(self, tid: TransferId, record: TransferRecord, reason: str) -> None:
        """The KV will not come; ``Freed`` follows once the blocks are fenced, and ends the transfer."""
        record.state, record.failure = TransferState.FAILING, reason
        self._totals["transfers_failed"] += 1
        self._failure_reasons[reason.split(":")[0]] += 1
        if not self.recompute:  # the request fails: its client learns why (failures.py)
            self._told_reasons[router_transfer_id(tid)] = reason
        log.warning("request %s (transfer %s) gets no KV: %s", record.request_id, tid, reason)

    def _quarantined(self, tid: TransferId, record: TransferRecord, reason: str) -> None:
        """The request goes on without its KV now: vLLM hears that the load failed in this step, and
        our scheduler side keeps the blocks out of vLLM's pool until this worker releases them."""
        self._failed(tid, record, reason)
        self._totals["quarantines"] += 1
        record.state = TransferState.QUARANTINED
        record.released_blocks = record.block_ids  # vLLM < 0.32 learns of a failed load by its blocks
        self._unreported.append(tid)
        self._notices.held.append(record.request_id)

    def _released(self, tid: TransferId, record: TransferRecord) -> None:
        """The quarantined blocks' fence passed, or P confirmed: no write of P's can land in them now."""
        self._notices.released.append(record.request_id)
        if record.reported:
            del self._transfers[tid]
        else:  # quarantined and released before vLLM heard: report it as a failure, as usual
            record.state = TransferState.ENDED

    def worker_meta(self) -> QuarantineNotices | None:
        """What this step's output tells the scheduler side about quarantined blocks."""
        notices, self._notices = self._notices, QuarantineNotices()
        return notices or None

    def _told(self) -> dict[str, str]:
        told, self._told_reasons = self._told_reasons, {}
        return told
