"""Our `maxtext KEYS --topology T --compile --train OPT` for each case of a list, one at a time: XLA's per-device
figures of our training step beside MaxText 0.2.5's `train_compile` of the same keys (scripts/maxtext_compile_cases.sh).

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv-py3.12/bin/python scripts/ours_compile_cases.py \
        [CASES.txt ...] [--out DIR] [--force] [--only REGEX]

A case line is MaxText's: `NAME compile_topology=T compile_topology_num_slices=1 KEYS...` (blank lines and `#`
comments skipped); `compile_topology=T` becomes `--topology T`, `opt_type=X` (default adamw) `--train X`. CASES
default to tests/data/xla_family/family_cases.txt; DIR to tests/data/xla_ours. Each case runs the installed command in
a process of its own (`python -m inspect_tool maxtext ... --summary --format json`) and leaves DIR/NAME.json: the
keys, the command, our XLA figures (`xla`: `CompiledMemoryStats` fields, `peak_bytes`, `tpu_custom_calls`), the
plan's needed bytes, the exit status and wall time; a case already written is skipped unless --force. A program
compiled before (the same lowered program, topology and libtpu) is read from our compile cache
(docs/sharding-and-memory.md), so a re-run after a change recompiles only what the change touched.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = os.path.join(ROOT, "tests", "data", "xla_family", "family_cases.txt")
OUT = os.path.join(ROOT, "tests", "data", "xla_ours")


def cases(path):
  """(name, keys) of each case line of `path`."""
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if line and not line.startswith("#"):
        name, *keys = line.split()
        yield name, keys


def command(keys):
  """Our command line for MaxText's `train_compile` keys."""
  topology = next(k.split("=", 1)[1] for k in keys if k.startswith("compile_topology="))
  train = next((k.split("=", 1)[1] for k in keys if k.startswith("opt_type=")), "adamw")
  own = [k for k in keys if not k.startswith(("compile_topology", "opt_type="))]
  return ["maxtext", *own, "--topology", topology, "--compile", "--train", train, "--summary", "--format", "json"]


def _telling(err):
  """The line of `err` that says what went wrong: an exception's, else the last one."""
  lines = [line.strip() for line in err.splitlines() if line.strip()]
  found = [line for line in lines if re.match(r"[A-Za-z_.]*(Error|Exception)\b", line) or "does not fit" in line]
  return (found or lines or [""])[-1][:2000]


def run(name, keys, timeout):
  args = command(keys)
  env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=ROOT)
  start = time.monotonic()
  try:
    proc = subprocess.run([sys.executable, "-m", "inspect_tool", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False, cwd=ROOT)
    status, out, err = proc.returncode, proc.stdout, proc.stderr
  except subprocess.TimeoutExpired:
    status, out, err = None, "", f"timed out after {timeout} s"
  record = {"name": name, "keys": keys, "command": "inspect_checkpoint " + " ".join(args[:-4]), "exit": status,
            "wall_s": round(time.monotonic() - start, 1)}
  report = None
  if status in (0, 1) and out.strip():
    try:
      report = json.loads(out)
    except json.JSONDecodeError:
      report = None
  if report is not None and report.get("xla"):
    xla = report["xla"]
    record.update(ok=xla.get("train", {}).get("peak_bytes") is not None, xla=xla.get("train"),
                  libtpu=xla.get("libtpu"), devices=xla.get("devices"), plan_needed_bytes=xla.get("plan_needed_bytes"))
  else:
    record.update(ok=False, error_line=_telling(err))
  return record


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("cases", nargs="*", default=[CASES])
  parser.add_argument("--out", default=OUT)
  parser.add_argument("--force", action="store_true", help="compile cases already written again")
  parser.add_argument("--only", help="only the cases whose name matches this regular expression")
  parser.add_argument("--timeout", type=int, default=3600)
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  for path in args.cases:
    for name, keys in cases(path):
      target = os.path.join(args.out, name + ".json")
      if args.only and not re.search(args.only, name) or os.path.exists(target) and not args.force:
        continue
      print(f"{time.strftime('%H:%M:%S')} {name}", file=sys.stderr, flush=True)
      record = run(name, keys, args.timeout)
      with open(target + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
      os.replace(target + ".tmp", target)
      peak = (record.get("xla") or {}).get("peak_bytes")
      said = f"peak {peak / 2**30:.3f} GiB" if peak else record.get("error_line") or f"exit {record['exit']}"
      print(f"  {said} ({record['wall_s']} s)", file=sys.stderr, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
