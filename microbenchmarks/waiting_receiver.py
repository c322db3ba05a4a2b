"""What D's transfer threads cost D's core while registrations wait for P's prefill, and when idle.

In push mode D registers its blocks as soon as it allocated them, so its receiver holds transfers
for the whole of P's prefill (seconds for long prompts) before the first byte moves; pull's reader
holds nothing until P's offer arrived. Two real processes over NIXL (UCX, loopback): a D rank with
``--waiting`` registered transfers whose P holds its KV back for ``--seconds``, then the same D
with nothing to do. Prints D's CPU use in each phase (percent of one core, from /proc), then
delivers the KV and reports registration-to-loaded latency, so a lazier receiver cannot hide a
slower one. Run: .venv/bin/python microbenchmarks/waiting_receiver.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from neuron_disagg.testing.peer_process import PeerProcess

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system time of every thread of the process so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def busy_percent(pid: int, seconds: float) -> float:
    start, began = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return 100 * (cpu_seconds(pid) - start) / (time.monotonic() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, default=4, help="registrations waiting for P at once")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each measured phase")
    args = parser.parse_args()
    d = PeerProcess("decode", "--watchdog-s", "120", "--lease-s", "60")
    p = PeerProcess("prefill", "--lease-s", "120", "--watchdog-s", "120")
    try:
        idle = busy_percent(d.proc.pid, args.seconds)
        tids = [[f"wait-{i}", 0] for i in range(args.waiting)]
        for i, tid in enumerate(tids):
            p.call("fill", blocks=[1 + i], seed=i)
            d.call("expect", tid=tid, p_address=p.address)
            d.call("allocate", tid=tid, blocks=[1 + i])
        time.sleep(1.0)  # registrations reach P; the handshake is done
        waiting = busy_percent(d.proc.pid, args.seconds)
        started = time.monotonic()
        for i, tid in enumerate(tids):
            p.call("kv_ready", tid=tid, blocks=[1 + i])
        loaded = [d.event_for("loaded", tid, timeout=30) for tid in tids]
        took = (time.monotonic() - started) * 1e3
    finally:
        p.stop()
        d.stop()
    print(f"D's process, percent of one core over {args.seconds:g} s:")
    print(f"  idle (nothing registered):                 {idle:5.1f}%")
    print(f"  {args.waiting} registrations waiting for P's prefill: {waiting:5.1f}%")
    print(f"KV handed over after the wait: all {len(loaded)} loaded within {took:.1f} ms of P's kv_ready "
          f"(median registration-to-loaded {statistics.median(e['ms_since_allocate'] for e in loaded):.0f} ms, "
          "including the wait)")


if __name__ == "__main__":
    main()
