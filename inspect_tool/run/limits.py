"""What a real run needs in memory, refused in one line before any work starts (`check_memory`).

A real run needs the weights (the abstract model's parameter bytes at their dtype; twice with gradients) plus
activations, estimated as `ACTIVATION_COPIES × batch × seq × max(emb, mlp, K·moe_mlp) × 4 bytes × layers` plus the
logits (`batch × seq × vocab × 4 bytes` per head, ×3 for softmax and gradient) and `RUNTIME_BYTES` for JAX itself;
the run is refused when that exceeds the memory available (`host.memory.available_memory`: the cgroup limit less its
usage, or MemAvailable, whichever is smaller). `INSPECT_CHECKPOINT_SKIP_MEMORY_CHECK=1` skips this estimate.
"""

from __future__ import annotations

import math
import os

import numpy as np

from inspect_tool import errors
from inspect_tool import model as model_lib
from inspect_tool.host import memory as host_memory
from inspect_tool.paramtree import params

ACTIVATION_COPIES = 12
RUNTIME_BYTES = 1 << 30


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
  return host_memory.available_memory()[0] is None or os.environ.get(host_memory.SKIP_ENV) == "1"


def _refuse_over(needed: int, weights: int, what: str) -> None:
  available, source = host_memory.available_memory()
  if needed > available:
    raise errors.InputError(
        f"{what} needs about {_gib(needed)} (weights {_gib(weights)}), available "
        f"{_gib(available)} ({source}); use a smaller model or a machine with more memory")
