"""Whether this host has a TPU, and keeping JAX off libtpu where it has none.

With libtpu installed (the `tpu` extra, for compiling to a TPU topology), JAX's backend start-up would try the TPU
runtime on every command, also on a host without a TPU: libtpu then prints warnings about the TPU it cannot find.
`keep_cpu_host_on_cpu` avoids that before JAX starts: on a host without a TPU chip (no Google PCI device, the check
JAX itself makes) and without a GPU plugin, with libtpu installed and `JAX_PLATFORMS` unset, it sets
`JAX_PLATFORMS=cpu`. The TPU compiler is still reachable: compiling for a topology loads libtpu by itself
(`inspect_tool.xla_compile`). A host with a TPU, a GPU plugin or a `JAX_PLATFORMS` of the user's is left as it is.
"""

from __future__ import annotations

import glob
import warnings
import importlib.util
import os
import sys

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips' PCI vendor id
PCI_DEVICES = "/sys/bus/pci/devices"


def libtpu_installed() -> bool:
  """Whether the libtpu package is importable (found without importing it)."""
  return importlib.util.find_spec("libtpu") is not None


def tpu_chips_present(pci_root: str = PCI_DEVICES) -> bool:
  """Whether a Google PCI device (a TPU chip) is on this host."""
  for vendor in glob.glob(os.path.join(pci_root, "*", "vendor")):
    try:
      with open(vendor, encoding="ascii") as f:
        if f.read().strip().lower() == GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def gpu_plugin_installed() -> bool:
  """Whether a JAX GPU plugin (the `jax_plugins` namespace: CUDA, ROCm) is installed."""
  return importlib.util.find_spec("jax_plugins") is not None


def keep_cpu_host_on_cpu(environ=os.environ) -> bool:
  """Sets `JAX_PLATFORMS=cpu` on a host without a TPU or GPU when libtpu is installed (see the module's
  docstring); returns whether it did. Also applied to an imported JAX whose backends have not started."""
  if environ.get("JAX_PLATFORMS") or not libtpu_installed() or gpu_plugin_installed() or tpu_chips_present():
    return False
  environ["JAX_PLATFORMS"] = "cpu"
  jax = sys.modules.get("jax")
  if jax is not None and environ is os.environ:
    try:
      jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # backends already started: too late to change, nothing probed again
      pass
  return True


# XLA on a TPU keeps bf16 intermediates in float32 where it likes (excess precision) and, with it, drops a rounding to
# FP8 that a conversion back to bf16 follows; a CPU rounds each. Commands that compute values turn it off on a TPU.
CPU_ROUNDING_FLAG = "--xla_allow_excess_precision=false"
VALUE_COMMANDS = ("forward", "export", "import", "diff")
HUGEPAGES_WARNING = "Transparent hugepages are not enabled"  # JAX's advice on TPU VMs without them, at its import


def quiet_tpu_vm_advice() -> None:
  """JAX's start-up advice on a TPU VM (transparent hugepages) is not the command's output: left out of stderr."""
  warnings.filterwarnings("ignore", message=HUGEPAGES_WARNING, category=UserWarning)


def round_like_a_cpu(argv, environ=os.environ) -> bool:
  """Before JAX starts on a TPU host, for a command that computes values (not `--compile`): XLA rounds every bf16
  result and FP8 conversion as a CPU does (`CPU_ROUNDING_FLAG` added to XLA_FLAGS unless they name the flag already).
  Returns whether it set it."""
  argv = list(argv)
  if not argv or argv[0] not in VALUE_COMMANDS or "--compile" in argv:
    return False
  flags = environ.get("XLA_FLAGS", "")
  if "xla_allow_excess_precision" in flags or environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return False
  if not tpu_chips_present():
    return False
  environ["XLA_FLAGS"] = f"{flags} {CPU_ROUNDING_FLAG}".strip()
  return True
