"""Drive a real P or D rank process (``neuron_disagg.testing.peer``) over its stdin/stdout: what
the integration tests and the transfer benchmark use."""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time

# One secret per driving process, handed to the processes it starts (never a constant in the code).
SECRET = secrets.token_hex(24)


class PeerProcess:
    def __init__(self, role: str, *args: str, env: dict | None = None, prefix: list[str] | tuple[str, ...] = (),
                 python: str = sys.executable):
        """``prefix`` wraps the command (e.g. ``nsenter --net=...`` to run it in a test's network
        namespace); ``env`` adds to this process's environment; ``python``, the interpreter whose
        environment (its NIXL) the peer runs in."""
        self.role = role
        self.proc = subprocess.Popen(
            [*prefix, python, "-m", "neuron_disagg.testing.peer", "--role", role, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "NEURON_DISAGG_SECRET": SECRET, **(env or {})})
        self.replies: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self._cond = threading.Condition()
        self._seq = 0
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        ready = self.wait_event(lambda e: e["event"] == "ready", 60)
        self.address, self.agent = ready["address"], ready["agent"]
        self.backends = ready.get("backends", [])  # what the NIXL agent really loaded
        self.nixl = ready.get("nixl")  # the NIXL version it loaded

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                self.stderr.append(line)
                continue
            if "reply" in msg:
                self.replies.put(msg)
            else:
                with self._cond:
                    self.events.append(msg)
                    self._cond.notify_all()

    def call(self, op: str, timeout: float = 20, **kwargs) -> dict:
        self._seq += 1
        self.proc.stdin.write(json.dumps({"op": op, "seq": self._seq, **kwargs}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.role} did not answer {op}; stderr: {''.join(self.stderr)[-2000:]}") from None
            if reply["reply"] == self._seq:
                return reply

    def wait_event(self, predicate, timeout: float = 20) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.proc.poll() is not None and not self._cond.wait(0.05):
                    raise TimeoutError(f"{self.role}: no matching event in {timeout} s; events "
                                       f"{self.events[-5:]}; stderr: {''.join(self.stderr)[-2000:]}")
                self._cond.wait(remaining)

    def event_for(self, kind: str, tid, timeout: float = 20) -> dict:
        return self.wait_event(lambda e: e["event"] == kind and e["tid"] == list(tid), timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("shutdown", timeout=10)
            except (TimeoutError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
