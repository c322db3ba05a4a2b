"""How a host is cut into vLLM instances, and how long it may take to serve.

A trn2.48xlarge has 64 logical NeuronCores (16 Trainium2 chips at the default LNC=2), a p5en.48xlarge
8 GPUs. One tensor-parallel size for both would leave most of a trn2 idle or overfill a p5en, so the
deployment file says per platform (``hosts.neuron``, ``hosts.cuda``) what TP each vLLM instance has
and how many instances share a host; what it leaves unset fills the host. Each instance of a host
gets its own accelerators (``NEURON_RT_VISIBLE_CORES`` / ``CUDA_VISIBLE_DEVICES``), its own HTTP port
(the role's port + k) and its own side-channel ports (``side_channel_port`` + k x TP, one per rank),
and the router lists every instance of every host.

The serving deadline: a host whose P, D or router does not answer /health within the platform's
warm-up (download, load and, on Trainium, compilation) and a margin is taken to be broken, and
powers itself off (ami/boot/guard.sh) rather than bill while it never serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import DeploymentConfigError
from .instance_types import DRY_RUN_ACCELERATORS, InstanceTypeInfo
from .reservations import WARM_UP
from .settings import DeploymentConfig

#: Beyond the platform's warm-up before a host that does not serve powers off: a first compile on
#: Trainium, or a slow download, can run past the typical warm-up.
SERVING_MARGIN_MINUTES = 60
#: What the visibility of each instance's accelerators is set with, per platform.
VISIBLE = {"neuron": "NEURON_RT_VISIBLE_CORES", "cuda": "CUDA_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class HostPlan:
    """One role's hosts: ``instances`` vLLM instances of ``tensor_parallel_size`` each."""

    platform: str
    instance_type: str
    tensor_parallel_size: int
    instances: int
    accelerators: int

    @property
    def idle(self) -> int:
        return self.accelerators - self.tensor_parallel_size * self.instances

    def describe(self) -> str:
        unit = "logical NeuronCores" if self.platform == "neuron" else "GPUs"
        idle = f", {self.idle} idle" if self.idle else ""
        return (f"{self.instance_type}: {self.instances} vLLM instance(s) per host, TP {self.tensor_parallel_size} "
                f"each, on {self.tensor_parallel_size * self.instances} of its {self.accelerators} {unit}{idle}")


def plan(deployment: DeploymentConfig, role: str, info: InstanceTypeInfo) -> HostPlan:
    """How ``role``'s hosts (of type ``info``) are used; refuses a use that does not fit the host."""
    platform = info.platform or "cuda"
    use = deployment.hosts.of(platform)
    tp, count = use.tensor_parallel_size, use.instances_per_host
    where = f"hosts.{platform}"
    total = info.accelerators
    if total is None:
        if tp is None or count is None:
            raise DeploymentConfigError(
                f"how many accelerators {info.name} has is not known here (a dry run knows only "
                f"{', '.join(sorted(DRY_RUN_ACCELERATORS))}): set both {where}.tensor_parallel_size and "
                f"{where}.instances_per_host")
        return HostPlan(platform, info.name, tp, count, tp * count)
    if tp is None and count is None:
        tp, count = total, 1
    elif tp is None:
        assert count is not None
        tp = total // count
        if tp < 1:
            raise DeploymentConfigError(f"{where}.instances_per_host is {count}, but {info.name} has only {total} "
                                        "accelerators: lower it")
    elif count is None:
        count = total // tp
    if count < 1 or tp * count > total:
        count = max(count, 1)
        raise DeploymentConfigError(
            f"{where}: {count} instance(s) of TP {tp} need {tp * count} accelerators, but {info.name} has {total}"
            f"{' (logical NeuronCores at the default LNC=2)' if platform == 'neuron' else ''}: lower "
            f"{where}.tensor_parallel_size or {where}.instances_per_host")
    return HostPlan(platform, info.name, tp, count, total)


def plans(deployment: DeploymentConfig, types: dict[str, InstanceTypeInfo]) -> dict[str, HostPlan]:
    """Each role's plan, with the ports its instances take checked against each other's."""
    found = {role: plan(deployment, role, types[group.instance_type])  # type: ignore[index]
             for role, group in (("prefill", deployment.prefill), ("decode", deployment.decode))}
    ports = {"prefill": deployment.prefill_port, "decode": deployment.decode_port}
    for role, host in found.items():
        used = range(ports[role], ports[role] + host.instances)
        if deployment.router.host == role and deployment.router.port in used:
            raise DeploymentConfigError(
                f"the router's port {deployment.router.port} is one of the {role} instances' ports "
                f"{used.start}-{used.stop - 1} ({role}_port + instance): move router.port or {role}_port")
    return found


def serving_deadline_s(deployment: DeploymentConfig, platform: str) -> int:
    """Seconds after each boot by which a host must serve, or power off."""
    if deployment.serving_deadline_minutes:
        return deployment.serving_deadline_minutes * 60
    return int(WARM_UP.get(platform, WARM_UP["neuron"]).total_seconds()) + SERVING_MARGIN_MINUTES * 60
