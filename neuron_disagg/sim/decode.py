"""The decode instance (D): one engine loop that alternates step boundaries and decode steps.

At each step boundary, in this order (vLLM's ``Scheduler.schedule`` promotes finished loads out of
WAITING_FOR_REMOTE_KVS before it admits new requests, whose READs the step then posts):
1. requests whose KV has fully arrived since the last boundary join the running batch (D sees a
   completion only at a step boundary). With ``sched_lag_steps`` = L > 0 a completion that arrives
   while a step runs joins L boundaries later: under vLLM's async scheduling the engine has already
   scheduled the next step when it reads the step output that reports the transfer done
   (``get_finished`` at the end of ``execute_model``; ``EngineCore.step_with_batch_queue``). An idle
   loop has nothing in flight and sees it at once;
2. admit new requests FCFS while KV blocks are free. Push: allocate and send P the registration
   (D's core, ~0.15 ms). Pull: allocate, then build the descriptor list, make the transfer handle and
   post every descriptor — *on this loop*, so the step that follows, and with it every running
   sequence's next token, waits for it;
3. one decode step over the running batch: each sequence makes one token. A joining request's first
   step recomputes its last prompt token and yields its first token.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import simpy

from .errors import CapacityError
from .params import Profile
from .records import Record
from .steptime import decode_step_s, pull_loop_s


class DecodeInstance:
    def __init__(self, env: simpy.Environment, index: int, profile: Profile, *, mode: str,
                 on_admitted: Callable[[Record, float], None]) -> None:
        self.env, self.index, self.profile, self.mode = env, index, profile, mode
        self.on_admitted = on_admitted
        capacity = profile.v("d_blocks")
        self.capacity_blocks = int(capacity) if capacity > 0 else None
        self.free_blocks = self.capacity_blocks
        self.incoming: deque[Record] = deque()
        self.loaded: list[list] = []  # [record, boundaries still to wait]
        self.running: list[list] = []  # [record, context tokens]
        self.context_tokens = 0
        self.assigned = 0  # admitted or waiting, not yet finished: what a router balances on
        self.loop_busy_s = 0.0  # time the loop spent on admission work (pull's posting shows here)
        self.steps = 0
        self._stepping = False  # a decode step is in flight (a completion then waits for the lag)
        self._wake = env.event()
        env.process(self._loop())

    # -- inputs ------------------------------------------------------------------------------
    def arrive(self, record: Record) -> None:
        need = self._blocks(record)
        if self.capacity_blocks is not None and need > self.capacity_blocks:
            raise CapacityError(f"a request of {record.spec.input_len}+{record.spec.output_len} tokens needs "
                                f"{need} KV blocks but D holds {self.capacity_blocks}: raise d_blocks")
        self.incoming.append(record)
        self._poke()

    def kv_loaded(self, record: Record) -> None:
        record.kv_loaded_s = self.env.now
        lag = int(self.profile.v("sched_lag_steps")) if self._stepping else 0
        self.loaded.append([record, lag])
        self._poke()

    # -- the engine loop ---------------------------------------------------------------------
    def _blocks(self, record: Record) -> int:
        return self.profile.geometry.blocks(record.spec.input_len + record.spec.output_len)

    def _poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _can_admit(self) -> bool:
        if not self.incoming:
            return False
        return self.capacity_blocks is None or self._blocks(self.incoming[0]) <= self.free_blocks

    def _admission_s(self, record: Record) -> float:
        if self.mode == "pull":
            return pull_loop_s(self.profile, record.spec.input_len)
        return self.profile.v("d_admit_s")

    def _loop(self):
        env = self.env
        while True:
            if not (self.running or self.loaded or self._can_admit()):
                self._wake = env.event()
                yield self._wake
                continue
            waiting = []
            for entry in self.loaded:
                record, lag = entry
                if lag > 0 and self.running:  # the scheduler reads that step's output one step late
                    entry[1] = lag - 1
                    waiting.append(entry)
                    continue
                self.running.append([record, record.spec.input_len])
                self.context_tokens += record.spec.input_len
            self.loaded = waiting
            work = 0.0
            while self._can_admit():
                record = self.incoming.popleft()
                if self.capacity_blocks is not None:
                    self.free_blocks -= self._blocks(record)
                work += self._admission_s(record)
                self.on_admitted(record, work)
            if work:
                # vLLM posts a step's READs inside that step (start_load_kv in execute_model): a
                # completion arriving meanwhile is reported with that step's output
                self._stepping = bool(self.running)
                self.loop_busy_s += work
                yield env.timeout(work)
            if not self.running:
                continue
            steps, elapsed = self._steps_until_next_event()
            self._stepping = True
            yield env.timeout(elapsed)
            self._stepping = False
            self.steps += steps
            still = []
            for entry in self.running:
                record = entry[0]
                record.tokens_out += steps
                if record.tokens_out == 1:
                    record.first_token_s = env.now
                if record.tokens_out >= record.spec.output_len:
                    self.context_tokens -= entry[1]
                    record.finish(env.now)
                    self.assigned -= 1
                    if self.capacity_blocks is not None:
                        self.free_blocks += self._blocks(record)
                else:
                    entry[1] += steps
                    self.context_tokens += steps
                    still.append(entry)
            self.running = still

    def _steps_until_next_event(self) -> tuple[int, float]:
        """How many decode steps can run back to back, and their total time.

        Why: at low load D runs thousands of steps between two events that concern it; simulating
        each as its own event made the default sweep slow. Steps are fused only while nothing else
        in the simulation is scheduled before they end (``env.peek``: no arrival, no completed
        transfer, no other instance's step), no sequence is about to finish, and none is on its
        first token — so a fused run is exactly the sequence of single steps it replaces.
        """
        n = len(self.running)
        step = decode_step_s(self.profile, n, self.context_tokens)
        if self.loaded or any(entry[0].tokens_out == 0 for entry in self.running):
            return 1, step  # a lagging completion joins after a counted number of single steps
        horizon = self.env.peek() - self.env.now
        limit = min(entry[0].spec.output_len - entry[0].tokens_out for entry in self.running)
        per_token = step - decode_step_s(self.profile, n, self.context_tokens - 1)  # d(step)/d(context)
        steps, elapsed = 1, step
        while steps < limit:
            step += n * per_token  # every running sequence grew by one token
            if elapsed + step > horizon:
                break
            elapsed += step
            steps += 1
        return steps, elapsed
