"""`neuron-disagg launch | status | teardown | instance-profile CONFIG [flags]`: AWS deployments of P/D
serving.

Flags override the deployment config file, so one model config serves trn2 and p5en unchanged
(``--instance-type`` is the only difference between a trn2 and a p5en deployment: examples/launch.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import boto3

from ..config import ConfigError
from ..kv_params import ROLES
from . import cost, instance_profile
from .capacity import offerings, print_offerings
from .cloud import Cloud, DryRunCloud
from .errors import DeployError, DeploymentConfigError
from .launch import launch
from .secret_parameter import describe_state
from .settings import DeploymentConfig
from .status import print_status, resources, status
from .teardown import teardown


def new_session(region: str) -> boto3.Session | None:
    """The boto3 session to use; None lets boto3 find credentials its usual way (tests replace this)."""
    return None


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="deployment config (YAML), e.g. examples/qwen3-32b.yaml")
    parser.add_argument("--name", help="deployment name (overrides `name`); tags every resource")
    parser.add_argument("--region", help="AWS region (overrides `region`; else AWS_REGION / AWS_DEFAULT_REGION)")


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"neuron-disagg {command}", description=_DESCRIPTIONS[command])
    _common(parser)
    if command == "launch":
        parser.add_argument("--instance-type", help="P and D instance type, e.g. trn2.48xlarge or p5en.48xlarge")
        parser.add_argument("--prefill-instance-type", help="P instance type (overrides --instance-type)")
        parser.add_argument("--decode-instance-type", help="D instance type (overrides --instance-type)")
        parser.add_argument("--prefill", type=int, metavar="X", help="number of prefill instances (xPyD)")
        parser.add_argument("--decode", type=int, metavar="Y", help="number of decode instances (xPyD)")
        parser.add_argument("--subnet", help="subnet id (fixes VPC and Availability Zone)")
        parser.add_argument("--key-name", help="EC2 key pair name")
        parser.add_argument("--iam-instance-profile", metavar="NAME",
                            help="instance profile of the instances: reads the secret's SSM parameter at boot "
                                 "(required unless --secret-in-user-data), allows SSM sessions")
        parser.add_argument("--hf-token-parameter", metavar="NAME",
                            help="SecureString holding a Hugging Face token, for a gated model (overrides "
                                 "hf_token_ssm_parameter); the instances read it with their profile")
        parser.add_argument("--secret-in-user-data", action="store_true", default=None,
                            help="put the secret into the user data instead of SSM (no instance profile needed; "
                                 "readable by anyone allowed ec2:DescribeInstanceAttribute)")
        parser.add_argument("--capacity-block", metavar="CR_ID",
                            help="run every instance in this purchased Capacity Block reservation (cr-...)")
        parser.add_argument("--router-on", choices=ROLES, help="host of the router (default prefill)")
        parser.add_argument("--dry-run", action="store_true",
                            help="print the AWS calls (operation + parameters, one JSON line each) and make none")
        parser.add_argument("--yes", action="store_true",
                            help="launch without asking: the cost summary is printed, no confirmation awaited")
        parser.add_argument("--max-hours", type=float, metavar="H",
                            help="each instance powers off, and so terminates, H hours after its first boot, reboots "
                                 "included (overrides max_hours, default 8; 0: never)")
        parser.add_argument("--capacity-block-offerings", type=int, metavar="HOURS",
                            help="instead of launching: list Capacity Block offerings for the P+D count and type")
    elif command == "instance-profile":
        parser.add_argument("--no-sessions", action="store_true",
                            help="leave out the SSM session actions (port forwarding to the router)")
    elif command == "status":
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        parser.add_argument("--all", action="store_true", help="include terminated instances")
    else:
        parser.add_argument("--dry-run", action="store_true", help="print the AWS calls and make none")
        parser.add_argument("--timeout-s", type=float, default=900.0,
                            help="wait at most this long for instances to terminate (default 900)")
        parser.add_argument("--keep-instance-profile", action="store_true",
                            help="keep the deployment's instance profile and role (a relaunch can reuse them)")
        parser.add_argument("--poll-s", type=float, default=10.0, help=argparse.SUPPRESS)
    return parser


_DESCRIPTIONS = {
    "launch": "Launch prefill and decode instances (with EFA on every network card) and the router.",
    "status": "List a deployment's instances with state and addresses, and whether its secret parameter exists.",
    "teardown": "Terminate a deployment's instances; delete its security and placement groups, its SecureStrings and "
                "its instance profile and role.",
    "instance-profile": "Create (or complete) the deployment's instance profile neuron-disagg-<name>: a role that "
                        "may read this deployment's secret alone (and open SSM sessions).",
}


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    get = lambda name: getattr(args, name, None)  # noqa: E731 - flags absent for some commands
    capacity = get("capacity_block")
    return {
        "name": get("name"), "region": get("region"), "subnet_id": get("subnet"), "key_name": get("key_name"),
        "iam_instance_profile": get("iam_instance_profile"), "secret_in_user_data": get("secret_in_user_data"),
        "prefill.instance_type": get("prefill_instance_type") or get("instance_type"),
        "decode.instance_type": get("decode_instance_type") or get("instance_type"),
        "prefill.count": get("prefill"), "decode.count": get("decode"),
        "prefill.capacity_block_id": capacity, "decode.capacity_block_id": capacity,
        "router.host": get("router_on"), "max_hours": get("max_hours"),
        "hf_token_ssm_parameter": get("hf_token_parameter"),
    }


def _load(args: argparse.Namespace) -> DeploymentConfig:
    deployment = DeploymentConfig.from_yaml(args.config, _overrides(args))
    if deployment.region is None:
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            deployment = deployment.model_copy(update={"region": region})
    deployment.require("region")
    return deployment


def _cloud(deployment: DeploymentConfig, dry_run: bool) -> Cloud:
    if dry_run:
        return DryRunCloud(deployment.region)
    return Cloud.connect(deployment.region, session=new_session(deployment.region))


def _ask():
    """How to ask the person at the terminal; None when there is none (CI, a pipe): then --yes is needed."""
    if not sys.stdin.isatty():
        return None

    def ask(prompt: str) -> str:
        print(prompt, end="", file=sys.stderr, flush=True)
        return sys.stdin.readline()
    return ask


def _launch(args: argparse.Namespace) -> int:
    deployment = _load(args)
    if args.capacity_block_offerings is not None:
        deployment.require("prefill.instance_type", "decode.instance_type")
        if deployment.prefill.instance_type != deployment.decode.instance_type:
            raise DeploymentConfigError("a Capacity Block holds one instance type; list offerings per type with "
                                        "--instance-type")
        count = deployment.prefill.count + deployment.decode.count
        cloud = _cloud(deployment, dry_run=False)
        rows = offerings(cloud, deployment.prefill.instance_type, count, args.capacity_block_offerings)
        print_offerings(rows, deployment.prefill.instance_type, count, args.capacity_block_offerings, sys.stdout)
        return 0
    cloud = _cloud(deployment, args.dry_run)
    result = launch(cloud, deployment, confirm=lambda bill: cost.confirm(bill, args.yes, _ask()))
    if cloud.dry_run:
        print(f"dry run: {len(cloud.calls)} calls printed, none made", file=sys.stderr)
        return 0
    print(f"deployment {deployment.name}: {deployment.prefill.count}P{deployment.decode.count}D launched; "
          f"router at {result.router_url} once the instances have booted and loaded the model.\n"
          f"watch: neuron-disagg status {args.config} --name {deployment.name} --region {deployment.region}\n"
          f"logs on an instance: journalctl -u 'neuron-disagg-prefill@*' -u 'neuron-disagg-decode@*' "
          f"-u neuron-disagg-router -u neuron-disagg-guard\n"
          f"a host whose instances do not serve within its deadline, or past max_hours ({deployment.max_hours:g} h), "
          "powers off; status says why"
          + (f"\nthe secret is in SecureString {result.secret_parameter}; teardown deletes it"
             if result.secret_parameter else ""),
          file=sys.stderr)
    print_status(status(cloud, deployment.name),
                 deployment.name, deployment.router.port, sys.stdout)
    return 0


def _status(args: argparse.Namespace) -> int:
    deployment = _load(args)
    cloud = _cloud(deployment, False)
    rows = status(cloud, deployment.name, include_terminated=args.all)
    secret = None if deployment.secret_in_user_data else (
        deployment.secret_parameter, describe_state(cloud, deployment.secret_parameter, deployment.name))
    left = [r for r in resources(cloud, deployment.name) if secret is None or r != f"SecureString {secret[0]}"]
    print_status(rows, deployment.name, deployment.router.port, sys.stdout, as_json=args.json, secret=secret,
                 left=left)
    return 0


def _teardown(args: argparse.Namespace) -> int:
    deployment = _load(args)
    cloud = _cloud(deployment, args.dry_run)
    # With secret_in_user_data, launch stored no parameter (and the account may not allow SSM at all).
    parameter = None if deployment.secret_in_user_data else deployment.secret_parameter
    result = teardown(cloud, deployment.name, secret_parameter_name=parameter,
                      timeout_s=args.timeout_s, poll_s=args.poll_s, keep_instance_profile=args.keep_instance_profile)
    if cloud.dry_run:
        print(f"dry run: {len(cloud.calls)} calls printed, none made", file=sys.stderr)
    elif result.anything:
        deleted = (f", SecureString {result.secret_parameter_deleted} deleted"
                   if result.secret_parameter_deleted else "")
        if result.instance_profile_deleted:
            deleted += ", instance profile deleted"
        print(f"deployment {deployment.name}: torn down ({len(result.terminated)} instance(s) terminated{deleted})")
    else:
        print(f"deployment {deployment.name}: nothing to tear down")
    return 0


def _instance_profile(args: argparse.Namespace) -> int:
    deployment = _load(args)
    name = instance_profile.create(_cloud(deployment, False), deployment, sessions=not args.no_sessions)
    print(f"instance profile {name}: ready; its role may read SecureString {deployment.secret_parameter} only.\n"
          f"launch with --iam-instance-profile {name} (IAM_INSTANCE_PROFILE={name} for examples/launch.sh); "
          "a profile seconds old may need a few more before EC2 accepts it")
    return 0


def main(argv: list[str]) -> int:
    """``argv[0]`` is the command: launch, status or teardown."""
    if not argv or argv[0] not in _DESCRIPTIONS:
        print("usage: neuron-disagg launch|status|teardown|instance-profile CONFIG [flags]", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    args = _parser(command).parse_args(rest)
    try:
        return {"launch": _launch, "status": _status, "teardown": _teardown,
                "instance-profile": _instance_profile}[command](args)
    except DeployError as exc:
        print(f"neuron-disagg {command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except ConfigError as exc:  # the neuron-disagg Config: e.g. the secret is missing
        print(f"neuron-disagg {command}: {exc}", file=sys.stderr)
        return 2
