"""The way of `export --output` through the code: every call of ours that receives the destination (the string, a
path under it, or an object holding one), in order, and how often the way returns to a module (or package) it had
already left. Issue 52 measures "stops" and "returns" over the first call of each function.

  python scripts/trace_output_path.py [--gcs] [--validate] [--list]

--gcs exports to gs:// on a local emulator (tests/gcs_emulator.py), --validate keeps the export's validation (its
read-back of the export is on the way too), --list prints the first calls in order. Measured on 2026-12-07, gs://
with validation: before the destination was resolved once (f775a4f) 100 call sites, by module 65 stops in 25 modules
and 40 returns, by package 43 stops in 9 and 34 returns; after it 89 call sites, by module 51 stops in 25 and 26
returns, by package 29 stops in 9 and 20 returns (docs/architecture.md, "The way of a destination"). A local
directory: 33 call sites, by package 16 stops in 5 and 11 returns, before and after.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from inspect_tool import cli  # noqa: E402  pylint: disable=wrong-import-position

L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full"]


def _holds(value, dst: str, depth: int = 0) -> bool:
  if isinstance(value, str):
    return value.startswith(dst)
  if depth < 1 and isinstance(value, (tuple, list)) and len(value) < 8:
    return any(_holds(v, dst, depth + 1) for v in value)
  if depth < 1 and hasattr(value, "__dict__") and not isinstance(value, type):
    return any(_holds(v, dst, depth + 1) for v in vars(value).values())
  return False


def trace(dst: str, validate: bool) -> tuple[int, list[tuple[str, str]]]:
  """The export's exit code and (module path, function) of every call of ours whose arguments hold `dst`."""
  calls = []

  def profile(frame, event, arg):  # pylint: disable=unused-argument
    if event != "call" or not frame.f_code.co_filename.startswith(ROOT):
      return
    where = os.path.relpath(frame.f_code.co_filename, ROOT)
    if not where.startswith(("inspect_tool", "quant")):
      return
    code = frame.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    if any(_holds(frame.f_locals[n], dst) for n in names if n in frame.f_locals):
      calls.append((where, code.co_name))

  argv = ["export", *L4, "--checkpoint", os.path.join(ROOT, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024"),
          "--output", dst, "--quiet", *([] if validate else ["--no-validate"])]
  sys.setprofile(profile)
  try:
    code = cli.main(argv)
  finally:
    sys.setprofile(None)
  return code, calls


def walk(calls, key) -> tuple[int, int, int]:
  """(stops, places, returns): a stop each time the way enters another place (`key` of the module path)."""
  stops, seen, returns, last = 0, set(), 0, None
  for where, _ in calls:
    place = key(where)
    if place != last:
      stops += 1
      returns += place in seen
      seen.add(place)
      last = place
  return stops, len(seen), returns


def _package(where: str) -> str:
  parts = where.split("/")
  return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def main() -> int:
  with contextlib.ExitStack() as stack:
    if "--gcs" in sys.argv:
      from gcs_emulator import emulator  # pylint: disable=import-outside-toplevel
      running = stack.enter_context(emulator(stack.enter_context(tempfile.TemporaryDirectory())))
      os.environ.update(running.env)
      running.create_bucket("trace-bucket")
      dst = "gs://trace-bucket/exports/out"
    else:
      dst = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "out")
    code, calls = trace(dst, "--validate" in sys.argv)
  firsts = list(dict.fromkeys(calls))
  module, package = walk(firsts, lambda w: w), walk(firsts, _package)
  print(f"export exit {code}; {len(firsts)} call sites on the way ({len(calls)} calls); by module: {module[0]} stops "
        f"in {module[1]} modules, {module[2]} returns; by package: {package[0]} stops in {package[1]}, "
        f"{package[2]} returns")
  if "--list" in sys.argv:
    print("\n".join(f"  {where}:{name}" for where, name in firsts))
  return code


if __name__ == "__main__":
  sys.exit(main())
