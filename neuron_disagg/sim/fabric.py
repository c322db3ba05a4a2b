"""The EFA fabric between instances: each instance's NICs are one FIFO port per direction, and a
transfer holds P's egress port and D's ingress port for its wire time. Why ports and not a single
pipe: with several P writing to one D (xPyD) the D side is the bottleneck, with one P serving
several D it is the P side; both come out of the same rule. Ports are always taken P first, then
D, so two transfers can never wait on each other in a cycle."""

from __future__ import annotations

import simpy

from .params import Profile
from .steptime import wire_s


class Fabric:
    def __init__(self, env: simpy.Environment, profile: Profile, num_p: int, num_d: int) -> None:
        self.env, self.profile = env, profile
        self.egress = [simpy.Resource(env, capacity=1) for _ in range(num_p)]
        self.ingress = [simpy.Resource(env, capacity=1) for _ in range(num_d)]
        self.bytes_moved = 0

    def move(self, p_index: int, d_index: int, tokens: int):
        """A simpy process body: returns once the prompt's KV for ``tokens`` is at D."""
        with self.egress[p_index].request() as out_port:
            yield out_port
            with self.ingress[d_index].request() as in_port:
                yield in_port
                yield self.env.timeout(wire_s(self.profile, tokens))
        self.bytes_moved += tokens * self.profile.geometry.kv_bytes_per_token_per_rank()
