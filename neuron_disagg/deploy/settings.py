"""The deployment config file: where (region, subnet), on what (instance types, counts xPyD),
serving what (model, vLLM args), how each platform's host is used (``hosts``: TP per vLLM
instance, instances per host), and the neuron-disagg ``Config`` every instance gets.

One YAML file serves trn2 and p5en alike: instance types, counts, region, subnet and key pair may
come from flags instead (``with_overrides``), and ``hosts`` says per platform how a host is cut
into vLLM instances, so a model config is shared unchanged between platforms whose hosts differ (64
logical NeuronCores on a trn2.48xlarge, 8 GPUs on a p5en.48xlarge). Validation is strict (unknown
keys fail) and happens before any AWS call.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..config import Config
from ..kv_params import Role
from .errors import DeploymentConfigError

#: vLLM arguments travel through a systemd EnvironmentFile split on whitespace: keep them plain.
_PLAIN_ARG = re.compile(r"^[A-Za-z0-9_./:=,+@%-]+$")
#: Where the secret lives on every instance (root-only); the instance config points at it.
INSTANCE_SECRET_FILE = "/etc/neuron-disagg/secret"
#: The SecureString holding a deployment's secret unless secret_ssm_parameter names another. Under one
#: prefix so that a single IAM statement (examples/README.md, step 2) covers every deployment.
SECRET_PARAMETER_TEMPLATE = "/neuron-disagg/{name}/secret"


_IMDS_TAG_KEY = re.compile(r"[A-Za-z0-9+\-=.,_:@]+")
#: max_hours unless the config says otherwise: a first launch forgotten overnight stops on its own.
DEFAULT_MAX_HOURS = 8.0


class RoleGroup(BaseModel):
    """The prefill or decode instances: one type, a count, optionally a Capacity Block."""

    model_config = ConfigDict(extra="forbid")

    instance_type: str | None = Field(None, description="e.g. trn2.48xlarge, p5en.48xlarge")
    count: int = Field(1, ge=1, le=64)
    capacity_block_id: str | None = Field(
        None, pattern=r"^cr-[0-9a-f]+$",
        description="a capacity reservation (cr-...) these instances run in: a purchased Capacity Block or an "
                    "On-Demand Capacity Reservation; launch checks which, and that it fits, before creating anything")


class HostUse(BaseModel):
    """How a host of one platform is used: ``instances_per_host`` vLLM instances of the host's role
    side by side, each on its own ``tensor_parallel_size`` accelerators (logical NeuronCores at the
    default LNC=2 on Trainium2, GPUs on p5en). What is unset fills the host: neither set, one instance
    on every accelerator; one set, the other as large as the host allows (``sizing.py``)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int | None = Field(
        None, ge=1, le=128, description="accelerators per vLLM instance (unset: the host's divided by instances_per_host)")
    instances_per_host: int | None = Field(
        None, ge=1, le=64, description="vLLM instances per host (unset: as many as tensor_parallel_size fits)")


class Hosts(BaseModel):
    """``HostUse`` per platform: the one file serves Trainium (neuron) and GPU (cuda) hosts."""

    model_config = ConfigDict(extra="forbid")

    neuron: HostUse = Field(default_factory=HostUse, description="trn2, trn1 hosts")
    cuda: HostUse = Field(default_factory=HostUse, description="p5en, p5 hosts")

    def of(self, platform: str) -> HostUse:
        return self.neuron if platform == "neuron" else self.cuda


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: Role = Field(
        "prefill", description="the router runs on the first instance of this role")
    port: int = Field(8000, ge=1, le=65535)


class DeploymentConfig(BaseModel):
    """One deployment: validated, with every field's default stated."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9-]{0,39}$",
                      description="names every resource (tags, placement group, security group)")
    region: str | None = Field(None, pattern=r"^[a-z]{2}(-[a-z]+)+-\d+$")
    subnet_id: str | None = Field(None, pattern=r"^subnet-[0-9a-f]+$",
                                  description="fixes the VPC and the Availability Zone")
    key_name: str | None = None
    iam_instance_profile: str | None = Field(
        None, description="instance profile name; its role reads the secret parameter at boot (required "
                          "unless secret_in_user_data) and allows SSM sessions")
    extra_security_group_ids: list[str] = Field(
        default_factory=list, description="attached besides ours, e.g. one allowing SSH from a bastion")
    ami_id: str | None = Field(None, pattern=r"^ami-[0-9a-f]+$",
                               description="skip AMI lookup and use this image")
    allow_stock_ami: bool = Field(False, description="launch on an image that is not a baked neuron-disagg AMI "
                                                     "(it boots but does not serve: for debugging images)")
    root_volume_gib: int = Field(500, ge=64, le=16384)

    model: str = Field(..., min_length=1, description="Hugging Face id or local path on the instance")
    hosts: Hosts = Field(default_factory=Hosts, description="per platform: TP per vLLM instance, instances per host")
    max_model_len: int | None = Field(None, ge=16)
    vllm_args: list[str] = Field(default_factory=list, description="extra `vllm serve` arguments")
    prefill: RoleGroup = Field(default_factory=RoleGroup)
    decode: RoleGroup = Field(default_factory=RoleGroup)
    prefill_port: int = Field(8100, ge=1, le=65535)
    decode_port: int = Field(8200, ge=1, le=65535)
    router: RouterSettings = Field(default_factory=RouterSettings)

    secret_ssm_parameter: str | None = Field(
        None, pattern=r"^/[A-Za-z0-9_./-]+$", max_length=1011,
        description="SecureString launch writes the secret to and the instances read it from at boot; "
                    f"default {SECRET_PARAMETER_TEMPLATE.format(name='<name>')}")
    secret_in_user_data: bool = Field(
        False, description="put the secret into the instances' user data instead of SSM, for accounts "
                           "without an instance profile; anyone allowed ec2:DescribeInstanceAttribute can read it")
    hf_token_ssm_parameter: str | None = Field(
        None, pattern=r"^/[A-Za-z0-9_./-]+$", max_length=1011,
        description="SecureString holding a Hugging Face token (a gated model needs one), created by you; each "
                    "instance reads it at boot with its instance profile into HF_TOKEN of its vLLM units")
    max_hours: float = Field(
        DEFAULT_MAX_HOURS, ge=0, le=8760,
        description="each instance powers off, and so terminates, this many hours after its first boot, "
                    "reboots included (ami/boot/guard.sh): a forgotten deployment stops billing on its own; 0: never")
    serving_deadline_minutes: int | None = Field(
        None, ge=10, le=1440,
        description="P, D and the router must answer /health this many minutes after each boot, or the host says "
                    "why on its console and powers off; unset: the platform's warm-up and a margin (sizing.py)")
    tags: dict[str, str] = Field(default_factory=dict, description="added to every resource")
    neuron_disagg: Config = Field(default_factory=Config,
                                  description="the neuron-disagg Config each instance runs with")

    @field_validator("vllm_args")
    @classmethod
    def _plain_args(cls, args: list[str]) -> list[str]:
        for arg in args:
            if not _PLAIN_ARG.match(arg):
                raise ValueError(f"vllm_args entry {arg!r} may hold only letters, digits and _./:=,+@%- "
                                 "(each entry is one word; no spaces, quotes or $)")
        return args

    @field_validator("model")
    @classmethod
    def _plain_model(cls, model: str) -> str:
        if not _PLAIN_ARG.match(model):
            raise ValueError("model may hold only letters, digits and _./:=,+@%- (a Hugging Face id or a path)")
        return model

    @model_validator(mode="before")
    @classmethod
    def _tensor_parallel_size_per_platform(cls, values: Any) -> Any:
        if isinstance(values, dict) and "tensor_parallel_size" in values:
            raise ValueError(
                "tensor_parallel_size belongs under hosts, per platform (hosts.neuron.tensor_parallel_size, "
                "hosts.cuda.tensor_parallel_size): one file serves trn2 (64 logical NeuronCores) and p5en (8 GPUs), "
                "and one TP for both leaves most of a trn2 idle or overfills a p5en")
        return values

    @field_validator("secret_ssm_parameter", "hf_token_ssm_parameter")
    @classmethod
    def _not_reserved_parameter(cls, name: str | None) -> str | None:
        if name and name.lower().startswith(("/aws", "/ssm")):
            raise ValueError("parameter names under /aws and /ssm are reserved by AWS")
        return name

    @model_validator(mode="after")
    def _one_place_for_the_secret(self) -> DeploymentConfig:
        if self.secret_in_user_data and self.secret_ssm_parameter:
            raise ValueError("secret_in_user_data and secret_ssm_parameter contradict each other: the secret "
                             "goes either into user data or into the SSM parameter; drop one")
        return self

    @field_validator("tags")
    @classmethod
    def _no_reserved_tags(cls, tags: dict[str, str]) -> dict[str, str]:
        reserved = [k for k in tags if k.startswith("neuron-disagg:") or k.startswith("aws:")]
        if reserved:
            raise ValueError(f"tag keys {reserved} are reserved (neuron-disagg:* and aws:* are set by launch)")
        # The instances allow tags in instance metadata (the router's host reads its peers there),
        # and EC2 then refuses to launch with a tag key outside this set.
        unfit = [k for k in tags if not _IMDS_TAG_KEY.fullmatch(k) or k in (".", "..", "_index")]
        if unfit:
            raise ValueError(f"tag keys {unfit} cannot be instance tags readable from instance metadata, which "
                             "launch turns on: use letters, digits and + - = . , _ : @ only (no spaces or /)")
        return tags

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "deployment config") -> DeploymentConfig:
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            lines = []
            for err in exc.errors():
                field = ".".join(str(p) for p in err["loc"]) or "(config)"
                given = f" (got {err['input']!r})" if err["type"] != "missing" and err["loc"] else ""
                lines.append(f"  {field}: {err['msg']}{given}")
            raise DeploymentConfigError(f"invalid {source}:\n" + "\n".join(lines)) from None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> DeploymentConfig:
        """Read ``path`` and apply ``overrides`` (dotted keys such as ``prefill.count``) on top."""
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise DeploymentConfigError(f"cannot read deployment config {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise DeploymentConfigError(f"deployment config {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise DeploymentConfigError(f"deployment config {path} must hold a mapping of settings")
        for dotted, value in (overrides or {}).items():
            if value is None:
                continue
            node = data
            *parents, leaf = dotted.split(".")
            for key in parents:
                node = node.setdefault(key, {})
                if not isinstance(node, dict):
                    raise DeploymentConfigError(f"deployment config {path}: {key} must be a mapping")
            node[leaf] = value
        return cls.from_mapping(data, source=f"deployment config {path}")

    # -- checks per command ---------------------------------------------------------------------------
    def require(self, *fields: str) -> None:
        """Fail with every missing field at once, naming the key and the flag that sets it."""
        flags = {"region": "--region", "subnet_id": "--subnet", "prefill.instance_type": "--instance-type",
                 "decode.instance_type": "--instance-type"}
        missing = []
        for dotted in fields:
            value: Any = self
            for part in dotted.split("."):
                value = getattr(value, part)
            if value is None:
                missing.append(f"  {dotted} (or {flags[dotted]})" if dotted in flags else f"  {dotted}")
        if missing:
            raise DeploymentConfigError("the deployment config lacks:\n" + "\n".join(missing))

    def require_launchable(self) -> None:
        self.require("region", "subnet_id", "prefill.instance_type", "decode.instance_type")
        if not self.secret_in_user_data and not self.iam_instance_profile:
            raise DeploymentConfigError(missing_instance_profile_advice(self.secret_parameter, self.name,
                                                                        self.hf_token_ssm_parameter))
        if self.hf_token_ssm_parameter and not self.iam_instance_profile:
            raise DeploymentConfigError(
                f"hf_token_ssm_parameter {self.hf_token_ssm_parameter} is read at boot with the instances' profile, "
                "and there is no iam_instance_profile: create one (`neuron-disagg instance-profile CONFIG --name "
                f"{self.name}`) and set it")

    # -- derived --------------------------------------------------------------------------------------
    def instance_config(self) -> dict[str, Any]:
        """The neuron-disagg config each instance gets: the secret from the root-only file, the side
        channel on the host's own address (filled in at boot, see user_data)."""
        values = self.neuron_disagg.model_dump(mode="json", exclude_defaults=True)
        values["secret_file"] = INSTANCE_SECRET_FILE
        values.pop("secret_env", None)
        Config.from_mapping(values)  # still valid after our changes
        return values

    def vllm_serve_args(self, tensor_parallel_size: int) -> list[str]:
        """Every instance's `vllm serve` arguments but --host and --port, which differ per instance."""
        args = ["--tensor-parallel-size", str(tensor_parallel_size)]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        return args + list(self.vllm_args)

    @property
    def parameters_read_at_boot(self) -> list[str]:
        """The SecureStrings each instance reads with its role: the secret's (unless it travels in user data)
        and the Hugging Face token's, if any."""
        read = [] if self.secret_in_user_data else [self.secret_parameter]
        return read + ([self.hf_token_ssm_parameter] if self.hf_token_ssm_parameter else [])

    @property
    def secret_parameter(self) -> str:
        """The SecureString of this deployment's secret (launch writes it unless secret_in_user_data;
        teardown deletes it if launch created it)."""
        return self.secret_ssm_parameter or SECRET_PARAMETER_TEMPLATE.format(name=self.name)

    def resource_tags(self) -> dict[str, str]:
        return {**self.tags, "neuron-disagg:deployment": self.name}


SESSION_ACTIONS = ("ssm:UpdateInstanceInformation", "ssmmessages:CreateControlChannel",
                   "ssmmessages:CreateDataChannel", "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel")
#: The instances' role, per deployment (instance_profile.py creates it; the advice below spells it out).
TRUST_POLICY = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}
SESSIONS_POLICY = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": list(SESSION_ACTIONS), "Resource": "*"}]}


def secret_policy(parameter: str, *more: str) -> dict[str, Any]:
    """ssm:GetParameter on one deployment's parameter (and ``more``, e.g. its Hugging Face token's) alone,
    and kms:Decrypt only through SSM."""
    arns = [f"arn:aws:ssm:*:*:parameter{name}" for name in (parameter, *more)]
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "ssm:GetParameter", "Resource": arns[0] if len(arns) == 1 else arns},
        {"Effect": "Allow", "Action": "kms:Decrypt", "Resource": "*",
         "Condition": {"StringLike": {"kms:ViaService": "ssm.*.amazonaws.com"}}}]}


def instance_role_name(deployment: str) -> str:
    return f"neuron-disagg-{deployment}"


def missing_instance_profile_advice(parameter: str, deployment: str, hf_token_parameter: str | None = None) -> str:
    """What to do when the instances would have no role to read the secret with: the commands that
    create one for this deployment (the same as examples/README.md, step 2), or the inline opt-in
    and its cost. One role per deployment, allowed exactly its own parameter: an instance of one
    deployment cannot read another's secret. SSM sessions get the few actions they need rather than
    AmazonSSMManagedInstanceCore, which also allows ssm:GetParameter on every parameter."""
    role = instance_role_name(deployment)
    extra = (hf_token_parameter,) if hf_token_parameter else ()
    policy, sessions, trust = (json.dumps(p, separators=(",", ":"))
                               for p in (secret_policy(parameter, *extra), SESSIONS_POLICY, TRUST_POLICY))
    return (
        f"no iam_instance_profile: launch stores the deployment secret in the SSM SecureString {parameter} "
        "and each instance reads it at boot with its instance profile's role, so the instances need one.\n"
        f"Create one for this deployment: `neuron-disagg instance-profile CONFIG --name {deployment}`, or by "
        "hand (examples/README.md, step 2, explains each command):\n"
        f"  aws iam create-role --role-name {role} --assume-role-policy-document '{trust}'\n"
        f"  aws iam put-role-policy --role-name {role} --policy-name neuron-disagg-secret "
        f"--policy-document '{policy}'\n"
        f"  aws iam put-role-policy --role-name {role} --policy-name neuron-disagg-sessions "
        f"--policy-document '{sessions}'   # optional: SSM sessions\n"
        f"  aws iam create-instance-profile --instance-profile-name {role}\n"
        f"  aws iam add-role-to-instance-profile --instance-profile-name {role} --role-name {role}\n"
        f"then set iam_instance_profile: {role} (or pass --iam-instance-profile {role}; "
        f"IAM_INSTANCE_PROFILE={role} for the example scripts).\n"
        "Or, where no instance profile is possible, set secret_in_user_data: true (--secret-in-user-data): "
        "the secret then travels in the user data, readable by anyone allowed ec2:DescribeInstanceAttribute.")
