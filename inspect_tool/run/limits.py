"""What cannot be built or run here, refused in one line before any work starts.

* Numbers: every float key must be finite (`routed_scaling_factor=nan` would run and report `loss nan`);
  every integer key must fit in int64.
* Sizes: no array may hold 2^62 elements or more (shapes past int64 break XLA's size arithmetic), and
  `scan_layers=false` builds one Python module per layer, so at most `MAX_UNSCANNED_LAYERS` decoder or MTP
  layers are built that way (`base_num_decoder_layers=100000 scan_layers=false` would not finish).
* Memory (`check_memory`): a real run needs the weights (the abstract model's parameter bytes at their
  dtype; twice with gradients) plus activations, estimated as
  `ACTIVATION_COPIES × batch × seq × max(emb, mlp, K·moe_mlp) × 4 bytes × layers` plus the logits
  (`batch × seq × vocab × 4 bytes` per head, ×3 for softmax and gradient) and `RUNTIME_BYTES` for JAX
  itself; the run is refused when that exceeds the memory available (the cgroup limit less its usage, or
  MemAvailable, whichever is smaller). `INSPECT_CHECKPOINT_SKIP_MEMORY_CHECK=1` skips this estimate.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from inspect_tool import errors

INT64_MAX = 2**63 - 1
MAX_ELEMENTS = 2**62
MAX_UNSCANNED_LAYERS = 512
ACTIVATION_COPIES = 12
RUNTIME_BYTES = 1 << 30
SKIP_ENV = "INSPECT_CHECKPOINT_SKIP_MEMORY_CHECK"


def _numbers(name: str, value: Any):
  if isinstance(value, (list, tuple)):
    for item in value:
      yield from _numbers(name, item)
  elif isinstance(value, (int, float)) and not isinstance(value, bool):
    yield name, value


def check_numbers(values: dict[str, Any]) -> None:
  """Finite floats and int64 integers in every key (lists and tuples included)."""
  for key, value in values.items():
    for name, number in _numbers(key, value):
      if isinstance(number, float) and not math.isfinite(number):
        raise errors.ConfigError(f"{name}={number} is not a finite number")
      if isinstance(number, int) and not -INT64_MAX <= number <= INT64_MAX:
        raise errors.ConfigError(f"{name}={errors.shown(number)} does not fit in a 64-bit integer")


def _largest_arrays(cfg) -> dict[str, int]:
  """Element counts of the largest arrays the model would hold (per kind), from the config alone."""
  emb, layers = cfg.emb_dim, max(cfg.num_decoder_layers, 1)
  heads = max(cfg.num_query_heads, 1)
  return {  # what: (elements, the keys that size it)
      "token embedding / logits head": (cfg.vocab_size * emb, "vocab_size × base_emb_dim"),
      "routed experts": (layers * cfg.num_experts * emb * max(cfg.moe_mlp_dim, 1),
                         "base_num_decoder_layers × num_experts × base_emb_dim × base_moe_mlp_dim"),
      "dense MLP": (layers * emb * max(cfg.mlp_dim, 1), "base_num_decoder_layers × base_emb_dim × base_mlp_dim"),
      "attention": (layers * heads * max(cfg.qk_head_dim, cfg.v_head_dim, 1) * max(emb, cfg.q_lora_rank, 1),
                    "base_num_decoder_layers × base_num_query_heads × the head dims × base_emb_dim"),
  }


def check_config_numbers(cfg) -> None:
  """Refuses a config with a number that is not finite or past int64 (checked before any other rule, so that no
  message quotes a 4000-digit number)."""
  fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "passthrough"}
  check_numbers(fields)
  check_numbers(dict(getattr(cfg, "passthrough", {}) or {}))


def check_config(cfg) -> None:
  """Refuses a config whose model could not be built (see module doc); `check_config_numbers` ran first."""
  for what, (count, keys) in _largest_arrays(cfg).items():
    if count >= MAX_ELEMENTS:
      raise errors.ConfigError(f"the model's {what} would hold {count:.3g} elements (>= 2^62; {keys}); "
                               "no array that large can be built")
  if not cfg.scan_layers:
    for given, layers in ((f"base_num_decoder_layers={cfg.base_num_decoder_layers}", cfg.num_decoder_layers),
                          (f"mtp_num_layers={cfg.mtp_num_layers}", cfg.mtp_num_layers)):
      if layers > MAX_UNSCANNED_LAYERS:
        raise errors.ConfigError(f"{given} with scan_layers=false would build {layers} layer modules one by one; "
                                 f"at most {MAX_UNSCANNED_LAYERS} are built that way (use scan_layers=true)")


def _read_int(path: str) -> int | None:
  try:
    with open(path, encoding="ascii") as f:
      text = f.read().strip()
  except (OSError, UnicodeDecodeError):
    return None
  return int(text) if text.isdigit() else None


def memory_figures() -> tuple[int | None, int | None, int | None]:
  """(MemAvailable, the memory cgroup's limit, its usage) in bytes; None where unknown or unlimited."""
  mem_available = None
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          mem_available = int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                  "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
    limit = _read_int(limit_file)
    if limit is not None and limit < 2**60:
      return mem_available, limit, _read_int(usage_file)
  return mem_available, None, None


def available_memory() -> tuple[int | None, str]:
  """Bytes this process can still allocate, and where the figure comes from."""
  mem_available, limit, usage = memory_figures()
  found = [] if mem_available is None else [(mem_available, "MemAvailable")]
  if limit is not None:
    found.append((max(limit - (usage or 0), 0), "the cgroup memory limit less its usage"))
  return min(found) if found else (None, "unknown")


def _gib(n: int) -> str:
  return f"{n / 2**30:.1f} GiB"


def activation_bytes(cfg, batch: int, seq: int) -> int:
  """The activation estimate of the module docstring for one pass over a (batch, seq) token batch."""
  width = max(cfg.emb_dim, cfg.mlp_dim, cfg.num_experts_per_tok * cfg.moe_mlp_dim)
  heads = 1 + cfg.mtp_num_layers
  layers = cfg.num_decoder_layers + cfg.mtp_num_layers
  return ACTIVATION_COPIES * batch * seq * width * 4 * layers + 3 * heads * batch * seq * cfg.vocab_size * 4


def parameter_bytes(cfg) -> int:
  """Bytes of the model's variables at their dtypes, from the abstract model (nothing allocated)."""
  from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool.paramtree import params  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  leaves = params.param_leaves(model_lib.build_model(cfg, abstract=True), include_non_params=True)
  return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves)


def check_memory(cfg, batch: int, seq: int, *, grad: bool = False, what: str = "forward") -> None:
  """Refuses a run whose estimated memory exceeds what is available: "needs X, available Y"."""
  if _memory_unchecked():
    return
  weights = parameter_bytes(cfg) * (2 if grad else 1)
  _refuse_over(weights + activation_bytes(cfg, batch, seq) * (2 if grad else 1) + RUNTIME_BYTES, weights,
               f"{what} of {cfg.model_name}")


def check_init_memory(cfg, what: str) -> None:
  """Refuses building the whole seeded random init of `cfg`'s model when it cannot fit: the weights twice (JAX's
  arrays and their NumPy copies) plus `RUNTIME_BYTES`, against what is available."""
  if _memory_unchecked():
    return
  weights = parameter_bytes(cfg)
  _refuse_over(2 * weights + RUNTIME_BYTES, weights, f"{what} of {cfg.model_name}")


def _memory_unchecked() -> bool:
  return available_memory()[0] is None or os.environ.get(SKIP_ENV) == "1"


def _refuse_over(needed: int, weights: int, what: str) -> None:
  available, source = available_memory()
  if needed > available:
    raise errors.InputError(
        f"{what} needs about {_gib(needed)} (weights {_gib(weights)}), available "
        f"{_gib(available)} ({source}); use a smaller model or a machine with more memory")
