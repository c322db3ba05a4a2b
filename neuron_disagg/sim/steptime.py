"""How long one engine step takes, on P (prefill) and on D (decode).

Prefill is compute-bound: FLOPs of the chunk's new tokens (weights plus causal attention over the
context already computed) over the ranks' peak times an efficiency. Decode is memory-bound: a fixed
per-step cost (weights read, collectives, launch, scheduling; fitted at low load) plus, for every
running sequence, reading its whole KV cache once per step. That second term is why TPOT rises with
concurrency x context length, and why the published low-load TPOT sits near the base.
"""

from __future__ import annotations

from .params import Profile


def prefill_chunk_s(profile: Profile, start: int, tokens: int) -> float:
    """Compute time of ``tokens`` new prompt tokens whose first sits at position ``start``."""
    g = profile.geometry
    linear = 2.0 * g.linear_params * tokens
    # QK^T and AV: 2 FLOPs per multiply-add, each over q_heads*head_dim, for start+i+1 keys.
    attention = 4.0 * g.layers * g.q_heads * g.head_dim * (tokens * start + tokens * (tokens + 1) / 2)
    return (linear + attention) / (g.tp * profile.v("peak_flops") * profile.v("prefill_mfu"))


def prefill_request_s(profile: Profile, tokens: int) -> float:
    """One whole prompt in one step, step overhead included: the deterministic service time of an
    unchunked, unbatched prefill (what the M/D/1 closed form takes as D)."""
    return profile.v("prefill_step_base_s") + prefill_chunk_s(profile, 0, tokens)


def kv_read_s_per_token(profile: Profile) -> float:
    g = profile.geometry
    return g.kv_bytes_per_token_per_rank() / (profile.v("hbm_bytes_per_s") * profile.v("hbm_efficiency"))


def decode_step_s(profile: Profile, running: int, context_tokens: int) -> float:
    """One decode step over ``running`` sequences holding ``context_tokens`` tokens in total."""
    if running == 0:
        return 0.0
    return (profile.v("decode_step_base_s") + running * profile.v("decode_per_seq_s")
            + context_tokens * kv_read_s_per_token(profile))


def kv_bytes_per_rank(profile: Profile, tokens: int) -> int:
    """Bytes one rank sends for a prompt of ``tokens`` (ranks send in parallel)."""
    return tokens * profile.geometry.kv_bytes_per_token_per_rank()


def wire_s(profile: Profile, tokens: int) -> float:
    return profile.v("wire_latency_s") + kv_bytes_per_rank(profile, tokens) / profile.v("nic_bytes_per_s")


def descriptors(profile: Profile, tokens: int) -> int:
    return profile.geometry.descriptors(tokens, profile.v("run_blocks"))


def pull_loop_s(profile: Profile, tokens: int) -> float:
    """Work pull mode puts on D's engine loop for one request: build the descriptor list, make the
    transfer handle, post every descriptor. Every running decode waits for it."""
    n = descriptors(profile, tokens)
    return profile.v("d_admit_s") + n * (profile.v("pull_prep_s_per_desc") + profile.v("post_s_per_desc"))


def push_writer_s(profile: Profile, tokens: int) -> float:
    """Work push mode puts on P's writer thread for one request: plan (per unmerged descriptor) and
    post (per descriptor after merging). Neither engine loop waits for it."""
    g = profile.geometry
    unmerged = g.regions_per_rank() * g.blocks(tokens)
    return unmerged * profile.v("push_plan_s_per_desc") + descriptors(profile, tokens) * profile.v("post_s_per_desc")
