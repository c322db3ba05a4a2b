"""Host staging's copy rate for one 16k-token Qwen3-32B request on one TP8 rank (512 MiB:
64 layers x K/V x 1,024 blocks of 4 KiB), next to a plain contiguous copy of the same bytes.

    .venv/bin/python microbenchmarks/staging.py [--device cpu]

Prints each direction's time and GiB/s for contiguous and scattered block lists, and its ratio
to the plain copy. On a Neuron host pass the KV device (e.g. ``--device xla``) to time the real
device <-> host path; here only ``cpu`` has been run.
"""

from __future__ import annotations

import argparse
import time

import torch

from neuron_disagg.platforms import kv_layout
from neuron_disagg.transfer.staging import HostStaging

LAYERS, BLOCKS, REQUEST_BLOCKS = 64, 2100, 1024


def timed(fn) -> float:
    fn()  # warm
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    device = torch.device(parser.parse_args().device)
    caches = {f"layers.{layer}": torch.zeros(2, BLOCKS, 16, 1, 128, dtype=torch.bfloat16, device=device)
              for layer in range(LAYERS)}
    planes = (kv_layout.KV, kv_layout.BLOCKS, kv_layout.TOKENS, kv_layout.HEADS, kv_layout.HEAD)
    described = kv_layout.described_kv_caches(caches, dict.fromkeys(caches, planes), kv_layout.KVGeometry(16))
    staging = HostStaging(kv_layout.staging_rows(described), [region for region, _ in described], REQUEST_BLOCKS)
    gib = LAYERS * 2 * REQUEST_BLOCKS * 4096 / 2**30
    host = torch.empty(LAYERS * 2 * REQUEST_BLOCKS * 4096, dtype=torch.uint8)

    def plain() -> None:
        offset = 0
        for view in kv_layout.staging_rows(described):
            rows = view[:REQUEST_BLOCKS].cpu().contiguous().view(-1)
            host[offset:offset + rows.numel()].copy_(rows)
            offset += rows.numel()

    base = timed(plain)
    print(f"plain contiguous copy: {base * 1e3:6.0f} ms  {gib / base:5.2f} GiB/s")
    slots = list(range(REQUEST_BLOCKS))
    for label, blocks in (("contiguous", list(range(REQUEST_BLOCKS))),
                          ("scattered", list(range(0, 2 * REQUEST_BLOCKS, 2)))):
        for name, fn in (("to host", lambda: staging.to_host(blocks, slots)),
                         ("to device", lambda: staging.to_device(slots, blocks))):
            took = timed(fn)
            print(f"{label:10} {name:9}: {took * 1e3:6.0f} ms  {gib / took:5.2f} GiB/s  "
                  f"{took / base:4.1f}x the plain copy")


if __name__ == "__main__":
    main()
