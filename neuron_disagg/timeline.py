"""Per-transfer timestamps, and the breakdown of a request's time to first token built from them.

Off by default. With ``timeline_dir`` set (config for the connector, ``--timeline-dir`` for the
router) every process appends ``[transfer_id, event, unix_time]`` lines to its own file there; the
demo and ``neuron-disagg bench`` read the directory back and split each request's TTFT into the
segments below. Wall-clock times from several processes are comparable on one machine; across
machines they are as good as the hosts' clock sync.

Who marks what (``EVENTS``): the router marks arrival, P's answer and D's first byte (in every
mode, so vLLM's own connectors get the coarse split of ``p_and_after``); each instance's scheduler
marks what the engine loop sees; each transfer thread marks what happens on the wire.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import IO

import msgspec

from .protocol.messages import TransferId

log = logging.getLogger(__name__)
EVENTS = {
    "router_arrived": "the router received the client's request",
    "router_d_bound": "the router chose D and sent its leg (push: at arrival, or at the binding horizon)",
    "router_p_predicted": "when the router predicted P would answer (push with a binding horizon, P's pace measured)",
    "router_p_answered": "the router had P's whole answer (its prefill done; every mode, vLLM's connectors too)",
    "p_arrived": "P's API server created the request (vLLM's arrival_time)",
    "p_scheduled": "P's scheduler allocated its blocks: prefill starts",
    "p_kv_ready": "P's KV is computed: its worker after the forward, or its scheduler at the request's end",
    "p_registration": "P's writer received D's registration",
    "p_chunk_posted": "P's writer started posting the first WRITE of finished chunks (streaming)",
    "p_write_posted": "P's writer started posting the last WRITE (the one D is notified of)",
    "p_write_done": "P's writer saw the WRITE complete",
    "d_arrived": "D's API server created the request",
    "d_allocated": "D's scheduler allocated the destination blocks",
    "d_read_posted": "D's reader started posting the READ (pull)",
    "d_read_done": "D's reader saw the READ complete (pull)",
    "d_notified": "D's receiver got P's WriteDone (push)",
    "d_loaded": "D's scheduler saw the KV loaded",
    "d_scheduled": "D's scheduler scheduled the loaded request: its first step starts",
    "router_first_byte": "the router had D's first byte",
}
# A P with TP > 1 marks once per rank: the transfer is as early as its first arrival and as late
# as its last rank.
_EARLIEST = {"router_arrived", "p_arrived", "p_scheduled", "p_kv_ready", "d_arrived", "d_allocated",
             "p_registration", "p_chunk_posted"}


class Timeline:
    """Appends events to ``<directory>/<name>-<pid>.jsonl``; does nothing when ``directory`` is None.
    Any thread may mark; one line per event, written whole under a lock."""

    def __init__(self, directory: str | os.PathLike | None, name: str):
        self.directory = Path(directory) if directory else None
        self.name = name
        self._file: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._encode = msgspec.json.Encoder().encode

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def mark(self, transfer_id: TransferId | str, event: str, at: float | None = None) -> None:
        """Marks the router's transfer id (one prompt's transfer is its request's: the timeline is
        per request). Never raises: a timeline that cannot be written (a full disk, a removed
        directory) turns itself off with one warning, since the transfer threads and the engine
        loop mark it."""
        if self.directory is None:
            return
        if isinstance(transfer_id, TransferId):
            transfer_id = transfer_id.router_attempt()
        line = self._encode([str(transfer_id), event, time.time() if at is None else at]) + b"\n"
        with self._lock:
            try:
                if self._file is None:
                    self.directory.mkdir(parents=True, exist_ok=True)
                    self._file = open(self.directory / f"{self.name}-{os.getpid()}.jsonl", "ab", buffering=0)
                self._file.write(line)
            except OSError as exc:
                log.warning("timeline %s off: cannot write to %s (%s)", self.name, self.directory, exc)
                self.directory = None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


OFF = Timeline(None, "off")


def load(directory: str | os.PathLike) -> dict[str, dict[str, float]]:
    """Every transfer's events from every file in ``directory``, per router transfer id (a request
    of several prompts is one); unreadable lines are skipped."""
    decode = msgspec.json.Decoder(tuple[str, str, float]).decode
    transfers: dict[str, dict[str, float]] = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        for raw in path.read_bytes().splitlines():
            try:
                tid, event, at = decode(raw)
            except msgspec.DecodeError:
                continue  # a line cut short by a killed process
            events = transfers.setdefault(tid, {})
            seen = events.get(event)
            if seen is None or (at < seen if event in _EARLIEST else at > seen):
                events[event] = at
    return transfers


def p_and_after(events: dict[str, float]) -> dict[str, float] | None:
    """The router's split of one request's TTFT (seconds), in any mode: ``until_p_answered`` (the
    router, P's queue and its prefill: alike in every mode, and where a busy P's queueing shows) and
    ``after_p_answered`` (what getting the KV to D and D's first step add). In push modes D may hold
    the KV before the router has P's answer: then the second is 0 or less."""
    try:
        start, answered, end = events["router_arrived"], events["router_p_answered"], events["router_first_byte"]
    except KeyError:
        return None
    return {"until_p_answered": answered - start, "after_p_answered": end - answered}


def prediction_error(events: dict[str, float]) -> float | None:
    """P's predicted answer minus its real one (seconds; negative: P answered later than predicted)."""
    try:
        return events["router_p_predicted"] - events["router_p_answered"]
    except KeyError:
        return None


PUSH_SEGMENTS = ("router", "queue", "prefill", "registration_wait", "to_writer", "write", "notify",
                 "to_d_step", "first_token")
PULL_SEGMENTS = ("router", "queue", "prefill", "handoff", "read", "notify", "to_d_step", "first_token")


def breakdown(events: dict[str, float]) -> dict[str, float] | None:
    """One transfer's TTFT split into consecutive segments (seconds), with ``ttft`` their sum; None
    when an event it needs is missing (a failed or unfinished request, or timeline off somewhere).

    push: router -> P queue -> prefill -> waiting for D's registration (0 when it came first) ->
    the next engine step handing the blocks to the writer, and posting -> the write on the wire ->
    until D's engine sees it -> until D's engine schedules it (``to_d_step``: vLLM's own loop, which
    sleeps 1 ms after a step that computed nothing) -> D's first step and the answer's way back.
    pull: the same to prefill; then P's answer through the router to D's allocation (handoff) ->
    read -> until D's engine sees it -> until it schedules it -> first step."""
    e = events
    try:
        start, end = e["router_arrived"], e["router_first_byte"]
        head = {"router": e["p_arrived"] - start, "queue": e["p_scheduled"] - e["p_arrived"],
                "prefill": e["p_kv_ready"] - e["p_scheduled"]}
        if "p_write_posted" in e:
            # The write ends when D holds P's notification: P's own poll may see it complete later.
            write_from = max(e["p_kv_ready"], e["p_registration"])
            tail = {"registration_wait": write_from - e["p_kv_ready"],
                    "to_writer": e["p_write_posted"] - write_from,
                    "write": e["d_notified"] - e["p_write_posted"],
                    "notify": e["d_loaded"] - e["d_notified"]}
        else:
            tail = {"handoff": e["d_allocated"] - e["p_kv_ready"], "read": e["d_read_done"] - e["d_allocated"],
                    "notify": e["d_loaded"] - e["d_read_done"]}
        segments = {**head, **tail, "to_d_step": e["d_scheduled"] - e["d_loaded"],
                    "first_token": end - e["d_scheduled"]}
    except KeyError:
        return None
    segments["ttft"] = end - start
    return segments
