"""What NIXL's LIBFABRIC plugin needs to load besides libfabric, put in place by our own set-up step.

nixl 1.4.1's ``libplugin_LIBFABRIC.so`` has NEEDED entries ``libcuda.so.1``, ``libcudart.so.13``
(``.12`` in the nixl-cu12 wheel) and ``libhwloc.so.15``, and bundles none of them. NIXL decides
between CUDA and Neuron from the PCI topology, so a Neuron host never calls into CUDA — but without
those files the dynamic linker refuses the plugin, and the LIBFABRIC backend does not exist.
``neuron-disagg install-fabric-libs`` asks the linker (``ldd``) what the plugin NIXL picks lacks,
and puts each into one directory, installing nothing system-wide:

- ``libcuda.so.1``: on Neuron hosts our stub (``libcuda_stub.py``); on GPU hosts
  (``--platform cuda``) never: the NVIDIA driver provides it, and a stub first on the library path
  would hide the driver (one left there by an earlier run is removed);
- ``libcudart.so.<N>``: the CUDA runtime already in the Python environment (the one torch loads,
  linked, so a process holds one runtime), else NVIDIA's from its PyPI wheel (it loads without any
  GPU). A GPU DLAMI has the driver but no runtime on the linker's path;
- ``libhwloc.so.15``: the distribution's hwloc package, unpacked (``apt-get download`` /
  ``dnf download``). apt waits up to ``APT_LOCK_TIMEOUT_S`` (300 s) for the package system's lock: on
  a fresh DLAMI its own apt jobs may hold it while the bake runs.

The plugin also needs a libfabric new enough: each NIXL build names the symbol-version ABI it was
linked against (``FABRIC_1.7`` for nixl 1.4.1 and 1.5.0, ``FABRIC_1.10`` for 1.5.1, whose wheels
were built with libfabric 2.7.0). A libfabric that lacks it is named with the release and the EFA
installer that first carry it, and with the NIXL that works with what the host has.

Then it loads NIXL's LIBFABRIC backend with the directory on LD_LIBRARY_PATH, and only if that works
marks the directory as good. ``neuron-disagg serve`` puts it on vLLM's LD_LIBRARY_PATH; ``doctor``
and the AMI bake check the backend loads. libfabric itself is the EFA installer's
(/opt/amazon/efa/lib), never ours.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import libcuda_stub

#: Where the AMI installs them (ami/scripts/40-fabric-libs.sh); searched first.
SYSTEM_DIR = Path("/opt/neuron-disagg/lib")
EFA_LIB_DIR = "/opt/amazon/efa/lib"
STAMP = ".neuron-disagg-fabric-libs"
#: The CUDA runtime wheel per libcudart soname major, and where in it the library lies.
CUDART_WHEELS = {"13": ("nvidia-cuda-runtime==13.0.96", "nvidia/cu13/lib/libcudart.so.13"),
                 "12": ("nvidia-cuda-runtime-cu12==12.9.79", "nvidia/cuda_runtime/lib/libcudart.so.12")}
#: ``--platform``: what the host's accelerator is. Only on Neuron is libcuda.so.1 ours to provide.
PLATFORMS = ("neuron", "cuda")
#: Each libfabric symbol-version ABI: the first libfabric release that exports it (libfabric.map.in
#: by release tag) and, where the EFA installer's changelog tells, the first installer shipping such
#: a release. 1.50.0, our AMI's pin, ships libfabric 2.6.0, which stops at FABRIC_1.9.
FABRIC_ABI: dict[str, tuple[str, str | None]] = {
    "FABRIC_1.7": ("1.20.0", None), "FABRIC_1.8": ("2.0.0", None),
    "FABRIC_1.9": ("2.5.0", "1.50.0"), "FABRIC_1.10": ("2.7.0", "1.51.0")}
#: The newest NIXL whose LIBFABRIC plugin needs only FABRIC_1.7, for hosts with an older libfabric.
NIXL_FOR_OLDER_LIBFABRIC = "1.5.0"


def apt_get(*args: str) -> list[str]:
    """An apt-get command that waits for the package system's lock (held by a fresh DLAMI's own apt jobs)
    instead of failing at once."""
    timeout = os.environ.get("APT_LOCK_TIMEOUT_S", "300")
    return ["apt-get", "-o", f"DPkg::Lock::Timeout={timeout}", *args]

_PROBE = r"""
import json, sys
try:
    from nixl._api import nixl_agent, nixl_agent_config
    nixl_agent("fabric-libs-check", nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                      backends=["LIBFABRIC"]))
except Exception as exc:
    print(json.dumps(f"{type(exc).__name__}: {exc}")); sys.exit(1)
print(json.dumps("loaded"))
"""


class FabricLibsError(Exception):
    """A library cannot be provided, or the backend still does not load; the message says what to do."""


def user_dir() -> Path:
    cache = os.environ.get("NEURON_DISAGG_CACHE") or os.path.expanduser("~/.cache/neuron-disagg")
    return Path(cache) / "fabric-libs"


def library_path(directory: Path | None, env: dict[str, str] | None = None) -> str:
    """LD_LIBRARY_PATH with ``directory`` first and the EFA installer's libfabric after it."""
    env = os.environ if env is None else env
    parts = [str(directory)] if directory else []
    parts += [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p not in parts]
    if os.path.isdir(EFA_LIB_DIR) and EFA_LIB_DIR not in parts:
        parts.append(EFA_LIB_DIR)
    return ":".join(parts)


def plugin(python: str = sys.executable) -> Path:
    """The LIBFABRIC plugin of the NIXL build ``import nixl`` picks in ``python``'s environment."""
    out = subprocess.run([python, "-c", "import os, nixl._api as a; print(os.path.dirname(a.__file__))"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise FabricLibsError(f"nixl does not import: {out.stderr.strip()[-300:]} (pip install nixl==1.4.1)")
    package = Path(out.stdout.strip().splitlines()[-1])
    found = package.with_name(package.name + ".libs") / "nixl" / "libplugin_LIBFABRIC.so"
    if not found.exists():
        raise FabricLibsError(f"{found} is missing: this NIXL build has no LIBFABRIC plugin")
    return found


def _ldd(plugin_path: Path, directory: Path | None, search_path: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "LD_LIBRARY_PATH": library_path(directory) if search_path is None else search_path}
    return subprocess.run(["ldd", str(plugin_path)], capture_output=True, text=True, env=env, timeout=60)


def missing(plugin_path: Path, directory: Path | None = None, search_path: str | None = None) -> list[str]:
    """Sonames the plugin needs that the dynamic linker cannot find (with ``directory`` searched), or,
    given ``search_path``, with exactly that LD_LIBRARY_PATH (e.g. the one the systemd units get)."""
    out = _ldd(plugin_path, directory, search_path)
    # NIXL's own libraries (libnixl_common, libserdes) are loaded before the plugin is.
    return [name for name in re.findall(r"^\s*(\S+) => not found", out.stdout, re.MULTILINE)
            if not name.startswith(("libnixl", "libserdes"))]


def abi_lacking(plugin_path: Path, directory: Path | None = None, search_path: str | None = None) -> list[str]:
    """The libfabric symbol versions the plugin needs that the libfabric the linker finds does not
    export (ldd: "libfabric.so.1: version `FABRIC_1.10' not found"), oldest first."""
    out = _ldd(plugin_path, directory, search_path)
    found = set(re.findall(r"libfabric\.so\.1: version `(FABRIC_[0-9.]+)' not found", out.stdout + out.stderr))
    return sorted(found, key=lambda v: tuple(int(n) for n in v.removeprefix("FABRIC_").split(".")))


def abi_advice(lacking: list[str]) -> str:
    """Why the plugin will not load against this libfabric, and the two ways out."""
    newest = lacking[-1]
    release, installer = FABRIC_ABI.get(newest, ("a release newer than this package knows", None))
    carrier = f"EFA installer >= {installer}" if installer else "an EFA installer that ships it"
    return (f"this NIXL's LIBFABRIC plugin needs libfabric ABI {newest} (libfabric >= {release}, {carrier}), "
            f"which the libfabric found lacks: install `nixl=={NIXL_FOR_OLDER_LIBFABRIC}` (its plugin needs "
            "FABRIC_1.7, libfabric >= 1.20) or a newer EFA installer")


def loads(directory: Path | None, python: str = sys.executable) -> str:
    """"loaded", or why NIXL's LIBFABRIC backend did not load, with ``directory`` on the path. The
    libraries are what is checked, not the fabric: libfabric picks any provider it has (FI_* are
    dropped), so a host whose EFA devices are absent (an image builder) answers as well."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FI_")}
    env["LD_LIBRARY_PATH"] = library_path(directory)
    out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith('"')]
    return lines[-1].strip('"') if lines else f"the check exited with {out.returncode}: {out.stderr[-300:]}"


def install(directory: Path, python: str = sys.executable, platform: str = "neuron") -> list[str]:
    """Provide what the plugin lacks in ``directory``, check the backend loads, and stamp the
    directory. Returns what was provided. ``platform`` "cuda": never a libcuda stub (the driver's)."""
    if platform not in PLATFORMS:
        raise FabricLibsError(f"platform must be one of {', '.join(PLATFORMS)}, not {platform!r}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STAMP).unlink(missing_ok=True)
    path = plugin(python)
    provided = []
    if platform == "cuda":
        _remove_stub(directory)  # first on the units' library path it would hide the NVIDIA driver
    elif list(directory.glob(".built-from-*")):  # our stub from an earlier run: rebuilt if its source changed
        libcuda_stub.build(directory)
    for name in missing(path, directory):
        if name == "libcuda.so.1" and platform == "cuda":
            raise FabricLibsError("libcuda.so.1 is missing: on a GPU host it comes from the NVIDIA driver, which "
                                  "neuron-disagg does not install (the GPU DLAMI has it): install the driver")
        if name == "libcuda.so.1":
            libcuda_stub.build(directory)
        elif name.startswith("libcudart.so."):
            _cuda_runtime(directory, name.rsplit(".", 1)[1], python)
        elif name == "libhwloc.so.15":
            _hwloc(directory)
        elif name.startswith("libfabric.so"):
            raise FabricLibsError(f"{name} is missing: install libfabric >= 1.21 with the EFA installer "
                                  f"(it puts it in {EFA_LIB_DIR}) or put it on LD_LIBRARY_PATH")
        else:
            raise FabricLibsError(f"NIXL's LIBFABRIC plugin needs {name}, which neuron-disagg does not provide")
        provided.append(name)
    still = missing(path, directory)
    if still:
        raise FabricLibsError(f"still missing after installing into {directory}: {', '.join(still)}")
    abi = abi_lacking(path, directory)
    if abi:
        raise FabricLibsError(abi_advice(abi))
    state = loads(directory, python)
    if state != "loaded":
        raise FabricLibsError(f"NIXL's LIBFABRIC backend does not load with {directory} on LD_LIBRARY_PATH: {state}")
    (directory / STAMP).touch()
    return provided


def find() -> Path | None:
    """An installed, checked directory (the AMI's first), or None."""
    for directory in (SYSTEM_DIR, user_dir()):
        if (directory / STAMP).exists():
            return directory
    return None


def _remove_stub(directory: Path) -> None:
    """Our libcuda stub, if an earlier (Neuron) run put one here; a real library is never touched."""
    stamps = list(directory.glob(".built-from-*"))
    if stamps:
        (directory / libcuda_stub.LIBRARY).unlink(missing_ok=True)
        for stamp in stamps:
            stamp.unlink()


def cudart_in(sites: list[Path], major: str) -> Path | None:
    """The CUDA runtime a Python environment already holds (NVIDIA's wheel, a torch dependency) in one
    of its ``sites`` (site-packages directories), or None."""
    if major not in CUDART_WHEELS:
        return None
    member = CUDART_WHEELS[major][1]
    for site in sites:
        found = site / member
        if found.is_file():
            return found
    return None


def _sites(python: str) -> list[Path]:
    out = subprocess.run([python, "-c", "import site; print('\\n'.join(site.getsitepackages()))"],
                         capture_output=True, text=True, timeout=60)
    return [Path(line) for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def _cuda_runtime(directory: Path, major: str, python: str) -> None:
    if major not in CUDART_WHEELS:
        raise FabricLibsError(f"no CUDA runtime wheel known for libcudart.so.{major}")
    requirement, member = CUDART_WHEELS[major]
    present = cudart_in(_sites(python), major)
    if present is not None:  # linked, not copied: torch and NIXL then load the one runtime, upgrades included
        link = directory / f"{Path(member).name}.tmp{os.getpid()}"
        link.unlink(missing_ok=True)
        link.symlink_to(present)
        os.replace(link, directory / Path(member).name)
        return
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "-d", tmp, requirement], capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise FabricLibsError(f"could not download {requirement} from the package index: "
                                  f"{done.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read(member)
    _install_file(directory / Path(member).name, data)


def _hwloc(directory: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        if shutil.which("apt-get") and shutil.which("dpkg-deb"):
            try:
                _run(apt_get("download", "libhwloc15"), tmp, "apt-get download libhwloc15")
            except FabricLibsError:
                if os.geteuid() != 0:
                    raise
                _run(apt_get("update", "-q"), tmp, "apt-get update")  # stale package lists
                _run(apt_get("download", "libhwloc15"), tmp, "apt-get download libhwloc15")
            _run(["dpkg-deb", "-x", str(next(Path(tmp).glob("libhwloc15_*.deb"))), str(root)], tmp, "dpkg-deb")
        elif shutil.which("dnf") and shutil.which("rpm2cpio"):
            _run(["dnf", "download", "--destdir", tmp, "hwloc-libs"], tmp, "dnf download hwloc-libs")
            root.mkdir()
            rpm = next(Path(tmp).glob("hwloc-libs-*.rpm"))
            _run(["sh", "-c", f"rpm2cpio '{rpm}' | cpio -idm --quiet"], str(root), "rpm2cpio")
        else:
            raise FabricLibsError("libhwloc.so.15 is missing and neither apt-get nor dnf is here: install "
                                  "hwloc 2.x's library (libhwloc15 / hwloc-libs)")
        found = sorted(root.glob("usr/lib*/**/libhwloc.so.15*"))
        real = [f for f in found if not f.is_symlink()]
        if not real:
            raise FabricLibsError("the hwloc package holds no libhwloc.so.15")
        _install_file(directory / "libhwloc.so.15", real[0].read_bytes())


def _run(command: list[str], cwd: str, what: str) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise FabricLibsError(f"{what} failed: {done.stderr.strip()[-300:]} (as root, `apt-get update` first "
                              "may help)")


def _install_file(target: Path, data: bytes) -> None:
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    os.replace(tmp, target)  # atomic: a running process never sees half a library


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="neuron-disagg install-fabric-libs", description=(
        "Put what NIXL's LIBFABRIC plugin needs besides libfabric (on Neuron hosts a libcuda stub, the "
        "CUDA runtime library, hwloc; on GPU hosts the CUDA runtime library and hwloc) into one "
        "directory, and check the backend loads."))
    parser.add_argument("--dir", type=Path, default=None,
                        help=f"install here (default: {SYSTEM_DIR} as root, else {user_dir()})")
    parser.add_argument("--platform", choices=PLATFORMS, default="neuron",
                        help="the host's accelerator (default: neuron). cuda: no libcuda stub, ever: the "
                             "NVIDIA driver provides libcuda.so.1 (a stub left here earlier is removed)")
    args = parser.parse_args(argv)
    directory = args.dir or (SYSTEM_DIR if os.geteuid() == 0 else user_dir())
    try:
        provided = install(directory, platform=args.platform)
    except (FabricLibsError, libcuda_stub.StubError, OSError) as exc:
        print(f"neuron-disagg install-fabric-libs: {exc}", file=sys.stderr)
        return 1
    found = directory.resolve() in (SYSTEM_DIR.resolve(), user_dir().resolve())
    if args.platform == "cuda":  # serve adds the directory on Neuron hosts only; the AMI's units set it
        then = (f"The AMI's units have {SYSTEM_DIR} on LD_LIBRARY_PATH (/etc/neuron-disagg/fabric.env); "
                f"elsewhere set LD_LIBRARY_PATH={directory}:$LD_LIBRARY_PATH for vLLM yourself")
    elif found:
        then = f"`neuron-disagg serve` puts {directory} on vLLM's LD_LIBRARY_PATH"
    else:
        then = (f"`neuron-disagg serve` looks in {SYSTEM_DIR} and {user_dir()} only; elsewhere set "
                f"LD_LIBRARY_PATH={directory}:$LD_LIBRARY_PATH yourself")
    print(f"{directory}: {', '.join(provided) or 'nothing was missing'}; NIXL's LIBFABRIC backend loads. " + then)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
