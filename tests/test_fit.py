"""`maxtext --devices/--topology --train`: the fit verdict knows the chip, adds the activation estimate, and a plan
that does not fit says how many devices it needs and whether bfloat16 weights would fit.

Expected numbers are worked out here by hand: per-device elements from MaxText's own shard shapes
(`tests/data/sharding/tiny_fsdp4_ep2.txt`), the chips' memory from their data sheets, and the activation estimate
from the formula of `inspect_tool/sharding/activations.py` written out with the tiny model's sizes.
"""

import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

from inspect_tool import cli
from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.sharding import mesh as mesh_lib
from test_sharding import DATA, read_reference

TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "ici_fsdp_parallelism=4", "ici_expert_parallelism=2"]
GIB, GB = 2**30, 10**9


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def _json(capsys, *argv):
  code, out, err = run(capsys, "maxtext", *argv, "--format", "json")
  return code, json.loads(out)["device_memory"], err


@pytest.mark.parametrize("topology, devices, memory", [
    ("v4-8", 4, 32 * GIB), ("v4-512", 256, 32 * GIB), ("v5e-256", 256, 16 * GIB), ("v5p-512", 256, 95 * GIB),
    ("v6e-64", 64, 32 * GIB), ("tpu7x-128", 128, 192 * GIB), ("a3", 8, 80 * GB), ("h100-8", 8, 80 * GB),
    ("h200-8", 8, 141 * GB), ("b200-8", 8, 180 * GB)])
def test_topology_sets_devices_and_the_memory_of_one_device(topology, devices, memory):
  assert mesh_lib.topology_devices(topology) == devices
  assert mesh_lib.topology_chip(topology).memory == memory


def test_topology_gives_the_verdict_and_device_memory_overrides_it(capsys):
  keys = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "ici_fsdp_parallelism=-1"]
  code, mem, _ = _json(capsys, *keys, "--topology", "v5e-8", "--train", "adamw", "per_device_batch_size=1",
                       "max_target_length=64")
  assert code == 0 and mem["device_memory_bytes"] == 16 * GIB and mem["fits"] is True
  assert mem["device_memory_source"] == "v5e (16GiB per device, --topology v5e-8)"
  code, mem, _ = _json(capsys, *keys, "--topology", "v5e-8", "--train", "adamw", "--device-memory", "1MB")
  assert code == 1 and mem["device_memory_bytes"] == 10**6 and mem["device_memory_source"] == "--device-memory"
  code, out, _ = run(capsys, "maxtext", *keys, "--topology", "v5e-8", "--summary", "--train", "adamw",
                     "per_device_batch_size=1", "max_target_length=64")
  assert code == 0 and "v5e (16GiB per device, --topology v5e-8): 16.00 GiB: fits" in out


def test_a_chip_name_alone_takes_the_device_count_from_devices(capsys):
  code, mem, _ = _json(capsys, *TINY, "--topology", "h100", "--devices", "8", "--train", "sgd")
  assert code == 0 and mem["device_memory_bytes"] == 80 * GB
  code, out, err = run(capsys, "maxtext", *TINY, "--topology", "h100")
  assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
  assert "--topology h100 names a chip" in err and "--devices N" in err


def _per_device_elements():
  """(elements one device holds of every Param, of those the ones sharded over fsdp): MaxText's shard shapes."""
  _, _, _, variables = read_reference(os.path.join(DATA, "tiny_fsdp4_ep2.txt"))
  params = {k: v for k, v in variables.items() if not k.endswith("gate.bias")}
  total = sum(math.prod(shard) for _, _, shard, _ in params.values())
  on_fsdp = sum(math.prod(shard) for _, spec, shard, _ in params.values() if "'fsdp'" in spec)
  return total, on_fsdp


# The tiny preset (61 layers, vocab 129280) with per_device_batch_size=1, max_target_length=64. The estimate of the
# step's temporaries is held to XLA's own figures by tests/test_xla_grid.py and its terms by
# tests/test_activations.py; here it is read from the plan (`_estimate`) and the exact bytes are worked out by hand.
SMALL = ["per_device_batch_size=1", "max_target_length=64"]


def _estimate(capsys, *keys, devices=8):
  """The plan's estimate record (`device_memory.activations`) of the tiny model with `keys` on `devices`."""
  code, mem, _ = _json(capsys, *keys, "--devices", str(devices), "--train", "adamw")
  assert code == 0
  return mem["activations"]


def test_verdict_adds_the_activation_estimate_to_the_exact_bytes(capsys):
  total, _ = _per_device_elements()
  code, mem, _ = _json(capsys, *TINY, *SMALL, "--devices", "8", "--train", "adamw")
  est = mem["activations"]
  assert code == 0 and est["estimate"] is True and est["total_bytes"] == sum(est["parts"].values())
  assert mem["largest_device_bytes"] == 16 * total and mem["needed_bytes"] == 16 * total + est["total_bytes"]
  code, out, _ = run(capsys, "maxtext", *TINY, *SMALL, "--devices", "8", "--summary", "--train", "adamw")
  hb = summary_lib.human_bytes
  assert (f"Plus XLA's temporaries beyond the gradients, and its code (estimate, per_device_batch_size=1, "
          f"max_target_length=64, remat_policy=full, peak in the {est['peak_phase']}): {hb(est['total_bytes'])} = "
          f"{hb(mem['needed_bytes'])} needed per device:") in out
  assert all(f"{hb(b):>10s}  {part}" in out for part, b in est["parts"].items() if b)


def test_a_plan_that_does_not_fit_names_the_devices_it_needs_and_whether_bf16_fits(capsys):
  total, on_fsdp = _per_device_elements()
  # fsdp 4 -> 8 (16 devices) halves what is sharded over fsdp: exactly enough.
  grown = _estimate(capsys, *TINY[:2], TINY[3], *SMALL, "ici_fsdp_parallelism=8", devices=16)["total_bytes"]
  doubled = 16 * (total - on_fsdp + on_fsdp // 2) + grown
  code, mem, err = _json(capsys, *TINY, *SMALL, "--devices", "8", "--train", "adamw", "--device-memory",
                         f"{doubled}B")
  assert code == 1 and mem["fits"] is False
  advice = mem["advice"]
  assert (advice["axis"], advice["axis_size"], advice["devices_needed"]) == ("fsdp", 4, 16)
  assert advice["bytes_per_device_there"] == doubled
  # bfloat16 weights: params, mu (mu_dtype unset: the weight dtype), nu and gradients at 2 bytes each.
  # The estimate does not shrink with them (the weight copies it counts are in bfloat16 already): it does not fit.
  bf16 = _estimate(capsys, *TINY, *SMALL, "weight_dtype=bfloat16")["total_bytes"]
  assert advice["bf16_weights_bytes_per_device"] == 8 * total + bf16 > doubled and advice["bf16_weights_fit"] is False
  assert len(err.strip().splitlines()) == 1
  line = _lines(err)["16 devices (fsdp=8)"]
  assert line == _cmd(*TINY[:2], TINY[3], *SMALL, "ici_fsdp_parallelism=8", "--summary", "--train", "adamw",
                      "--devices", "16", "--device-memory", f"{doubled}B")
  assert _plans_as_fitting(line)
  assert "weight_dtype=bfloat16 would not fit on these devices" in err
  # Room for a third of what follows the state (the fsdp-sharded bytes and the estimate's share that shrinks with
  # them): the search starts at fsdp 12, which does not divide the embedding's 64, and fsdp 16 × expert 2 does not
  # divide wkv_b's kv_lora_rank 16 (nor does any larger fsdp): no device count of this shape fits.
  est = mem["activations"]
  fixed = est["total_bytes"] - est["with_state_bytes"]
  tight = 16 * (total - on_fsdp) + fixed + math.ceil((16 * on_fsdp + est["with_state_bytes"]) / 3)
  code, mem, err = _json(capsys, *TINY, *SMALL, "--devices", "8", "--train", "adamw", "--device-memory",
                         f"{tight}B")
  assert code == 1 and mem["advice"]["devices_needed"] is None
  assert "no fsdp size from fsdp=12 to 264 divides every sharded dimension" in err


def test_no_device_count_fits_when_the_unsharded_bytes_and_activations_do_not(capsys):
  total, on_fsdp = _per_device_elements()
  est = _estimate(capsys, *TINY, *SMALL)
  fixed = est["total_bytes"] - est["with_state_bytes"]
  code, mem, err = _json(capsys, *TINY, *SMALL, "--devices", "8", "--train", "adamw", "--device-memory",
                         f"{16 * (total - on_fsdp) + fixed}B")
  assert code == 1 and mem["advice"]["devices_needed"] is None
  assert "no number of devices fits by growing fsdp" in err and "is not sharded over fsdp" in err


def _cmd(*argv) -> str:
  return shlex.join(["inspect_checkpoint", "maxtext", *argv])


def _lines(err: str) -> dict[str, str]:
  """The advice's ways in the one stderr line: change -> command line."""
  return dict(re.findall(r"fits with ([^;:]+): (inspect_checkpoint [^;]+)", err))


def _plans_as_fitting(line: str) -> bool:
  """Runs `line` as printed (the installed `inspect_checkpoint` script) and says whether its plan fits."""
  argv = shlex.split(line)
  script = os.path.join(os.path.dirname(sys.executable), argv[0])
  proc = subprocess.run([script, *argv[1:]], capture_output=True, text=True, timeout=300, check=False,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  return proc.returncode == 0 and proc.stderr == "" and re.search(r": fits\n", proc.stdout) is not None


def test_when_the_activations_do_not_fit_beside_the_state_the_advice_names_the_batch_and_length_that_do(capsys):
  """The estimate grows with the tokens: with room beside the state for its figure at batch 2 × length 64, batch 4
  at length 64 fits as batch 2, or as length 32 at batch 4 (the same 128 tokens), or on twice the devices (the
  state halves); the note says how much of the device the temporaries take."""
  total, _ = _per_device_elements()
  two = _estimate(capsys, *TINY, "per_device_batch_size=2", "max_target_length=64")["total_bytes"]
  limit = 16 * total + two + 1000
  keys = [*TINY, "per_device_batch_size=4", "max_target_length=64"]
  flags = ["--devices", "8", "--device-memory", f"{limit}B"]
  _, mem4, _ = _json(capsys, *keys, "--train", "adamw", *flags)  # at this device's room: its second bf16 logits
  four = mem4["activations"]  # copy rematerialised, as XLA does past the device (`sharding.activations`)
  code, _, err = run(capsys, "maxtext", *keys, "--summary", "--train", "adamw", *flags)
  assert code == 1 and len(err.strip().splitlines()) == 1
  hb = summary_lib.human_bytes
  fixed = four["total_bytes"] - four["with_state_bytes"]
  assert fixed < four["total_bytes"] < limit  # the temporaries leave too little for the state; more devices halve it
  assert (f"the step's temporaries take {hb(four['total_bytes'])} (estimate, per_device_batch_size=4, "
          f"max_target_length=64, remat_policy=full) of a device's {hb(limit)}, leaving "
          f"{hb(limit - four['total_bytes'])} for the parameters") in err
  lines = _lines(err)
  assert list(lines) == ["per_device_batch_size=2 instead of 4", "max_target_length=32 instead of 64",
                         "16 devices (fsdp=8)"]
  assert lines["per_device_batch_size=2 instead of 4"] == _cmd(
      *TINY, "max_target_length=64", "per_device_batch_size=2", "--summary", "--train", "adamw", *flags)
  assert lines["max_target_length=32 instead of 64"] == _cmd(
      *TINY, "per_device_batch_size=4", "max_target_length=32", "--summary", "--train", "adamw", *flags)
  assert all(_plans_as_fitting(line) for line in lines.values())
  code, mem, _ = _json(capsys, *keys, "--train", "adamw", *flags)
  ways = mem["advice"]["ways"]
  assert [w["bytes_per_device"] for w in ways][:2] == [16 * total + two] * 2
  assert ways[2]["bytes_per_device"] < limit
  assert [w["command"] for w in ways] == list(lines.values())


def test_a_remat_policy_that_saves_every_layer_is_named_with_the_batch_that_fits_under_full(capsys):
  """Room for the estimate of batch 3 under remat_policy=full: batch 4 under `minimal` fits as full at batch 3."""
  total, _ = _per_device_elements()
  three = _estimate(capsys, *TINY, "max_target_length=64", "per_device_batch_size=3")["total_bytes"]
  limit = 16 * total + three + 1000
  flags = ["--devices", "8", "--device-memory", f"{limit}B"]
  code, _, err = run(capsys, "maxtext", *TINY, *SMALL, "per_device_batch_size=4", "remat_policy=minimal", "--train",
                     "adamw", *flags)
  assert code == 1
  line = _lines(err)["remat_policy=full instead of minimal, per_device_batch_size=3"]
  assert line == _cmd(*TINY, "max_target_length=64", "remat_policy=full", "per_device_batch_size=3", "--summary",
                      "--train", "adamw", *flags)
  assert _plans_as_fitting(line)


def test_when_the_activations_alone_fill_a_device_the_batch_and_the_devices_change_together(capsys):
  """At length 16 (the shortest the advice offers) and a batch whose temporaries exceed a device, nothing fits on
  8 devices: not a smaller batch, not a shorter length; at batch 1, fsdp 4 -> 8 does, exactly."""
  total, on_fsdp = _per_device_elements()
  grown = _estimate(capsys, *TINY[:2], TINY[3], "max_target_length=16", "per_device_batch_size=1",
                    "ici_fsdp_parallelism=8", devices=16)["total_bytes"]
  limit = 16 * (total - on_fsdp + on_fsdp // 2) + grown
  batch = 64
  est = _estimate(capsys, *TINY, "max_target_length=16", f"per_device_batch_size={batch}")
  assert est["total_bytes"] - est["with_state_bytes"] >= limit
  flags = ["--devices", "8", "--device-memory", f"{limit}B"]
  code, mem, err = _json(capsys, *TINY, "max_target_length=16", f"per_device_batch_size={batch}", "--train", "adamw",
                         *flags)
  assert code == 1 and mem["advice"]["devices_needed"] is None
  assert "the step's temporaries alone fill a device" in err and "on any number of devices" in err
  assert list(_lines(err)) == ["per_device_batch_size=1 on 16 devices (fsdp=8)"]
  line = _lines(err)["per_device_batch_size=1 on 16 devices (fsdp=8)"]
  assert line == _cmd(*TINY[:2], "ici_expert_parallelism=2", "max_target_length=16", "per_device_batch_size=1",
                      "ici_fsdp_parallelism=8", "--summary", "--train", "adamw", "--devices", "16",
                      "--device-memory", f"{limit}B")
  assert mem["advice"]["ways"][0]["bytes_per_device"] == limit
  assert _plans_as_fitting(line)


def test_the_671b_on_v5p_8_gets_a_line_that_fits_and_says_the_activations_fill_the_device(capsys):
  """The case users met: MaxText's default batch (12) on a v5p-8; every line the advice prints plans as fitting."""
  code, out, err = run(capsys, "maxtext", "model_name=deepseek3-671b", "mtp_num_layers=1", "--topology", "v5p-8",
                       "--summary", "--train", "adamw")
  assert code == 1
  assert "The step's temporaries alone fill a device: " in out and "(estimate, per_device_batch_size=12" in out
  commands = [line.strip() for line in out.splitlines() if line.strip().startswith("inspect_checkpoint maxtext")]
  assert commands == list(_lines(err).values()) and commands
  assert all("per_device_batch_size=1" in c and "--topology v5p-512" in c for c in commands)
  assert all(_plans_as_fitting(c) for c in commands)
