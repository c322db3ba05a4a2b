"""llm-d's P/D flow against our connector: a stand-in for llm-d's routing sidecar sends
P and D exactly what the sidecar's NIXL v2 connector sends, as read in llm-d/llm-d-router at commit
0545789098a63157c372443db4145d91895977b4, ``pkg/sidecar/proxy/connector_nixlv2.go``
(``handleNIXLV2``, its serial READ path) and ``pkg/common/request`` (``CapSingleToken``):

1. P's leg: the client's body with ``kv_transfer_params`` {do_remote_decode: true,
   do_remote_prefill: false, remote_engine_id/remote_block_ids/remote_host/remote_port: null},
   capped to one token (max_tokens 1, max_completion_tokens 1 where the API has it, min_tokens
   removed), stream false, stream_options removed; header X-Request-Id: a fresh UUID.
2. P's answer's ``kv_transfer_params``, verbatim, on the client's own body to D, same header.

P (``accept_unsigned_prefill_legs``) answers with D's whole params, signed by P: the sidecar holds
no secret. Every answer equals monolithic's, and the KV moved (D's transfer counter)."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from .vllm_cluster import body, metric, prompt, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.every_vllm]

SIDECAR_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                          "remote_block_ids": None, "remote_host": None, "remote_port": None}


def sidecar(p_url: str, d_url: str, path: str, client_body: dict) -> httpx.Response:
    """One request through the stand-in: P's leg, then D's with P's params; D's answer returned."""
    request_id = str(uuid.uuid4())
    headers = {"X-Request-Id": request_id}
    prefill = {**client_body, "kv_transfer_params": dict(SIDECAR_PREFILL_PARAMS), "max_tokens": 1, "stream": False}
    if path.endswith("/chat/completions"):
        prefill["max_completion_tokens"] = 1
    for dropped in ("min_tokens", "stream_options"):
        prefill.pop(dropped, None)
    p = httpx.post(p_url + path, json=prefill, headers=headers, timeout=120)
    if p.status_code >= 400:
        return p
    decode = {**client_body, "kv_transfer_params": p.json().get("kv_transfer_params")}
    if client_body.get("stream"):
        with httpx.stream("POST", d_url + path, json=decode, headers=headers, timeout=120) as d:
            d.read()
            return d
    return httpx.post(d_url + path, json=decode, headers=headers, timeout=120)


def streamed_text(response: httpx.Response) -> str:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(c.get("text", "") for e in events for c in json.loads(e)["choices"])


def test_the_sidecars_two_legs_move_the_kv_and_answer_as_monolithic(cluster):
    texts = [prompt(50, 401), prompt(280, 402)]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt(40, 403)}], "temperature": 0,
            "max_tokens": 10}
    mono = cluster.mono.url
    want = [httpx.post(f"{mono}/v1/completions", json=body(t, 12), timeout=120).json()["choices"][0]["text"]
            for t in texts]
    want_chat = httpx.post(f"{mono}/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]["message"]
    loaded, rejected = metric(cluster.d, "neuron_disagg_transfers_total"), metric(cluster.d, "neuron_disagg_params_rejected_total")

    got = []
    for t in texts:
        r = sidecar(cluster.p.url, cluster.d.url, "/v1/completions", body(t, 12))
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    streamed = sidecar(cluster.p.url, cluster.d.url, "/v1/completions",
                       body(texts[1], 12, stream=True, stream_options={"include_usage": True}))
    assert streamed.status_code == 200, streamed.text
    r = sidecar(cluster.p.url, cluster.d.url, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text

    assert got == want and streamed_text(streamed) == want[1]
    assert r.json()["choices"][0]["message"]["content"] == want_chat["content"]
    wait_for(lambda: metric(cluster.d, "neuron_disagg_transfers_total") >= loaded + 4, 30,
             "D counting the 4 transfers the sidecar's legs moved")
    assert metric(cluster.d, "neuron_disagg_params_rejected_total") == rejected
