"""The libcuda.so.1 stand-in that NIXL's LIBFABRIC plugin needs on Neuron hosts (see
libcuda_stub.c for why): built and checked here. ``fabric_libs`` (``neuron-disagg
install-fabric-libs``) puts it where ``neuron-disagg serve`` finds it, beside the other libraries
the plugin needs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("libcuda_stub.c")
LIBRARY = "libcuda.so.1"
SYMBOLS = ("cuCtxSetCurrent", "cuDeviceGetPCIBusId", "cuPointerGetAttributes")
CUDA_ERROR_NO_DEVICE = 100


class StubError(Exception):
    """The stub cannot be built or does not answer as it must; the message says what to do."""


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
