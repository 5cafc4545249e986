"""XLA's verdict from any host, held against a real TPU. Runs on a TPU host (here: one v5e chip, lent for minutes);
its output is recorded in tests/data/xla_ref/tpu_v5e_device_check.json and docs/sharding-and-memory.md.

For each batch of deepseek3-tiny with MTP trained with AdamW on `v5e-1` (one chip), three figures side by side:
  aot     the training step compiled for the topology `v5e-1` from its description: what `maxtext --compile` does
          on any host (`xla_compile.build.compile_program`), its peak (code + arguments + outputs - aliases + temps);
  device  the same program compiled for this host's own chip: its CompiledMemoryStats' peak, and aot / device;
  run     the step run once on the chip with real arrays (random init on the host, put on the chip): its loss, and
          the chip allocator's `peak_bytes_in_use` (the buffers put there; it does not count the program's
          temporaries, which the TPU runtime reserves apart).
A batch XLA refuses for lack of HBM must be refused by the chip's own compiler too. Each batch runs in a process
of its own (the allocator's peak never goes down).

Run on the TPU host, with the project's dependencies importable:
  python scripts/tpu_device_check.py [--batches 96,40,1] [--length 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ["model_name=deepseek3-tiny", "mtp_num_layers=1"]
GIB = 2**30


def _case(batch: int, length: int) -> dict:
  """One batch in this process: aot, device and run figures (see the module's docstring)."""
  # lazy: JAX and the model, only in the child process that measures one batch
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.xla_compile import build  # pylint: disable=import-outside-toplevel
  from inspect_tool.xla_compile import optimizers  # pylint: disable=import-outside-toplevel

  cfg = config.resolve_config([*KEYS, f"per_device_batch_size={batch}", f"max_target_length={length}"])
  chip = jax.devices("tpu")[0]  # the chip's runtime first, then the compile-only topology beside it
  aot = build.compile_program(cfg, "v5e-1", train="adamw")
  out = {"batch": batch, "length": length, "aot_peak": aot.peak, "aot_refusal": aot.refusal,
         "chip_memory": chip.memory_stats().get("bytes_limit"), "chip": chip.device_kind}
  lowered, abstract = build.lower(cfg, [chip], train="adamw")
  try:
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except  (XLA's refusal on the chip)
    out["device_refusal"] = str(e).splitlines()[0][:300]
    return out
  stats = build.figures(compiled)["stats"]
  out["device_peak"] = (stats["generated_code_size_in_bytes"] + stats["argument_size_in_bytes"]
                        + stats["output_size_in_bytes"] - stats["alias_size_in_bytes"] + stats["temp_size_in_bytes"])
  out["device_stats"] = stats
  with jax.default_device(jax.devices("cpu")[0]):
    _, params, rest = nnx.split(model_lib.build_model(cfg, abstract=False, seed=0), nnx.Param, ...)
    params, rest = jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, rest)
  rng = np.random.default_rng(0)
  rows, vocab = abstract.batch["inputs"].shape[0], int(cfg.vocab_size)
  tokens = rng.integers(0, vocab, (rows, length), dtype=np.int32)
  host_batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
                "inputs_position": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
                "targets_position": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
                "inputs_segmentation": np.ones((rows, length), np.int32),
                "targets_segmentation": np.ones((rows, length), np.int32)}
  tx = optimizers.optimizer(cfg, "adamw")
  params = jax.device_put(params, abstract.params_sharding)
  rest = jax.device_put(rest, abstract.rest_sharding)
  batch_on_chip = {k: jax.device_put(v, abstract.batch_sharding[k]) for k, v in host_batch.items()}
  opt_state = jax.jit(tx.init)(params)
  try:
    _, _, metrics = compiled(params, opt_state, rest, batch_on_chip)
    out["loss"] = float(jnp.asarray(metrics["loss"]))
  except Exception as e:  # pylint: disable=broad-except  (an out-of-memory run)
    out["run_error"] = str(e).splitlines()[0][:300]
  out["run_peak"] = chip.memory_stats().get("peak_bytes_in_use")
  return out


def _row(r: dict) -> str:
  def g(b):
    return "-" if b is None else f"{b / GIB:6.2f}"
  aot = g(r["aot_peak"]) if r["aot_refusal"] is None else "refused"
  device = g(r.get("device_peak")) if "device_refusal" not in r else "refused"
  ratio = f"{r['aot_peak'] / r['device_peak']:.4f}" if r.get("device_peak") and r["aot_peak"] else "-"
  ran = "failed" if "run_error" in r else ("-" if "loss" not in r else f"ran, loss {r['loss']:.3f}")
  return f"{r['batch']:>5} {aot:>9} {device:>9} {ratio:>10}   {ran}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", default="96,40,1")
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--case", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.case is not None:
    print(json.dumps(_case(args.case, args.length)))
    return
  print(f"deepseek3-tiny, MTP 1, AdamW, max_target_length={args.length}, one chip; GiB per chip")
  print(f"{'batch':>5} {'aot':>9} {'device':>9} {'aot/device':>10}   on the chip")
  rows = []
  for batch in (int(b) for b in args.batches.split(",")):
    done = subprocess.run([sys.executable, __file__, "--case", str(batch), "--length", str(args.length)],
                          capture_output=True, text=True, cwd=REPO, check=False)
    if done.returncode != 0:
      print(f"{batch:>5} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
      continue
    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(_row(rows[-1]), flush=True)
  print(json.dumps(rows))


if __name__ == "__main__":
  main()
