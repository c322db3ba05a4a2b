"""`neuron-disagg bench`: the side-by-side serving benchmark (topology, load, report, cli)."""
