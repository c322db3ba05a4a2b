"""Accelerator layer: what differs between Neuron, CUDA and CPU hosts (issue 8 completes it)."""
