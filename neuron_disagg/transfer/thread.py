"""The life of every transfer thread (push writer, push receiver, pull reader, pull lender).

Other threads only put items in the inbox (``inbox.py``). The thread takes items (waiting briefly
when transfers are in flight, a tick while any transfer is live, and when none is, until the next
item — or, for a thread whose agent peers write into or read from, ``idle_progress_s``: a peer may
still be connecting to it, and LIBFABRIC moves only while the target's side is polled), hands each
to the handler its subclass registered
for its type, drives I/O progress with ``_poll``, and ticks its protocol core every
``tick_interval_s`` so deadlines fire. The core's actions are performed in order by the performer
registered for each action type; what a performer must report back to the core (a write that
completed at once, a copy that finished) waits until every action of the current batch is done, so
the core is never re-entered halfway through its own actions. ``shutdown`` stops the thread after
``_on_stop`` has ended what is in flight, joins within a bound, and re-raises (once) any error that
killed the thread. An engine must learn that its transfer thread is gone well before shutdown: every
transfer the thread held would wait forever, holding its blocks, with no request failing. So the
engine loop calls ``check`` each step, which raises ``TransferThreadDied`` once the thread died — or
is stuck: nothing it does takes seconds (handshakes run on the peers executor), so one call lasting
``stuck_after_s`` is a hang inside it (a driver, NIXL), and while it lasts no deadline of its
transfers can fire. The error says where the thread is.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any, Generic, TypeVar
from collections.abc import Callable, Iterable

from ..protocol.actions import Action, ProbePeer, SendMessage, Transitioned
from ..protocol.machine import StateMachine
from ..timeline import OFF, Timeline
from .inbox import ProbeEnded
from .peers import Peers

log = logging.getLogger(__name__)
_STOP = object()


class TransferThreadDied(RuntimeError):
    """A transfer thread ended on an error; raised on the engine loop, so the instance stops loudly."""


#: the protocol core a thread drives (ProducerCore, ConsumerCore, LenderCore, ReaderCore)
CoreT = TypeVar("CoreT", bound=StateMachine[Any, Any, Any, Any])
ThreadT = TypeVar("ThreadT", bound="TransferThread[Any]")


class TransferThread(Generic[CoreT]):
    timeline: Timeline = OFF  # set before start() to record per-transfer timestamps
    core: CoreT               # the subclass's protocol core
    idle_progress_s: float | None = None  # with nothing live: None sleeps until an inbox item
    stuck_after_s: float = 60.0  # one turn of the loop taking longer is a hang (check())
    def __init__(self, name: str, peers: Peers, tick_interval_s: float = 0.05,
                 poll_interval_s: float = 0.0005):
        self.peers = peers
        self.tick_interval_s, self.poll_interval_s = tick_interval_s, poll_interval_s
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()  # inbox items, and _STOP
        self._later: deque[Callable[[], list[Action]]] = deque()  # core calls waiting for the batch in hand
        self._handlers: dict[type, Callable[[Any, float], None]] = {}    # inbox item type -> handler
        self._performers: dict[type, Callable[[Any], None]] = {         # action type -> performer
            SendMessage: lambda a: self.peers.send(a.peer, a.ranks, a.message),
            Transitioned: self._log_transition,
        }
        self._error: BaseException | None = None  # for shutdown() to re-raise once
        self._died: BaseException | None = None   # for check(), every step until the engine stops
        self._working_since: float | None = None  # monotonic start of the turn in hand; None waiting
        self._seen_in_turn: tuple[float | None, float, float] = (None, 0.0, 0.0)  # check(): turn, first, last
        self.cpu_seconds = 0.0  # the thread's CPU time, as of the end of its last turn (for metrics)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- any thread ---------------------------------------------------------------------------------
    def start(self: ThreadT) -> ThreadT:
        self._thread.start()
        return self

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)
        self.peers.shutdown()
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name} did not stop within {timeout_s} s")
        error, self._error = self._error, None  # report it once
        if error is not None:
            raise RuntimeError(f"{self._thread.name} failed") from error

    def check(self) -> None:
        """The engine loop, each step: raises ``TransferThreadDied`` if this thread died or is stuck
        (two attribute reads otherwise)."""
        if self._died is not None:
            raise TransferThreadDied(
                f"{self._thread.name} died ({type(self._died).__name__}: {self._died}); the transfers it "
                "held can never end, so this instance stops: restart it") from self._died
        since = self._working_since
        if since is None:
            return
        # Stuck means seen in one turn by steps at most a quarter of stuck_after_s apart (a long
        # prefill is one step) for stuck_after_s, not merely that long since the turn began: a
        # paused process (SIGSTOP, a host stall) resumes mid-turn, the engine's clock gone on too.
        now, (seen, first, last) = time.monotonic(), self._seen_in_turn
        if seen != since or now - last > self.stuck_after_s / 4:
            self._seen_in_turn = (since, now, now)
            return
        self._seen_in_turn = (since, first, now)
        if now - first > self.stuck_after_s:
            ident = self._thread.ident
            frame = sys._current_frames().get(ident) if ident is not None else None
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(its stack is gone)\n"
            raise TransferThreadDied(
                f"{self._thread.name} has been stuck for {now - first:.0f} s in one call, and "
                "no deadline of its transfers can fire meanwhile, so this instance stops: restart it. "
                f"The thread is at:\n{where}")

    # -- the thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            next_tick = 0.0
            while True:
                self._working_since = None
                self.cpu_seconds = time.thread_time()
                try:
                    item = self._inbox.get(timeout=self.poll_interval_s if self._busy() else
                                           self.tick_interval_s if self.core.has_live() else self.idle_progress_s)
                    self._working_since = time.monotonic()
                    while True:
                        if item is _STOP:
                            return self._on_stop()
                        self._handlers[type(item)](item, time.time())
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    self._working_since = time.monotonic()
                self._poll()
                now = time.time()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + self.tick_interval_s
        except BaseException as exc:  # kept for check() and shutdown()
            self._error = self._died = exc
            log.exception("%s died", self._thread.name)
        finally:  # the last turn may have taken the stop with the work before it
            self.cpu_seconds = time.thread_time()

    def _perform(self, actions: Iterable[Action]) -> None:
        """Performs the core's actions in order, then the core calls performers deferred (``_then``),
        each with its own actions, until none is left."""
        pending = deque(actions)
        while pending or self._later:
            if not pending:
                pending.extend(self._later.popleft()())
                continue
            action = pending.popleft()
            performer = self._performers.get(type(action))
            if performer is None:
                raise TypeError(f"{self._thread.name} cannot perform {action!r}")
            performer(action)

    def _then(self, core_call: Callable[[], list[Action]]) -> None:
        """From a performer: call the core once the actions in hand are performed."""
        self._later.append(core_call)

    def _log_transition(self, action: Transitioned) -> None:
        log.debug("transfer %s %s -> %s on %s%s", action.transfer_id, action.before, action.after,
                  action.event, f" ({action.reason})" if action.reason else "")

    # -- D's threads: probing the P ranks their transfers wait on ----------------------------------------
    def _watches_peers(self) -> None:
        """For a thread whose core watches its peers (``protocol/liveness.py``)."""
        self._performers[ProbePeer] = self._probe
        self._handlers[ProbeEnded] = self._probe_ended

    def _probe(self, action: ProbePeer) -> None:
        self.peers.probe(action.peer, action.rank, lambda incarnation, refused: self._inbox.put(
            ProbeEnded(action.peer, action.rank, incarnation, refused)))

    def _probe_ended(self, item: ProbeEnded, now: float) -> None:
        if item.incarnation is not None:
            self._perform(self.core.probe_answered(item.peer, item.rank, item.incarnation, now))
        else:
            self._perform(self.core.probe_failed(item.peer, item.rank, item.refused, now))

    # -- for subclasses ---------------------------------------------------------------------------------
    def _busy(self) -> bool:
        """True while transfers are in flight: poll often."""
        return False

    def _poll(self) -> None:
        pass

    def _tick(self, now: float) -> None:
        pass

    def _on_stop(self) -> None:
        pass
