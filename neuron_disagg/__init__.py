"""neuron-disagg: push-mode prefill/decode disaggregation for vLLM (Trainium first, H200 too)."""

__version__ = "0.1.0"
