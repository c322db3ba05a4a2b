"""Does NIXL's Python binding let the engine thread run while a transfer thread is inside a call?

Why it matters: push moves planning and posting onto a writer thread so that P's engine loop never
waits for them, and pull's reader thread does the same on D. That only holds if the NIXL calls the
thread makes release the GIL; if they hold it, the engine thread (same process) stalls for the
whole call — 46 ms for 18,880 descriptors on EFA, per the published figure.

What it does: two NIXL agents in this process (UCX, DRAM), 131,072 non-mergeable 64-byte descriptors
(one per block, layer and K/V of a scattered 16k-token Qwen3-32B request on one TP8 rank;
calibration/measure_costs.py's loopback). A second
thread runs each call below; meanwhile this thread spins, stamping ``perf_counter`` as fast as it
can. The longest gap between two stamps during the call is how long the engine thread was kept
off the interpreter. Reference lines: the same thread sleeping (releases the GIL) and running
pure-Python work (the interpreter hands the GIL over every ``sys.getswitchinterval()``).

    .venv/bin/python microbenchmarks/gil.py [--reps N]

Prints, per call: its duration, and the longest engine-thread stall as a fraction of it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import numpy as np

from calibration.measure_costs import ScatteredLoopback  # run as a script: microbenchmarks/ is on the path

COUNT, DESC_BYTES = 131_072, 64


def stall_during(call) -> tuple[float, float]:
    """(call seconds, longest gap between this thread's stamps while the call ran)."""
    started, finished = threading.Event(), threading.Event()
    span = [0.0, 0.0]

    def run():
        span[0] = time.perf_counter()
        started.set()
        call()
        span[1] = time.perf_counter()
        finished.set()

    worker = threading.Thread(target=run)
    worker.start()
    started.wait()
    longest, previous = 0.0, span[0]
    while not finished.is_set():
        now = time.perf_counter()
        longest, previous = max(longest, now - previous), now
    worker.join()
    return span[1] - span[0], max(longest, span[1] - previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    loop = ScatteredLoopback(COUNT, DESC_BYTES, "gil-initiator", "gil-target")
    a, local, remote = loop.initiator, loop.local, loop.remote
    idx = np.arange(COUNT, dtype=np.int32)
    handles = []

    def make():
        handles.append(a.make_prepped_xfer("WRITE", local, idx, remote, idx, b"gil", skip_desc_merge=True))

    def post():
        state = a.transfer(handles[-1])
        while state != "DONE":
            state = a.check_xfer_state(handles[-1])
            loop.target.get_new_notifs()  # the target's side of the loopback progresses here

    def python_work():
        total = 0
        for i in range(3_000_000):
            total += i

    # (name, what to prepare unmeasured, the call measured); every handle is released after each
    calls = [("sleep 0.1 s (releases the GIL)", None, lambda: time.sleep(0.1)),
             ("pure Python loop", None, python_work),
             ("prep_xfer_dlist, 131,072 rows", None, loop.prep_remote),
             ("make_prepped_xfer, 131,072 descriptors", None, make),
             ("transfer + check until DONE", make, post)]
    print(f"nixl UCX loopback, {COUNT:,} descriptors of {DESC_BYTES} B; switch interval "
          f"{sys.getswitchinterval() * 1e3:.0f} ms; medians of {args.reps}")
    print(f"{'call':42} {'call ms':>9} {'longest stall ms':>17} {'stall / call':>13}")
    for name, prepare, call in calls:
        results = []
        for _ in range(args.reps):
            if prepare:
                prepare()
            results.append(stall_during(call))
            while handles:
                a.release_xfer_handle(handles.pop())
        dur = statistics.median(r[0] for r in results)
        stall = statistics.median(r[1] for r in results)
        print(f"{name:42} {dur * 1e3:9.1f} {stall * 1e3:17.1f} {stall / dur:13.2f}")

if __name__ == "__main__":
    main()
