"""Every size a user gives is checked against what the program can represent before anything is traced or compiled
(issue 51, item 2): one line naming the key and the largest value accepted.

`maxtext KEYS per_device_batch_size=200000 --topology v5p-8 --compile` printed ~100 lines ending in an OverflowError
from `model/moe_dispatch.py` (JAX indexes each dimension with int32); `num_experts=3000000000` with `--summary`
broke the router's `top_k`; `per_device_batch_size=0.3`, `max_target_length=1000`, `max_target_length=1000000000`
and `num_slices=2` under `--compile` were tracebacks too; `mtp_num_layers=2147483648` never finished. The largest
values named are held to JAX itself: the step lowers at them and overflows one above
(`test_the_largest_batch_named_is_where_jax_overflows`), and the mask tables' size to JAX's own `process_mask`."""

import os
import subprocess
import sys
import tracemalloc

import pytest

from hostile import REPO, refused
from inspect_tool import cli
from inspect_tool.configuration import limits
from inspect_tool.xla_compile import libtpu

TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1"]
INT32 = "past 2^31-1, the largest dimension a traced program indexes (JAX's int32 indices)"


@pytest.mark.parametrize("argv, says", [
    (["maxtext", *TINY, "per_device_batch_size=200000", "--topology", "v5p-8", "--compile"],
     ["per_device_batch_size=200000: the routed experts would sort 3276800000 token copies per device", INT32,
      "largest accepted: per_device_batch_size=131071"]),
    (["maxtext", *TINY, "per_device_batch_size=1e9", "--topology", "v5p-8", "--compile", "--train", "adamw",
      "--summary"], ["per_device_batch_size=1000000000: the batch would hold 4000000000 sequences on 4 devices",
                     "largest accepted: per_device_batch_size=131071"]),
    (["export", *TINY, "quantization=fp8_full", "per_device_batch_size=200000", "--topology", "v5p-8", "--compile"],
     ["per_device_batch_size=200000: the routed experts", "largest accepted: per_device_batch_size=131071"]),
    (["maxtext", *TINY, "per_device_batch_size=70000", "ici_expert_parallelism=4", "ici_fsdp_parallelism=1",
      "--topology", "v5p-8", "--compile"],
     ["× 2, the ragged all-to-all buffer of 4 expert shards", "largest accepted: per_device_batch_size=65535"]),
    (["maxtext", *TINY, "per_device_batch_size=0.3", "--topology", "v5p-8", "--compile"],
     ["per_device_batch_size=0.3: 1 sequence(s) on 4 devices, which the batch's 4 shards (fsdp=4) do not divide",
      "accepted: a multiple of per_device_batch_size=1"]),
    (["maxtext", *TINY, "max_target_length=1000", "--topology", "v5p-8", "--compile"],
     ["max_target_length=1000: splash attention (attention=autoselected) cuts the sequence into blocks of "
      "sa_block_q=512", "accepted: a multiple of max_target_length=512"]),
    (["maxtext", *TINY, "max_target_length=1000000000", "--topology", "v5p-8", "--compile"],
     ["max_target_length=1000000000: the routed experts would sort", "largest accepted: max_target_length="]),
    (["maxtext", *TINY, "max_target_length=3000000000", "--topology", "v5p-8", "--compile"],
     ["max_target_length=3000000000: a sequence would pass 2^31-1", "largest accepted: max_target_length=2147483647"]),
    (["maxtext", *TINY, "num_slices=2", "--topology", "v5p-8", "--compile"],
     ["num_slices=2: --compile compiles for the devices of one --topology v5p-8 slice; accepted: num_slices=1"]),
    (["maxtext", *TINY, "sa_block_q=0", "--topology", "v5p-8", "--compile"],
     ["sa_block_q=0: splash attention's blocks must be a positive integer"]),
])
def test_a_size_the_compiled_step_cannot_hold_is_one_line(capsys, argv, says):
  refused(capsys, argv, *says)
  assert "TPU_WORKER_HOSTNAMES" not in os.environ  # refused before libtpu's start-up environment was set


_LOWER = """
import sys
from inspect_tool.configuration import config
from inspect_tool.xla_compile import build, sizes, topology
for pdbs in sys.argv[2:]:
  cfg = config.resolve_config([*sys.argv[1].split(), f"per_device_batch_size={pdbs}"])
  try:
    sizes.check(cfg, "v5p-8")
    checked = "accepted"
  except sizes.errors.ConfigError as e:
    checked = str(e)
  try:
    build.lower(cfg, topology.devices("v5p-8"))
    print(pdbs, "lowered", checked)
  except OverflowError:
    print(pdbs, "OverflowError", checked)
"""


@pytest.mark.parametrize("keys, largest", [([], 131071), (["ici_expert_parallelism=4", "ici_fsdp_parallelism=1"],
                                                          65535)])
def test_the_largest_batch_named_is_where_jax_overflows(keys, largest):
  """JAX lowers the tiny model's step on v5p-8 at the largest batch named and overflows one above (in a process of
  its own: compiling for a topology sets libtpu's environment)."""
  libtpu.require()
  result = subprocess.run([sys.executable, "-c", _LOWER, " ".join([*TINY, *keys]), str(largest), str(largest + 1)],
                          capture_output=True, text=True, cwd=REPO, timeout=600, check=False)
  lines = result.stdout.splitlines()
  assert len(lines) == 2, result.stderr[-3000:]
  assert lines[0] == f"{largest} lowered accepted", lines
  assert lines[1].startswith(f"{largest + 1} OverflowError per_device_batch_size={largest + 1}: ") and lines[1].endswith(
      f"largest accepted: per_device_batch_size={largest}"), lines


@pytest.mark.parametrize("length, block, dkv", [(32768, 256, False), (32768, 512, False), (32768, 256, True)])
def test_the_mask_tables_estimate_covers_what_jax_builds(length, block, dkv):
  """`sizes.mask_bytes` against the peak that JAX's own `process_mask` allocates (tracemalloc sees numpy's
  allocations): at least it, at most 2.5 times it."""
  from inspect_tool.xla_compile import sizes  # pylint: disable=import-outside-toplevel
  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib

  mask = mask_lib.MultiHeadMask((mask_lib.CausalMask((length, length)),))
  process = info_lib.process_mask_dkv if dkv else info_lib.process_mask
  process.func.cache_clear()  # `process_mask` keeps its results: measure a fresh build
  tracemalloc.start()
  try:
    process(mask, (block, block))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  estimate = sizes.mask_bytes(block, block, length)
  assert peak <= estimate <= 2.5 * peak, (peak, estimate)


@pytest.mark.parametrize("key, value, what", [
    ("num_experts", 3_000_000_000, "the router's scores"), ("vocab_size", 2**31, "the vocabulary"),
    ("qk_rope_head_dim", 2**31, "a query/key head's RoPE part"), ("max_target_length", 2**31, "a sequence")])
def test_a_dimension_past_int32_is_one_line_for_every_command(capsys, key, value, what):
  """Before: `num_experts=3000000000` with --summary (whose fp8 column traces the model) and `rules` were
  tracebacks from the router's `top_k`; `vocab_size` and `qk_rope_head_dim` from the embedding and RoPE."""
  keys = ["model_name=deepseek3-tiny", "override_model_config=true", f"{key}={value}"]
  line = f"{key}={value}: {what} would pass 2^31-1"
  for argv in (["maxtext", *keys, "--devices", "8", "--summary", "--train", "adamw"], ["rules", *keys],
               ["forward", *keys]):
    refused(capsys, argv, line, f"largest accepted: {key}={limits.INT32_MAX}")


@pytest.mark.parametrize("key", ["num_experts", "vocab_size"])
def test_the_largest_dimension_named_is_traced(capsys, key):
  """At 2^31-1 the model is traced (`rules` runs the abstract forward pass): the bound is JAX's, not below it."""
  keys = ["model_name=deepseek3-tiny", "override_model_config=true", f"{key}={limits.INT32_MAX}"]
  assert cli.main(["rules", *keys]) == 0
  capsys.readouterr()


def test_mtp_layers_are_bounded_with_scanned_layers_too():
  """The MTP block is built one layer module at a time even with scan_layers=true: 2^31 layers never finished."""
  result = subprocess.run([sys.executable, "-m", "inspect_tool", "maxtext", "model_name=deepseek3-tiny",
                           "mtp_num_layers=2147483648"], capture_output=True, text=True, cwd=REPO, timeout=120,
                          check=False)
  assert result.returncode == 2 and result.stderr == (
      "error: mtp_num_layers=2147483648 would build as many MTP layer modules one by one (MaxText's MTP block is never "
      f"scanned); largest accepted: mtp_num_layers={limits.MAX_UNSCANNED_LAYERS}\n"), result.stderr[-2000:]
