"""Run MaxText 0.2.5's own `train_compile` for a TPU topology and write XLA's CompiledMemoryStats as JSON.

Runs ONLY in MaxText's venv (MaxText 0.2.5 with its pins, plus `libtpu==0.0.50.1` and `ml_collections`):

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 /work/venvs/maxtext/bin/python scripts/maxtext_compile_memory.py \
        OUT.json compile_topology=v5p-8 compile_topology_num_slices=1 model_name=deepseek3-tiny ...

It calls `maxtext.trainers.pre_train.train_compile.main` unchanged (the same path as
`python -m maxtext.trainers.pre_train.train_compile KEYS`), keeps the compiled object it returns from
`jit_and_compile`, and writes one JSON: the keys, the equivalent MaxText command, every integer field of
`compiled.memory_analysis()`, the peak they imply, wall time, CPU time, load average and peak RSS of this process.
When the compile fails (XLA's HBM OOM, or a MaxText/Qwix error) the JSON holds the error's type, its telling line
and XLA's figures parsed from an OOM message instead of the stats; the exit status is then 1.
"""

import json
import os
import re
import resource
import sys
import time
import traceback

_GIB = 1024**3


def _stats(compiled):
  mem = compiled.memory_analysis()
  out = {}
  for name in dir(mem):
    if name.startswith("_"):
      continue
    value = getattr(mem, name)
    if isinstance(value, int) and not isinstance(value, bool):
      out[name] = value
  return out


def _oom_figures(message):
  """XLA's own numbers from a compile-time HBM OOM message, when it holds them."""
  figures = {}
  used = re.search(r"Used ([0-9.]+)([KMGT]?)i?B? of ([0-9.]+)([KMGT]?)i?B? hbm", message)
  unit = {"": 1, "K": 1024, "M": 1024**2, "G": _GIB, "T": 1024**4}
  if used:
    figures["used_bytes"] = round(float(used.group(1)) * unit[used.group(2)])
    figures["hbm_bytes"] = round(float(used.group(3)) * unit[used.group(4)])
  temps = re.search(r"memory required for HLO temporaries \(([0-9.]+)([KMGT]?)i?B?\) exceeds available HBM "
                    r"\(([0-9.]+)([KMGT]?)i?B?\)", message)
  if temps:  # libtpu 0.0.50's E1000 CompileTimeHbmOom: the temporaries alone
    figures["temp_bytes"] = round(float(temps.group(1)) * unit[temps.group(2)])
    figures["hbm_bytes"] = round(float(temps.group(3)) * unit[temps.group(4)])
  exceeded = re.search(r"Exceeded hbm capacity by ([0-9.]+)([KMGT]?)i?B?", message)
  if exceeded:
    figures["exceeded_bytes"] = round(float(exceeded.group(1)) * unit[exceeded.group(2)])
  return figures


def _telling_line(message):
  for pattern in ("RESOURCE_EXHAUSTED", "Ran out of memory", "cannot be both weights", "Error", "error"):
    for line in message.splitlines():
      if pattern in line:
        return line.strip()[:2000]
  return message.strip().splitlines()[-1][:2000] if message.strip() else ""


def main():
  out_path, keys = sys.argv[1], sys.argv[2:]
  from maxtext.trainers.pre_train import train_compile  # lazy: only in MaxText's venv

  captured = {}
  original = train_compile.jit_and_compile

  def keep(*args, **kwargs):
    compiled = original(*args, **kwargs)
    captured["compiled"] = compiled
    return compiled

  train_compile.jit_and_compile = keep
  record = {
      "keys": keys,
      "command": "ALLOW_MULTIPLE_LIBTPU_LOAD=1 python -m maxtext.trainers.pre_train.train_compile " + " ".join(keys),
      "wrapper": "python scripts/maxtext_compile_memory.py OUT.json " + " ".join(keys),
      "maxtext": "0.2.5",
  }
  try:
    import importlib.metadata as md

    record["versions"] = {p: md.version(p) for p in ("maxtext", "jax", "jaxlib", "libtpu", "flax", "qwix")}
  except Exception:  # pylint: disable=broad-except
    pass
  start = time.monotonic()
  record["loadavg_start"] = list(os.getloadavg())
  status = 0
  try:
    train_compile.main(["train_compile", *keys])
    record["ok"] = True
    stats = _stats(captured["compiled"])
    record["memory_analysis"] = stats
    record["peak_bytes"] = (
        stats["generated_code_size_in_bytes"]
        + stats["argument_size_in_bytes"]
        + stats["output_size_in_bytes"]
        - stats["alias_size_in_bytes"]
        + stats["temp_size_in_bytes"]
    )
    record["peak_gib"] = round(record["peak_bytes"] / _GIB, 3)
  except BaseException as exc:  # pylint: disable=broad-except
    status = 1
    message = str(exc)
    record["ok"] = False
    record["error_type"] = type(exc).__name__
    record["error_line"] = _telling_line(message)
    record["error_message"] = message[:6000]
    record["oom"] = "hbm" in message.lower()  # XLA refused for lack of HBM (not vector memory: E1001)
    record["oom_figures"] = _oom_figures(message)
    frames = traceback.extract_tb(exc.__traceback__)
    record["error_frames"] = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-8:]]
  record["wall_s"] = round(time.monotonic() - start, 1)
  usage = resource.getrusage(resource.RUSAGE_SELF)
  record["peak_rss_mb"] = round(usage.ru_maxrss / 1024)
  record["cpu_user_s"], record["cpu_system_s"] = round(usage.ru_utime, 1), round(usage.ru_stime, 1)
  record["loadavg_end"] = list(os.getloadavg())
  tmp = out_path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, out_path)
  print(f"wrote {out_path}: ok={record['ok']} wall {record['wall_s']} s, rss {record['peak_rss_mb']} MB", flush=True)
  return status


if __name__ == "__main__":
  sys.exit(main())
