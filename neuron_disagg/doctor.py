"""`neuron-disagg doctor`: check this host before serving, and say how to fix each problem.

Every check returns ok, warn or fail with a message and, when not ok, a fix. A failure is something
that would make `serve` refuse to start or make transfers fail; a warning is something that works
but slower or only locally. Exit status is non-zero on any failure. The secret is never printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Literal

from .config import Config, ConfigError

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    message: str
    fix: str = ""


# -- probes (each isolated so one broken library cannot take doctor down) ---------------------------
_NIXL_PROBE = r"""
import json, sys
out = {}
try:
    from nixl._api import nixl_agent, nixl_agent_config
except Exception as exc:
    print(json.dumps({"import_error": f"{type(exc).__name__}: {exc}"})); sys.exit(0)
for backend in ("UCX", "LIBFABRIC"):
    try:
        nixl_agent(f"doctor-{backend}", nixl_agent_config(enable_prog_thread=False,
                   enable_listen_thread=False, backends=[backend]))
        out[backend] = "loaded"
    except Exception as exc:
        out[backend] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def probe_nixl(timeout_s: float = 60.0, image: bool = False) -> dict[str, str]:
    """Create a NIXL agent per backend in a child process: a plugin that crashes cannot crash us.
    The process sees the library path ``neuron-disagg serve`` gives vLLM. For an image the fabric's
    variables are dropped: its builder has no EFA device for FI_PROVIDER=efa to open."""
    from .platforms import fabric_libs

    env = {k: v for k, v in os.environ.items() if not (image and k.startswith("FI_"))}
    env["LD_LIBRARY_PATH"] = fabric_libs.library_path(fabric_libs.find())
    try:
        proc = subprocess.run([sys.executable, "-c", _NIXL_PROBE], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"import_error": f"creating NIXL agents took longer than {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"import_error": f"NIXL probe exited with {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def _run(cmd: list[str], timeout_s: float = 20.0) -> str | None:
    exe = shutil.which(cmd[0])
    if exe is None:
        return None
    try:
        return subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


# -- checks -----------------------------------------------------------------------------------------
def check_vllm() -> Check:
    from .vllm import compat
    try:
        version = compat.installed_version()
        newer = compat.check_version(version)
    except compat.UnsupportedVLLM as exc:
        return Check("vllm", "fail", str(exc), f"install a vLLM in {compat.RANGE} (on Trainium: the Neuron "
                     "DLAMI's vLLM environment of SDK 2.32+)")
    if newer:
        return Check("vllm", "warn", f"vLLM {version} is newer than the tested range {compat.RANGE}; the "
                     "connector runs only if its API is unchanged (checked when vLLM starts it)",
                     f"to be safe, use a vLLM in {compat.RANGE}")
    return Check("vllm", "ok", f"vLLM {version} (tested range {compat.RANGE})")


def check_nixl(backend: str, image: bool = False) -> list[Check]:
    result = probe_nixl(image=image)
    if "import_error" in result:
        return [Check("nixl", "fail", f"nixl does not import: {result['import_error']}",
                      "pip install nixl (pulls nixl-cu12/nixl-cu13)")]
    checks = [Check("nixl", "ok", "nixl imports")]
    for name in ("UCX", "LIBFABRIC"):
        state = result.get(name, "not probed")
        if state == "loaded":
            checks.append(Check(f"nixl backend {name}", "ok", f"{name} backend loads"))
            continue
        needed = name == backend
        fix = ("install libfabric >= 1.21 (the EFA installer puts it in /opt/amazon/efa/lib), then "
               "`sudo neuron-disagg install-fabric-libs` (GPU hosts: `--platform cuda`)" if name == "LIBFABRIC"
               else "reinstall nixl; check that its bundled UCX libraries load (ldd on the plugin)")
        msg = f"{name} backend does not load ({state})" + ("; this platform needs it" if needed
                                                             else "; not used on this platform")
        checks.append(Check(f"nixl backend {name}", "fail" if needed else "warn", msg, fix))
    return checks


def check_libfabric(backend: str) -> Check:
    version = _run(["fi_info", "--version"])
    if version is None:
        status: Status = "fail" if backend == "LIBFABRIC" else "ok"
        return Check("libfabric", status, "fi_info not installed (libfabric tools absent)",
                     "" if status == "ok" else "install the EFA software: aws-efa-installer (efa_installer.sh --yes)")
    lib = next((ln.split(":", 1)[1].strip() for ln in version.splitlines() if ln.startswith("libfabric:")), version.strip())
    providers = sorted({ln.strip().rstrip(":") for ln in (_run(["fi_info", "-l"]) or "").splitlines()
                        if ln.strip().endswith(":") and not ln.startswith(" ")})
    msg = f"libfabric {lib or 'unknown'}; providers: {', '.join(providers) or 'none listed'}"
    if backend == "LIBFABRIC" and "efa" not in providers:
        return Check("libfabric", "fail", msg + " (no efa provider)",
                     "reinstall the EFA software (aws-efa-installer) so the efa provider is built")
    return Check("libfabric", "ok", msg)


def check_efa(platform) -> Check:
    efas = platform.efa_devices()
    if efas:
        pairs = platform.efa_affinity()  # what NIXL's rail selection will find near each accelerator
        nearest = "; nearest to each accelerator: " + ", ".join(f"{a}→{n}" for a, n in pairs.items()) if pairs else ""
        return Check("efa devices", "ok", f"{len(efas)} EFA device(s): {', '.join(d.name for d in efas[:4])}"
                     + (" ..." if len(efas) > 4 else "") + nearest)
    if platform.name == "cpu":
        return Check("efa devices", "ok", "none (CPU host: UCX over TCP/shared memory)")
    return Check("efa devices", "warn", "no EFA device: KV will move over UCX/TCP, far slower between instances",
                 "launch with EFA interfaces (one per network card) and install the EFA driver")


def check_neuron(platform) -> Check:
    from .platforms.neuron import neuron_device_nodes
    from .platforms.neuron_ls import run_neuron_ls
    nodes = neuron_device_nodes(platform.root)
    if not nodes:
        return Check("neuron devices", "ok", "none (not a Trainium host)")
    try:
        devices = run_neuron_ls()
    except Exception as exc:  # a broken tool is worth a warning, not a crash
        return Check("neuron devices", "warn", f"{len(nodes)} device entries; neuron-ls -j failed: {exc}",
                     "reinstall aws-neuronx-tools")
    runtime = (_run(["dpkg-query", "-W", "-f", "${Version}", "aws-neuronx-runtime-lib"]) or "").strip()
    gen = getattr(platform, "generation", lambda: None)()
    msg = f"{len(nodes)} device entries ({gen or 'unknown generation'})"
    msg += f"; neuron-ls: {len(devices)} devices" if devices is not None else "; neuron-ls not installed"
    msg += f"; runtime {runtime}" if runtime else "; runtime version unknown"
    return Check("neuron devices", "ok", msg)


#: Where the AMI's systemd units get their environment (ami/scripts/50-units.sh writes it).
UNITS_ENV = "etc/neuron-disagg/fabric.env"


def units_library_path(root: str = "/") -> tuple[str, str] | None:
    """(LD_LIBRARY_PATH, file) the AMI's systemd units run with, from their fabric.env; None where
    there is no such file (not our AMI)."""
    env_file = os.path.join(root, UNITS_ENV)
    try:
        with open(env_file) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        key, sep, value = line.strip().partition("=")
        if sep and key == "LD_LIBRARY_PATH":
            return value.strip().strip("'\""), env_file
    return "", env_file


def _plugin_lacks(directory, search_path: str | None = None) -> list[str] | None:
    """Sonames NIXL's LIBFABRIC plugin needs that the linker cannot find; None if it cannot tell."""
    from .platforms import fabric_libs
    try:
        return fabric_libs.missing(fabric_libs.plugin(), directory, search_path)
    except (fabric_libs.FabricLibsError, OSError, subprocess.SubprocessError):
        return None


def _plugin_abi_lacks(directory) -> list[str]:
    """libfabric ABI versions NIXL's LIBFABRIC plugin needs and the libfabric found lacks."""
    from .platforms import fabric_libs
    try:
        return fabric_libs.abi_lacking(fabric_libs.plugin(), directory)
    except (fabric_libs.FabricLibsError, OSError, subprocess.SubprocessError):
        return []


def _fabric_libs_fix(platform_name: str, lacking: list[str] | None, search_path: str | None) -> str:
    from .platforms import fabric_libs
    if platform_name == "neuron":
        return "sudo neuron-disagg install-fabric-libs"
    if platform_name != "cuda":
        return "install the NVIDIA driver and CUDA runtime, and libfabric >= 1.21 (EFA installer)"
    install = f"sudo neuron-disagg install-fabric-libs --platform cuda (CUDA runtime and hwloc into {fabric_libs.SYSTEM_DIR})"
    if lacking is None:
        return f"{install}; the NVIDIA driver provides libcuda.so.1; the EFA installer libfabric >= 1.21"
    fixes = []
    if "libcuda.so.1" in lacking:
        fixes.append("install the NVIDIA driver (it provides libcuda.so.1; never a stub on a GPU host)")
    if any(name.startswith(("libcudart.so.", "libhwloc.so.")) for name in lacking):
        fixes.append(install)
        if search_path is not None and str(fabric_libs.SYSTEM_DIR) not in search_path.split(":"):
            fixes.append(f"and put {fabric_libs.SYSTEM_DIR} first on LD_LIBRARY_PATH in /{UNITS_ENV}")
    if any(name.startswith("libfabric.so") for name in lacking):
        fixes.append(f"install libfabric >= 1.21 with the EFA installer ({fabric_libs.EFA_LIB_DIR})")
    return "; ".join(fixes) or install


def check_fabric_libs(platform, backend: str) -> Check:
    """What NIXL's LIBFABRIC plugin needs besides libfabric (libcuda, libcudart, libhwloc): on a
    Neuron host the package installs all three (``install-fabric-libs``); on a GPU host the driver
    provides libcuda and ``install-fabric-libs --platform cuda`` the other two. Where the AMI's units
    run (their fabric.env exists), the plugin must also resolve everything with exactly their
    LD_LIBRARY_PATH, whatever this shell's is; what it cannot find is named."""
    from .platforms import fabric_libs

    if backend != "LIBFABRIC":
        return Check("fabric libraries", "ok", "not needed (UCX)")
    directory = fabric_libs.find()
    sets = " (what `neuron-disagg serve` sets)" if platform.name == "neuron" else ""
    where = f" with {directory} on LD_LIBRARY_PATH{sets}" if directory else ""
    if platform.name == "cuda" and directory is not None and (directory / "libcuda.so.1").exists():
        return Check("fabric libraries", "fail", f"{directory / 'libcuda.so.1'} is a libcuda stand-in (for Neuron "
                     "hosts): first on LD_LIBRARY_PATH it hides the NVIDIA driver's libcuda.so.1",
                     "sudo neuron-disagg install-fabric-libs --platform cuda (removes it)")
    units = units_library_path(getattr(platform, "root", "/"))
    for_units = _plugin_lacks(directory, units[0]) if units else None
    state = fabric_libs.loads(directory)
    if state == "loaded" and not for_units:
        return Check("fabric libraries", "ok", f"NIXL's LIBFABRIC backend loads{where}"
                     + (f"; the units' LD_LIBRARY_PATH ({units[1]}) resolves all it needs" if units else ""))
    if for_units:
        lacking = for_units
        msg = (f"NIXL's LIBFABRIC plugin cannot find {', '.join(for_units)} with the units' LD_LIBRARY_PATH "
               f"({units[0] or 'unset'}, from {units[1]}): the LIBFABRIC backend will not load in the units"
               + ("" if state == "loaded" else f" ({state})"))
    else:  # on a GPU host what is missing decides the fix: the driver's, or ours to install
        abi = _plugin_abi_lacks(directory)
        if abi:  # no library of ours helps: the libfabric is too old for this NIXL
            return Check("fabric libraries", "fail", f"NIXL's LIBFABRIC backend does not load{where}: {state}",
                         fabric_libs.abi_advice(abi))
        lacking = _plugin_lacks(directory) if platform.name == "cuda" else None
        msg = (f"NIXL's LIBFABRIC backend does not load{where}: {state}"
               + (f"; the linker cannot find {', '.join(lacking)}" if lacking else ""))
    return Check("fabric libraries", "fail", msg, _fabric_libs_fix(platform.name, lacking, units[0] if units else None))


def check_env(platform, backend: str) -> Check:
    missing = platform.missing_fabric_env(backend=backend)
    if not missing:
        needed = platform.fabric_env(backend)
        return Check("environment", "ok", ("set: " + ", ".join(f"{k}={v}" for k, v in needed.items()))
                     if needed else "no fabric variables needed")
    return Check("environment", "fail", f"{platform.name} with {backend} needs: "
                 + ", ".join(f"{k}={v} (now {os.environ.get(k, 'unset')})" for k, v in missing.items()),
                 " ".join(f"export {k}={v};" for k, v in missing.items()))


def clock_offset_s(chronyc_tracking: str) -> float | None:
    """This host's offset from its time source, from ``chronyc tracking`` ("System time : 0.000021
    seconds slow of NTP time"); None if the output has no such line."""
    for line in chronyc_tracking.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "System time":
            words = value.split()
            if len(words) >= 3 and words[1] == "seconds":
                return float(words[0]) * (-1 if words[2] == "slow" else 1)
    return None


def check_clock(config: Config, image: bool = False) -> Check:
    """P and D compare each other's timestamps against clock_skew_allowance_s: two hosts each off
    by half the allowance in opposite directions already exhaust it."""
    allowance, fix = config.clock_skew_allowance_s, ("run chronyd against a time source (on EC2 the Amazon "
                                                     "Time Sync Service, 169.254.169.123)")
    if image:
        found = shutil.which("chronyd") or shutil.which("chronyc")
        return Check("clock", "ok" if found else "warn",
                     "chrony installed" if found else "chrony not installed in the image", "" if found else fix)
    tracking = _run(["chronyc", "tracking"])
    offset = clock_offset_s(tracking) if tracking else None
    if offset is not None:
        if abs(offset) >= allowance / 2:
            return Check("clock", "fail", f"this host's clock is {offset:+.3f} s off its time source; two hosts "
                                          f"off like this can exceed clock_skew_allowance_s ({allowance} s), and "
                                          "transfers between them are then refused", fix)
        return Check("clock", "ok", f"{offset:+.6f} s off its time source (chrony); allowance {allowance} s")
    synced = _run(["timedatectl", "show", "-p", "NTPSynchronized", "--value"])
    if synced and synced.strip() == "yes":
        return Check("clock", "ok", "synchronised (timedatectl; install chrony to see the offset)")
    return Check("clock", "warn", "cannot tell whether this host's clock is synchronised (no chronyc; timedatectl "
                                  f"says {(synced or 'nothing').strip()!r}); a clock off by more than "
                                  f"clock_skew_allowance_s ({allowance} s) makes every transfer recompute", fix)


def check_port(config: Config) -> Check:
    host, port = config.side_channel_host, config.side_channel_port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return Check("side channel", "fail", f"side_channel_host {host!r} does not resolve: {exc}",
                     "set side_channel_host to an address of this host")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            return Check("side channel", "fail", f"cannot bind {config.side_channel}: {exc.strerror}",
                         f"stop what listens there (ss -ltnp 'sport = :{port}') or set side_channel_port")
    return Check("side channel", "ok", f"{config.side_channel} is free")


def check_secret(config: Config, image: bool = False) -> Check:
    if image:
        return Check("secret", "warn", "not checked: an image being baked has no deployment secret yet",
                     "the instance gets it at launch (environment, file or SSM); run doctor there without --image")
    try:
        secret = config.load_secret()
    except ConfigError as exc:
        return Check("secret", "fail", "deployment secret missing or too short", str(exc))
    where = f"secret_file {config.secret_file}" if config.secret_file else f"${config.secret_env}"
    return Check("secret", "ok", f"present in {where} ({len(secret)} bytes)")


def run_checks(config_path: str | None = None, root: str = "/", image: bool = False,
               image_platform: str | None = None) -> tuple[list[Check], dict]:
    """``image_platform`` (with ``image``): check the software for that accelerator on a builder
    that has none of its devices (the AMI bake runs on a plain m6i)."""
    checks: list[Check] = []
    try:
        config = Config.from_yaml(config_path) if config_path else Config()
        checks.append(Check("config", "ok", f"loaded {config_path}" if config_path else "defaults (no --config)"))
    except ConfigError as exc:
        checks.append(Check("config", "fail", str(exc), "fix the named fields in the config file"))
        config = None
    summary: dict = {}
    checks.append(check_vllm())
    if config is None:
        return checks, summary
    checks.append(check_secret(config, image))
    from .platforms import PlatformError, select_platform
    try:
        if image_platform:
            platform, reason = _image_platform(image_platform, root), f"the image's target (--platform {image_platform})"
        else:
            platform, reason = select_platform(config.platform, root=root)
    except PlatformError as exc:
        checks.append(Check("platform", "fail", str(exc), "set platform: auto, or run on the named hardware"))
        return checks, summary
    # An image's target has EFA, whose backend the builder lacks the devices to show.
    backend = platform.nixl_backend(config.backend if config.backend != "auto" or not image_platform else "LIBFABRIC")
    summary = {"platform": platform.name, "reason": reason, "nixl_backend": backend,
               "memory_type": platform.memory_type, "wait_for_kv": platform.wait_strategy}
    checks.append(Check("platform", "ok", f"{platform.name} ({reason}); NIXL {backend}, {platform.memory_type}"))
    checks += check_nixl(backend, image)
    devices = [] if image_platform else [check_efa(platform), check_neuron(platform), check_env(platform, backend)]
    checks += [check_libfabric(backend), *devices, check_fabric_libs(platform, backend), check_port(config),
               check_clock(config, image)]
    return checks, summary


def _image_platform(name: str, root: str):
    if name == "neuron":
        from .platforms.neuron import NeuronPlatform
        return NeuronPlatform(root)
    from cuda_compat import CudaPlatform
    return CudaPlatform(root)


def _print_table(checks: list[Check]) -> None:
    # Plain text: doctor runs in a vLLM environment, which has only the base install.
    name_width = max(len(c.name) for c in checks)
    print("neuron-disagg doctor")
    for c in checks:
        print(f"  {c.status:<4}  {c.name:<{name_width}}  {c.message}")
        if c.fix and c.status != "ok":
            print(f"  {'':<4}  {'':<{name_width}}  fix: {c.fix}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="neuron-disagg doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="neuron-disagg YAML config to check")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--image", action="store_true",
                        help="checking a machine image being baked: no deployment secret exists yet")
    parser.add_argument("--platform", choices=("neuron", "cuda"),
                        help="with --image: the accelerator the image is for (its devices are not here): "
                             "NIXL's LIBFABRIC backend must load for it")
    args = parser.parse_args(argv)
    if args.platform and not args.image:
        parser.error("--platform checks an image for another host's accelerator: use it with --image")
    checks, summary = run_checks(args.config, image=args.image, image_platform=args.platform)
    ok = all(c.status != "fail" for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, **summary, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        _print_table(checks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
