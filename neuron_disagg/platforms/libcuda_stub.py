"""The libcuda.so.1 stand-in that NIXL's LIBFABRIC plugin needs on Neuron hosts (see
libcuda_stub.c for why): built, checked and found here, so any Neuron host gets it from the
package's own set-up step — ``neuron-disagg install-libcuda-stub`` — not only hosts baked from
our AMI. ``neuron-disagg serve`` puts the directory on vLLM's LD_LIBRARY_PATH; nothing else does.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("libcuda_stub.c")
LIBRARY = "libcuda.so.1"
SYMBOLS = ("cuCtxSetCurrent", "cuDeviceGetPCIBusId", "cuPointerGetAttributes")
CUDA_ERROR_NO_DEVICE = 100
#: Where the AMI installs it (ami/scripts/40-libcuda-stub.sh); searched first.
SYSTEM_DIR = Path("/opt/neuron-disagg/lib")


class StubError(Exception):
    """The stub cannot be built or does not answer as it must; the message says what to do."""


def user_dir() -> Path:
    cache = os.environ.get("NEURON_DISAGG_CACHE") or os.path.expanduser("~/.cache/neuron-disagg")
    return Path(cache) / "libcuda-stub"


def _stamp(directory: Path) -> Path:
    return directory / f".built-from-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}"


def real_libcuda_loads() -> bool:
    """A real NVIDIA driver library is installed: the stub would hide it. Only a real driver
    exports cuInit; the stub does not."""
    try:
        return hasattr(ctypes.CDLL(LIBRARY), "cuInit")
    except OSError:
        return False


def check(library: Path) -> None:
    """Load ``library`` and call each entry point: each must answer CUDA_ERROR_NO_DEVICE."""
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as exc:
        raise StubError(f"{library} does not load: {exc}") from None
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise StubError(f"{library} lacks {', '.join(missing)}")
    bus_id = ctypes.create_string_buffer(16)
    answers = [lib.cuCtxSetCurrent(None), lib.cuDeviceGetPCIBusId(bus_id, 16, 0),
               lib.cuPointerGetAttributes(0, None, None, ctypes.c_ulonglong(0))]
    if answers != [CUDA_ERROR_NO_DEVICE] * len(SYMBOLS):
        raise StubError(f"{library} answered {answers}, expected {CUDA_ERROR_NO_DEVICE} from each entry point")


def build(directory: Path, compiler: str | None = None, force: bool = False) -> Path:
    """Compile, check and install ``directory/libcuda.so.1`` (unchanged if already built from this
    source). Refuses where a real driver exists unless ``force``."""
    if real_libcuda_loads() and not force:
        raise StubError("a real libcuda.so.1 (NVIDIA driver) is installed; a stub would hide it. This "
                        "host needs no stub (use --force only if you know the driver is broken)")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / LIBRARY
    if target.exists() and _stamp(directory).exists():
        check(target)
        return target
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise StubError("no C compiler found: install gcc (apt-get install -y gcc / dnf install -y gcc) "
                        "or set CC")
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = Path(tmp) / LIBRARY
        done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror",
                               f"-Wl,-soname,{LIBRARY}", "-o", str(built), str(SOURCE)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise StubError(f"{compiler} could not build the stub:\n{done.stderr.strip()}")
        check(built)
        for old in directory.glob(".built-from-*"):
            old.unlink()
        os.replace(built, target)  # atomic: a running process never sees half a library
    _stamp(directory).touch()
    return target


def find() -> Path | None:
    """The directory of an installed stub built from this source, or None."""
    for directory in (SYSTEM_DIR, user_dir()):
        if (directory / LIBRARY).exists() and _stamp(directory).exists():
            return directory
    return None


def with_stub_on_library_path(env: dict[str, str], directory: Path) -> dict[str, str]:
    """``env`` with ``directory`` first on LD_LIBRARY_PATH."""
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p != str(directory)]
    return {**env, "LD_LIBRARY_PATH": ":".join([str(directory), *paths])}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="neuron-disagg install-libcuda-stub", description=(
        "Build the libcuda.so.1 stand-in NIXL's LIBFABRIC plugin needs on Neuron hosts (never on GPU hosts)."))
    parser.add_argument("--dir", type=Path, default=None,
                        help=f"install here (default: {SYSTEM_DIR} as root, else {user_dir()})")
    parser.add_argument("--force", action="store_true", help="build even where a real libcuda.so.1 loads")
    args = parser.parse_args(argv)
    directory = args.dir or (SYSTEM_DIR if os.geteuid() == 0 else user_dir())
    try:
        library = build(directory, force=args.force)
    except (StubError, OSError) as exc:
        print(f"neuron-disagg install-libcuda-stub: {exc}", file=sys.stderr)
        return 1
    found = directory.resolve() in (SYSTEM_DIR.resolve(), user_dir().resolve())
    print(f"{library}: built and checked (each entry point answers CUDA_ERROR_NO_DEVICE). "
          + (f"`neuron-disagg serve` puts {directory} on vLLM's LD_LIBRARY_PATH on Neuron hosts" if found else
             f"`neuron-disagg serve` looks in {SYSTEM_DIR} and {user_dir()} only; elsewhere set "
             f"LD_LIBRARY_PATH={directory}:$LD_LIBRARY_PATH yourself"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
