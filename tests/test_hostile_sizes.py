"""Sizes that cannot be built, numbers that are not numbers, runs that cannot fit in memory (issue 13, item 6)."""

import math
import os
import re

import numpy as np
import pytest

from inspect_tool.configuration import config
from inspect_tool.configuration import limits as config_limits
from inspect_tool.host import memory as host_memory
from inspect_tool.run import limits

from hostile import REPO, refused

LISTING_671B = os.path.join(REPO, "tests", "data", "listings", "deepseek3-671b_scan_mtp1.txt")


@pytest.mark.parametrize("keys, expected", [
    (["routed_scaling_factor=nan"], "routed_scaling_factor=nan is not a finite number"),
    (["routed_scaling_factor=-inf"], "routed_scaling_factor=-inf is not a finite number"),
    (["learning_rate=nan"], "learning_rate=nan is not a finite number"),  # a MaxText key the model does not use
    (["base_num_decoder_layers=1e12", "scan_layers=false"],
     "base_num_decoder_layers=1000000000000 with scan_layers=false would build 1000000000000 layer modules"),
    (["base_num_decoder_layers=100000", "scan_layers=false"],
     f"would build 100000 layer modules one by one; at most {config_limits.MAX_UNSCANNED_LAYERS}"),
    (["mtp_num_layers=100000", "scan_layers=false"], "mtp_num_layers=100000 with scan_layers=false"),
    ([f"base_emb_dim={2**63}"], f"base_emb_dim={2**63} does not fit in a 64-bit integer"),
    ([f"base_moe_mlp_dim={2**62}"], "the model's routed experts would hold"),
    ([f"base_emb_dim={2**50}"], "the model's token embedding / logits head would hold"),
    (["base_num_decoder_layers=1e18"], "no array that large can be built"),
])
def test_unbuildable_config_is_refused(capsys, keys, expected):
  refused(capsys, ["maxtext", "model_name=deepseek3-tiny", "override_model_config=true", *keys], expected)


def test_nan_scaling_factor_is_refused_before_the_forward_pass(capsys):
  refused(capsys, ["forward", "model_name=deepseek3-tiny", "override_model_config=true", "routed_scaling_factor=nan"],
          "routed_scaling_factor=nan is not a finite number")


def test_nan_in_a_model_file(capsys, tmp_path):
  path = tmp_path / "m.yml"
  path.write_text("model_name: deepseek3-tiny-nan\nbase_emb_dim: 64\nrouted_scaling_factor: .nan\n")
  refused(capsys, ["maxtext", f"model_file={path}"], "routed_scaling_factor=nan is not a finite number")


def _listing_bytes(path: str) -> int:
  total = 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      match = re.match(r"key: \S+ \| shape: \(([^)]*)\) \| dtype: (\w+)", line)
      if match:
        dims = [int(d) for d in match[1].split(",") if d.strip()]
        total += math.prod(dims) * np.dtype(match[2]).itemsize
  return total


def test_parameter_bytes_match_maxtexts_listing():
  """MaxText's 671B listing (Params) plus the two DeepSeek-V3 gate biases (58 MoE layers + MTP, 256 experts)."""
  cfg = config.resolve_config(["model_name=deepseek3-671b", "mtp_num_layers=1"])
  gate_bias_bytes = (58 * 256 + 256) * 4
  assert limits.parameter_bytes(cfg) == _listing_bytes(LISTING_671B) + gate_bias_bytes


def test_forward_671b_refuses_before_allocating(capsys):
  weights = _listing_bytes(LISTING_671B) + (58 * 256 + 256) * 4
  available, _ = host_memory.available_memory()
  assert available is not None and available < weights  # no machine this suite runs on holds 2.5 TB
  line = refused(capsys, ["forward", "model_name=deepseek3-671b", "mtp_num_layers=1"],
                 "forward of deepseek3-671b needs about", f"(weights {weights / 2**30:.1f} GiB), available")
  needed = float(re.search(r"needs about ([\d.]+) GiB", line)[1])
  assert weights / 2**30 < needed < weights / 2**30 * 1.01


def test_memory_check_compares_estimate_with_available(monkeypatch):
  cfg = config.resolve_config(["model_name=deepseek3-tiny"])
  needed = limits.parameter_bytes(cfg) + limits.activation_bytes(cfg, 2, 16) + limits.RUNTIME_BYTES
  monkeypatch.setattr(host_memory, "available_memory", lambda: (needed, "test"))
  limits.check_memory(cfg, 2, 16)  # exactly enough
  monkeypatch.setattr(host_memory, "available_memory", lambda: (needed - 1, "test"))
  with pytest.raises(limits.errors.InputError, match=f"needs about {needed / 2**30:.1f} GiB"):
    limits.check_memory(cfg, 2, 16)
  with pytest.raises(limits.errors.InputError):  # gradients double weights and activations
    limits.check_memory(cfg, 2, 16, grad=True)
