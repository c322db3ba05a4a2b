"""Which vLLM Neuron plugin this process runs, and a refusal for the one a connector cannot serve.

Both plugin generations ship as the distribution ``vllm-neuron`` with the same entry point:
- the vLLM Neuron plugin of Neuron SDK 2.31+ (``vllm_neuron.vllm.platform.NeuronPlatform``,
  device type ``neuron``) allocates paged KV on the native ``neuron`` device and hands it to the
  connector's ``register_kv_caches``: supported;
- vllm-neuron 0.1/0.2.x, built on NxD Inference (``vllm_neuron.platform.NeuronPlatform``, device
  type ``cpu``), keeps the KV inside the compiled model and never calls ``register_kv_caches``:
  every disaggregated request would wait out its watchdog, so the connector refuses to start.
"""

from __future__ import annotations

NXDI_PLATFORM_MODULE = "vllm_neuron.platform"
SUPPORTED = ("the vLLM Neuron plugin of Neuron SDK 2.32 or newer (vllm-neuron 0.24.0.1.x and later, "
             "in the Neuron DLAMI's aws_neuronx_venv_pytorch_inference_vllm_* environment)")


class UnsupportedNeuronPlugin(RuntimeError):
    pass


def plugin_generation(platform: object) -> str | None:
    """"nxdi" (vllm-neuron 0.1/0.2.x), "native" (SDK 2.31+), or None (not a Neuron plugin)."""
    module = type(platform).__module__
    if module == NXDI_PLATFORM_MODULE or module.startswith(NXDI_PLATFORM_MODULE + "."):
        return "nxdi"
    if module.startswith("vllm_neuron."):
        return "native"
    return None


def refuse_unsupported_platform(platform: object | None = None) -> None:
    """Raise, naming the supported plugin, when vLLM runs the NxD Inference-based Neuron plugin."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if plugin_generation(platform) == "nxdi":
        raise UnsupportedNeuronPlugin(
            "this vLLM runs the NxD Inference-based vllm-neuron plugin (0.1/0.2.x): it keeps the KV cache "
            "inside the compiled model and never hands it to a KV connector, so no request could be "
            f"disaggregated. Use {SUPPORTED}")
