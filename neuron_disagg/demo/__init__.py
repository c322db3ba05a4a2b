"""`neuron-disagg demo`: the protocol in one process (``in_process``), the same through real vLLM
servers (``served``), and the tiny local model both use (``tiny_model``, also the tests' and the
benchmark's default model)."""
