"""The kv_transfer_params contract: what the router signs, the connector verifies exactly that, and
any change to any field, another deployment's secret, or age past the TTL is refused with a reason."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from neuron_disagg import kv_params
from neuron_disagg.kv_params import BadTransferParams, ParamsSigner

SIGNER = ParamsSigner(b"kv-params-tests-deployment-secret-01", ttl_s=60, skew_s=1)
NOW = 1_800_000_000.0


def built() -> list[dict]:
    return [kv_params.prefill(SIGNER, "push", "req.1#0"),
            kv_params.push_decode(SIGNER, "req.1#0", "10.0.0.1:5600", 4),
            kv_params.pull_decode(SIGNER, "req.1#1", [kv_params.prefill_answer("AAAA"),
                                                      kv_params.prefill_answer("AQID")])]


def test_what_the_router_builds_the_connector_reads_after_a_trip_through_json():
    prefill, push, pull = (json.loads(json.dumps(p)) for p in built())  # as vLLM's HTTP server passes them
    assert kv_params.parse(prefill, SIGNER).role == "prefill"
    leg = kv_params.parse(push, SIGNER)
    assert (leg.mode, leg.p_side_channel, leg.p_tp_size, str(leg.transfer_id)) == ("push", "10.0.0.1:5600", 4, "req.1#0")
    assert kv_params.parse(pull, SIGNER).offers == ("AAAA", "AQID")


def test_a_request_that_is_not_ours_is_not_checked():
    assert kv_params.parse(None, SIGNER) is None
    assert kv_params.parse({"do_remote_prefill": True}, SIGNER) is None


@given(index=st.integers(0, 2), field=st.integers(0, 20), value=st.one_of(
    st.text(max_size=12), st.integers(-5, 10**13), st.booleans(), st.none(), st.lists(st.text(max_size=4), max_size=2)))
def test_any_changed_or_added_field_breaks_the_signature(index, field, value):
    params = built()[index]
    names = sorted(params)
    name = names[field % len(names)] if field < len(names) else f"extra{field}"
    changed = {**params, name: value}
    if changed == params:
        return
    with pytest.raises(BadTransferParams, match="signature|not signed"):
        SIGNER.verify(changed)


def test_unsigned_other_secret_and_expired_are_refused_naming_why():
    params = {"neuron_disagg": 1, "role": "prefill", "mode": "push", "transfer_id": "r#0"}
    with pytest.raises(BadTransferParams, match="not signed"):
        kv_params.parse(params, SIGNER)
    with pytest.raises(BadTransferParams, match="another|this deployment's secret"):
        kv_params.parse(ParamsSigner(b"some-other-deployment-secret-0000").sign(params), SIGNER)
    signed = SIGNER.sign(params, now=NOW)
    assert kv_params.parse(signed, SIGNER, now=NOW + 60.5) is not None  # within the TTL and the skew allowance
    with pytest.raises(BadTransferParams, match="expired"):
        kv_params.parse(signed, SIGNER, now=NOW + 61.5)


def test_the_secret_never_shows():
    assert "kv-params-tests" not in repr(SIGNER)
    with pytest.raises(ValueError, match="at least"):
        ParamsSigner(b"short")
