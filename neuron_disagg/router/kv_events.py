"""The router's end of vLLM's KV events: one ZMQ SUB socket, bound where the deployment config's
``kv_events_endpoint`` says, that every instance's publisher connects to (vLLM's publisher connects
to an endpoint without a wildcard), each under its own URL as topic (``neuron-disagg serve`` sets it).
Binding here, not on the instances, means no instance listens on another port, and one address in
the config reaches every instance.

``server.start_router`` starts it when the endpoint is set; what arrives goes to
``Affinity.received``. The socket takes no message above ``MAX_MESSAGE_BYTES`` and keeps at most
``RECEIVE_QUEUE`` unread, so a flood costs a bounded amount of memory and drops messages (counted
as gaps in the sender's sequence), never the router.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .affinity import Affinity

logger = logging.getLogger("neuron_disagg.router")

#: A batch holds one engine step's events: a few thousand blocks of token ids at most.
MAX_MESSAGE_BYTES = 64 << 20
RECEIVE_QUEUE = 10_000


class EventListener:
    def __init__(self, endpoint: str, affinity: Affinity, known: Callable[[], set[str]],
                 on_message: Callable[[str | None], None] = lambda url: None):
        # HOST:PORT, checked where the config is read (``Config.kv_events_endpoint``)
        self.endpoint = f"tcp://{endpoint}"
        self.affinity, self.known, self.on_message = affinity, known, on_message
        self._socket = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        import zmq
        import zmq.asyncio

        socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            socket.bind(self.endpoint)
        except zmq.ZMQError as exc:
            socket.close()
            raise OSError(f"for KV events on {self.endpoint}: {exc}") from None
        self._socket = socket
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events")
        logger.info("listening for the instances' KV events on %s", self.endpoint)

    async def _run(self) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            try:
                self.on_message(self.affinity.received(frames, self.known(), time.monotonic()))
            except Exception:  # a message the checks let through must not stop the listening
                self.affinity.rejected["error"] += 1
                logger.exception("a KV event message could not be applied; it is dropped")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close()
