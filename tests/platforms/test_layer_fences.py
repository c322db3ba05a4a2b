"""Streaming by layers on the engine's side: which layers form a group, when a group's fence is
recorded (only once all its layers and every group before it ran), the step's end covering what no
hook reached, and which platforms may stream by layers at all."""

import pytest

from neuron_disagg.platforms.cpu import CpuPlatform
from neuron_disagg.platforms.errors import PlatformError
from neuron_disagg.platforms.fence import LayerFences
from neuron_disagg.platforms.kv_layout import layer_groups
from neuron_disagg.platforms.neuron import NeuronPlatform
from neuron_disagg.protocol.geometry import ModelShape, rank_regions


class Held:
    """A recorded device fence that passes when the test says so."""

    def __init__(self, name):
        self.name, self.passed = name, False

    def ready(self):
        return self.passed

    def wait(self):
        raise AssertionError("the writer never blocks on a layer fence")


def _fences(groups_of_layers):
    recorded = []

    def record():
        recorded.append(Held(f"fence {len(recorded)}"))
        return recorded[-1]

    group_of_layer = {layer: g for g, layers in enumerate(groups_of_layers) for layer in layers}
    return LayerFences(group_of_layer, (), len(groups_of_layers), record), recorded


def test_a_groups_fence_is_recorded_once_its_last_layer_ran_and_passes_with_the_device():
    layers, recorded = _fences([["l0", "l1"], ["l2", "l3"]])
    layers.saved("l0")
    assert not recorded and not layers.ready(0)
    layers.saved("l1")
    assert len(recorded) == 1 and not layers.ready(0)  # recorded on the engine thread, not passed yet
    recorded[0].passed = True
    assert layers.ready(0) and not layers.ready(1) and not layers.passed()
    layers.saved("l2"), layers.saved("l3")
    recorded[1].passed = True
    assert layers.passed() and layers.finish(Held("end")) == 2


def test_a_later_group_waits_for_the_earlier_ones_since_one_fence_covers_everything_before_it():
    layers, recorded = _fences([["l0"], ["l1"]])
    layers.saved("l1")  # out of order (never seen in vLLM): group 1 complete, group 0 not
    assert not recorded and not layers.ready(1)
    layers.saved("l0")
    assert len(recorded) == 2 and not layers.ready(1)  # both recorded now, after both layers ran
    recorded[0].passed = True
    assert layers.ready(0) and not layers.ready(1)
    recorded[1].passed = True
    assert layers.ready(1)


def test_the_steps_end_fences_what_no_hook_reached_and_says_how_many_the_hook_fenced():
    layers, recorded = _fences([["l0"], ["l1"], ["l2"]])
    layers.saved("l0")
    layers.saved("a layer with no KV of its own")  # KV sharing: ignored
    end = Held("end")
    assert layers.finish(end) == 1
    assert not layers.ready(1) and not layers.ready(2)
    end.passed = True
    assert layers.passed()


def test_layers_fall_in_consecutive_groups_with_their_k_and_v_planes_and_sharing_layers_in_none():
    shape = ModelShape(num_layers=5, num_kv_heads=2, head_dim=8, dtype_bytes=2, block_tokens=4)
    regions = rank_regions(shape, 8)  # layers.{i}.k and .v
    names = [f"layers.{i}" for i in range(5)] + ["layers.shares.0"]
    g = layer_groups(names, regions, max_groups=2)
    assert g.groups == 2
    assert [g.group_of_layer[f"layers.{i}"] for i in range(5)] == [0, 0, 0, 1, 1]
    assert "layers.shares.0" not in g.group_of_layer
    assert g.group_of_region == (0, 0, 0, 0, 0, 0, 1, 1, 1, 1)
    assert layer_groups(names, regions, max_groups=64).groups == 5  # never more groups than layers


def test_chunks_run_unless_the_config_asks_for_layers_which_neuron_refuses(tmp_path):
    assert CpuPlatform(str(tmp_path)).stream_mode(None) == "chunks"
    assert CpuPlatform(str(tmp_path)).stream_mode("layers") == "layers"
    neuron = NeuronPlatform(str(tmp_path))
    assert neuron.stream_mode(None) == "chunks" and neuron.stream_mode("off") == "off"
    with pytest.raises(PlatformError, match="set stream: chunks"):
        neuron.stream_mode("layers")


def test_with_micro_batches_the_per_layer_hook_is_not_trusted_chunks_are_the_finest_and_layers_refused(tmp_path):
    cpu = CpuPlatform(str(tmp_path))
    assert cpu.stream_mode(None, layer_hook_once=False) == "chunks"
    with pytest.raises(PlatformError, match="micro-batch"):
        cpu.stream_mode("layers", layer_hook_once=False)
