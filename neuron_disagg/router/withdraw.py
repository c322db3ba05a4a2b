"""Telling a P that no D will take what it computed for a request.

P's one-token leg (push: sent with D's; pull: answered before D's is sent) is accepted by requests
D then refuses — ``max_tokens`` 0 or over the context, ``min_tokens`` above ``max_tokens``: D
checks parameters P's leg does not carry. Without a word from us P would hold that prompt's KV
for its whole lease (``lease_s``, 30 s), waiting for a registration or a read that never comes; a
client repeating such a mistake would fill P's cache. So when D refuses a leg (4xx) or cannot be
reached — both mean D never saw the request — the router sends every rank of P a signed
``Withdraw`` over its side channel, and P frees that KV at once, or as soon as it is computed.

Only then: a D that failed in any other way may have registered or be reading, and P's lease
(and D's own Cancel or ReadFailed) end those safely. A Withdraw that does not arrive costs
nothing but the lease.
"""

from __future__ import annotations

import asyncio
import logging

from ..kv_params import parse_transfer_id
from ..protocol.messages import Withdraw
from ..protocol.wire import WireCodec
from ..transfer.side_channel import SideChannelClient, rank_address
from .instances import Instance

log = logging.getLogger("neuron_disagg.router")


class Withdrawals:
    def __init__(self, codec: WireCodec, timeout_s: float = 2.0):
        self._client = SideChannelClient(codec, timeout_s)
        self._tasks: set[asyncio.Task] = set()

    def withdraw(self, p: Instance, transfer_id: str, reason: str) -> None:
        """Sends P's ranks the Withdraw in the background (the client's answer does not wait)."""
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(self._send, p, Withdraw(parse_transfer_id(transfer_id), reason)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send(self, p: Instance, message: Withdraw) -> None:
        for rank in range(p.tp):
            try:
                self._client.send(rank_address(p.side_channel, rank), message)
            except OSError as exc:  # P's lease frees the KV in the end
                log.warning("could not withdraw transfer %s from prefill %s rank %d: %s",
                            message.transfer_id, p.url, rank, exc)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._client.close()
