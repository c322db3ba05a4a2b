"""Ray's decode deployment with our hand-off discipline: a P replica that fails or dies never fails
the request by itself; D's connector decides.

Ray's orchestrator (``PDOrchestratorMixin``) answers the client with P's error as soon as P's leg
fails, and under pull has nothing to give D when P died. Ours knows better what a P failure means:
- push: D registered with P and waits for its KV; if P dies or hangs, D's connector sees it (the
  side channel, the lease, the watchdog) and applies ``kv_load_failure_policy`` — recompute, or a
  failed request saying why. So P's leg is drained beside D's and its outcome only logged.
- pull: every distinct prompt gets a P leg of its own (``backend.prefill_legs``), all at once; if
  one fails for want of P (died, unreachable), D computes the request itself. An error P answers
  about the request itself (a 4xx) goes to the client as Ray would send it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, ErrorResponse
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDDecodeServer

logger = logging.getLogger("neuron_disagg.ray_serve")


async def _drain(prefill_resp) -> ErrorResponse | BaseException | None:
    """P's answer to a push leg, consumed: None, the error P answered, or what its call raised."""
    try:
        async for chunk in prefill_resp:
            if isinstance(chunk, ErrorResponse):
                return chunk
    except Exception as exc:  # the replica died or its call failed: D's connector sees to it
        return exc
    return None


async def _first_answer(handle_method, request, raw_request_info):
    """P's first chunk for a pull leg, the rest drained; what the call raised, if it failed."""
    try:
        gen = handle_method.remote(request, raw_request_info)
        first = await gen.__anext__()
        async for _ in gen:
            pass
        return first
    except Exception as exc:
        return exc


class NeuronDisaggDecodeServer(PDDecodeServer):
    async def _concurrent_decode(self, method, decode_request, prefill_resp, raw_request_info, *,
                                 cancel_on_failure: bool = True):
        """Push: D's leg streams while P's is drained beside it; P's outcome is logged, not sent."""
        prefill = asyncio.create_task(_drain(prefill_resp))
        try:
            local = await getattr(LLMServer, method)(self, decode_request, raw_request_info)
            async for chunk in local:
                yield chunk
        finally:
            if not prefill.done():  # a hung P must not hold the answer D already gave
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(prefill), 1.0)
            if prefill.done():
                failed = prefill.result()
                if failed is not None:
                    logger.warning("request %s: the prefill leg failed (%s); D's connector handled its KV",
                                   decode_request.request_id, failed)
            else:
                prefill.cancel()

    async def _pd_handle_request(self, request, raw_request_info=None):
        backend = self._get_connector_backend()
        if backend.concurrent_handoff:
            async for chunk in super()._pd_handle_request(request, raw_request_info):
                yield chunk
            return
        method = "chat" if isinstance(request, ChatCompletionRequest) else "completions"
        handle_method = getattr(self._prefill_handle, method)
        answers = await asyncio.gather(*(_first_answer(handle_method, leg, raw_request_info)
                                         for leg in backend.prefill_legs(request)))
        refused = next((a for a in answers if isinstance(a, ErrorResponse)), None)
        if refused is not None and (refused.error.code or 500) < 500:
            yield refused  # the request's own fault: D would refuse it too
            return
        failed = [a for a in answers if isinstance(a, (BaseException, ErrorResponse))]
        if failed:
            logger.warning("request %s: %d of %d prefill legs failed (%s); D computes the prompt itself",
                           request.request_id, len(failed), len(answers), failed[0])
        decode_request = backend.prepare_decode_request(request=request, peer=None,
                                                        prefill_response=None if failed else answers)
        local = await getattr(LLMServer, method)(self, decode_request, raw_request_info)
        async for chunk in local:
            yield chunk
