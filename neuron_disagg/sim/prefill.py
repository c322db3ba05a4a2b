"""The prefill instance (P): an engine loop that runs prompt chunks in steps, a KV block pool whose
blocks a request holds from its first chunk until its KV has left (the lease), and in push mode a
writer thread that plans and posts each write off the engine loop.

Scheduling is FCFS, like vLLM's: each step takes the head of the queue, whole prompts (or chunks of
``chunk_tokens`` when chunking is on) until the step's token budget or request limit is reached.
With a budget of one request and no chunking each prompt is served alone in one step of a fixed
length — the deterministic single server of M/D/1.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import simpy

from .errors import CapacityError
from .params import Profile
from .records import Record
from .steptime import prefill_chunk_s


class _Prompt:
    __slots__ = ("record", "done_tokens", "holds_blocks")

    def __init__(self, record: Record) -> None:
        self.record = record
        self.done_tokens = 0
        self.holds_blocks = False


class PrefillInstance:
    def __init__(self, env: simpy.Environment, index: int, profile: Profile, *,
                 on_kv_ready: Callable[[Record], None], chunk_tokens: int | None = None,
                 max_batch_tokens: int | None = None, max_batch_requests: int | None = None) -> None:
        self.env, self.index, self.profile = env, index, profile
        self.on_kv_ready = on_kv_ready
        self.chunk_tokens = chunk_tokens
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        capacity = profile.v("p_blocks")
        self.capacity_blocks = int(capacity) if capacity > 0 else None
        self.free_blocks = self.capacity_blocks
        self.queue: deque[_Prompt] = deque()
        self.writer = simpy.Resource(env, capacity=1)  # one writer thread per TP worker; ranks run alike
        self.outstanding = 0  # queued or prefilling: what a router balances on
        self.peak_held_blocks = 0  # most blocks held at once (queued prompts' leases included)
        self._stepping = False
        self._releasing: list[list[int]] = []  # [blocks, boundaries still to wait]: freed at a step's end
        self._wake = env.event()
        env.process(self._loop())

    # -- inputs ------------------------------------------------------------------------------
    def submit(self, record: Record) -> None:
        blocks = self.profile.geometry.blocks(record.spec.input_len)
        if self.capacity_blocks is not None and blocks > self.capacity_blocks:
            raise CapacityError(f"a {record.spec.input_len}-token prompt needs {blocks} KV blocks but P holds "
                                f"{self.capacity_blocks}: lower --input-lens or raise p_blocks")
        record.p_index = self.index
        self.queue.append(_Prompt(record))
        self.outstanding += 1
        self._poke()

    def release(self, record: Record) -> None:
        """The lease ends: the KV has left (push: write done; pull: D's read-done notice).

        vLLM's P learns it only from its own engine loop: ``get_finished`` at the end of
        ``execute_model`` (pull: ``_get_new_notifs`` reads D's notification) reports the request in
        ``finished_sending``, and ``Scheduler._update_from_kv_xfer_finished`` frees its blocks — at
        the end of the step in flight, ``sched_lag_steps`` steps later still under async
        scheduling. An idle P polls and frees at once."""
        if self.capacity_blocks is None:
            return
        blocks = self.profile.geometry.blocks(record.spec.input_len)
        if self._stepping:
            self._releasing.append([blocks, int(self.profile.v("sched_lag_steps"))])
        else:
            self.free_blocks += blocks
            self._poke()

    def _step_ended(self) -> None:
        still = []
        for entry in self._releasing:
            if entry[1] > 0:
                entry[1] -= 1
                still.append(entry)
            else:
                self.free_blocks += entry[0]
        self._releasing = still

    # -- the engine loop ---------------------------------------------------------------------
    def _poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _take_blocks(self, prompt: _Prompt) -> bool:
        if prompt.holds_blocks or self.capacity_blocks is None:
            prompt.holds_blocks = True
            return True
        need = self.profile.geometry.blocks(prompt.record.spec.input_len)
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        prompt.holds_blocks = True
        self.peak_held_blocks = max(self.peak_held_blocks, self.capacity_blocks - self.free_blocks)
        return True

    def _form_batch(self) -> list[tuple[_Prompt, int, int]]:
        """(prompt, start, tokens) chunks for this step, FCFS from the head of the queue."""
        batch, budget = [], self.max_batch_tokens
        for prompt in self.queue:
            if self.max_batch_requests is not None and len(batch) >= self.max_batch_requests:
                break
            if budget is not None and budget <= 0:
                break
            if not self._take_blocks(prompt):
                break  # head-of-line: FCFS never lets a later prompt overtake one waiting for blocks
            left = prompt.record.spec.input_len - prompt.done_tokens
            if self.chunk_tokens is None:
                take = left
                if budget is not None and take > budget and batch:
                    break  # without chunking a whole prompt must fit, unless it is alone
            else:
                take = min(left, self.chunk_tokens, budget if budget is not None else left)
            if budget is not None:
                budget -= take
            batch.append((prompt, prompt.done_tokens, take))
        return batch

    def _loop(self):
        env, profile = self.env, self.profile
        while True:
            batch = self._form_batch() if self.queue else []
            if not batch:
                if self._releasing:  # nothing in flight: the idle loop frees what it was told of
                    self.free_blocks += sum(entry[0] for entry in self._releasing)
                    self._releasing = []
                    continue
                self._wake = env.event()
                yield self._wake
                continue
            step = profile.v("prefill_step_base_s")
            for prompt, start, tokens in batch:
                if prompt.record.prefill_start_s is None:
                    prompt.record.prefill_start_s = env.now
                step += prefill_chunk_s(profile, start, tokens)
            finished = [p for p, start, tokens in batch if start + tokens >= p.record.spec.input_len]
            step += len(finished) * profile.v("handoff_s")  # the only transfer work on P's engine loop
            self._stepping = True
            yield env.timeout(step)
            self._stepping = False
            self._step_ended()
            for prompt, start, tokens in batch:
                prompt.done_tokens = start + tokens
            for prompt in finished:
                self.queue.remove(prompt)
                self.outstanding -= 1
                prompt.record.prefill_end_s = env.now
                self.on_kv_ready(prompt.record)
