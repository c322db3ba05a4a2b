"""How Ray Serve LLM's orchestrator shapes our legs (neuron_disagg/ray_serve/leg_shaping.py), on
vLLM's own OpenAI request models (Ray's subclass them): what P and D receive is what our router
sends, signed, and the connector's parser reads it back."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402

from neuron_disagg import kv_params  # noqa: E402
from neuron_disagg.kv_params import ParamsSigner  # noqa: E402
from neuron_disagg.ray_serve import leg_shaping  # noqa: E402

SIGNER = ParamsSigner(b"s" * 32)


class Answer:  # what Ray hands over of P's answer: an object with kv_transfer_params
    def __init__(self, params):
        self.kv_transfer_params = params


def completion(prompt, **extra) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt=prompt, max_tokens=20, stream=True,
                             stream_options={"include_usage": True}, **extra)


def test_push_legs_name_one_transfer_and_the_peer_ray_bound_and_leave_the_client_request_as_it_was():
    request = completion("hello there", n=2, temperature=0.5)
    (p,) = leg_shaping.prefill_legs(request, "push", SIGNER)
    d = leg_shaping.decode_leg(request, "push", SIGNER, peer={**leg_shaping.peer_metadata("10.0.0.7:5600", 8), "other": 1})
    assert (p.max_tokens, p.stream, p.stream_options, p.n) == (1, False, None, 1)
    assert (d.max_tokens, d.stream, d.n, d.temperature) == (20, True, 2, 0.5)  # D samples as asked
    assert request.kv_transfer_params is None and request.max_tokens == 20
    p_leg, d_leg = kv_params.parse(p.kv_transfer_params, SIGNER), kv_params.parse(d.kv_transfer_params, SIGNER)
    assert (p_leg.role, p_leg.mode, d_leg.role, d_leg.mode) == ("prefill", "push", "decode", "push")
    assert p_leg.transfer_id == d_leg.transfer_id == kv_params.parse_transfer_id(leg_shaping.transfer_id(request))
    assert (d_leg.p_side_channel, d_leg.p_tp_size, d_leg.prompts) == ("10.0.0.7:5600", 8, 1)


def test_a_push_peer_that_published_no_side_channel_is_refused_saying_what_is_missing():
    with pytest.raises(ValueError, match="published no neuron_disagg side channel"):
        leg_shaping.decode_leg(completion("x"), "push", SIGNER, peer={})


def test_pull_sends_p_one_leg_per_distinct_prompt_and_d_every_offer_p_answered():
    request = completion(["one two", "three four five", "one two"])
    p_legs = leg_shaping.prefill_legs(request, "pull", SIGNER)
    assert [leg.prompt for leg in p_legs] == ["one two", "three four five"]
    parsed = [kv_params.parse(leg.kv_transfer_params, SIGNER) for leg in p_legs]
    assert {(p.mode, p.prompts, p.transfer_id) for p in parsed} == {("pull", 2, parsed[0].transfer_id)}
    offers = [Answer(kv_params.prefill_answer(f"offer-{i}")) for i in range(2)]
    d = kv_params.parse(leg_shaping.decode_leg(request, "pull", SIGNER, answers=offers).kv_transfer_params, SIGNER)
    assert (d.role, d.mode, d.offers, d.transfer_id) == ("decode", "pull", ("offer-0", "offer-1"), parsed[0].transfer_id)


@pytest.mark.parametrize("answers", [[None], [Answer(None)], [Answer(kv_params.prefill_answer("o")), None]])
def test_pull_without_every_offer_runs_plain_on_d_which_computes_the_prompt(answers):
    assert leg_shaping.decode_leg(completion("a b c"), "pull", SIGNER, answers=answers).kv_transfer_params is None


def test_chat_legs_cap_max_completion_tokens_only_where_the_client_set_it():
    messages = [{"role": "user", "content": "hi"}]
    plain = ChatCompletionRequest(model="tiny", messages=messages, max_tokens=9)
    capped = ChatCompletionRequest(model="tiny", messages=messages, max_completion_tokens=9)
    assert leg_shaping.prefill_legs(plain, "push", SIGNER)[0].max_completion_tokens is None
    assert leg_shaping.prefill_legs(capped, "push", SIGNER)[0].max_completion_tokens == 1
    assert leg_shaping.prompt_count(plain) == 1


def test_legs_of_two_requests_never_share_a_transfer():
    a, b = completion("same prompt"), completion("same prompt")
    assert leg_shaping.transfer_id(a) != leg_shaping.transfer_id(b)
