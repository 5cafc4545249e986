"""Benchmarks `inspect_checkpoint export` beside Orbax's own restore + save and beside the physical work, in one run.

Sources (float32, MaxText converter layout, `tests/export_sources.py`'s values), chunked as checkpoints are:
  * `single`: Orbax's default save as MaxText configures it (zarr3 + OCDBT, `PyTreeCheckpointHandler(use_ocdbt=True,
    use_zarr3=True)`): one chunk per array, at most 2 GiB (Orbax's local OCDBT target file size), zstd;
  * `400MiB`: Orbax's save with `SaveArgs(chunk_byte_size=400 MiB)` (what Orbax does on GCS);
  * `16MB`: the project's writer, 16 MB blocks along the first axis (a checkpoint written by many devices).
Each source's `--max-memory` floor is asked of the tool itself (its refusal line "accepted: at least X" for a
1 MB budget); the bounded cases run at 1.5x that floor. For each source, wall time, CPU time and peak RSS
(/usr/bin/time) of
  * Orbax: restore of the whole pytree, then the same default save (MaxText's configuration) to a new directory;
  * `export --no-validate` with the default --max-memory (half of the available memory), and with 1.5x the floor
    (both compared byte for byte afterwards; the exports of one model's sources are compared with each other too);
  * `export --layout deepseek-fp8`, unbounded and at 1.5x its own floor (first source of the run only);
  * the floor of the work: tensorstore's decode-only read of the source (every chunk once, chunk-aligned, two in
    flight, discarded) and its encode-only write of the output (the unbounded export's arrays, dtypes, chunks and
    codecs, written to a new OCDBT database; values loaded beforehand, no compute). Their seconds are the timed
    part of their process (not its start-up), CPU seconds likewise.
Decode amplification (bytes decoded / bytes stored, chunks decoded) is read from each export's
`quantization_report.json` (keys `chunks_decoded`, `bytes_decoded`, `bytes_stored`, `most_decoded_array`: the
shallowest of each in it; "n/a" when absent). Every case runs `--repeat` times (default 3), interleaved round
by round, each after `sync`, the order of the cases rotated by one each round (so that no case always follows the
same one, as the export followed Orbax's 4.5 GB run); medians (range) are printed, the peak RSS is the largest. A
case past `--case-timeout` (default 8x Orbax's first time, at least 120 s) is killed and not run again. The last
line per source extrapolates a 671B export (2.68 TB float32) from the bounded export's throughput: one host like
this one, and 16; a summary table ends the run.

`--baseline TREE` (a checkout of an earlier commit, e.g. `git worktree add /tmp/base e3eace2`) adds that tree's
export, unbounded and at the same --max-memory, run from it (its directory first on the path) in the same rounds,
and prints ours over it: the ratio of the medians and each round's (`export / export at TREE`).

  .venv-py3.12/bin/python bench/bench_export.py [--dir /tmp] [--only scanned|embedding|wide] [--chunks single,400MiB]
                                                [--repeat 3] [--keep] [--baseline TREE]

`--tiny` (a smoke run, seconds): the 5.6 MB 4-layer deepseek3-tiny source, `single` and 256 KiB chunks, one round.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import _measure  # noqa: E402  pylint: disable=wrong-import-position
from _work_floor import read_floor, stored_arrays, write_floor  # noqa: E402  pylint: disable=wrong-import-position

# scanned: 2.20 GB, routed experts (64, 3, 512, 1280) 503 MB each (two 252 MB chunks in the 400MiB re-save);
# embedding: 1.58 GB with a 1.26 GB (tied) embedding, 16 MB chunks; wide: 6.10 GB, 1.53 B parameters, routed
# experts (160, 3, 1024, 1024) 2.01 GB each (eight 252 MB chunks in the 400MiB re-save), the export-at-scale source.
VARIANTS = {
    "scanned": (["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_emb_dim=512",
                 "base_moe_mlp_dim=1280", "base_mlp_dim=1024", "num_experts=64", "vocab_size=32768",
                 "base_num_decoder_layers=4", "first_num_dense_layers=1"], ("single", "400MiB")),
    "embedding": (["model_name=deepseek3-tiny", "override_model_config=true", "mtp_num_layers=0", "base_emb_dim=512",
                   "vocab_size=614400", "logits_via_embedding=true", "base_moe_mlp_dim=256", "base_mlp_dim=1024",
                   "num_experts=64", "base_num_decoder_layers=4", "first_num_dense_layers=1"], ("16MB",)),
    "wide": (["model_name=deepseek3-tiny", "override_model_config=true", "mtp_num_layers=0", "base_emb_dim=1024",
              "base_moe_mlp_dim=1024", "num_experts=160", "vocab_size=1024", "base_num_decoder_layers=4",
              "first_num_dense_layers=1"], ("single", "400MiB")),
}
TINY = (["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
         "first_num_dense_layers=1", "vocab_size=1024"], ("single", "256KiB"))
CHUNKINGS = {"single": ("orbax", 0), "400MiB": ("orbax", 400 << 20), "256KiB": ("orbax", 256 << 10),
             "16MB": ("writer", 16 << 20)}  # name -> (who writes it, chunk bytes; 0: Orbax's default)
QUANT = ["quantization=fp8_full"]
FLOOR_FACTOR = 1.5  # the bounded cases' --max-memory, in floors
LIMIT_FACTOR, LIMIT_MIN = 8, 120  # default --case-timeout: 8x Orbax's first time, at least 120 s
DECODE_KEYS = ("chunks_decoded", "bytes_decoded", "bytes_stored", "most_decoded_array")
PARAMS_671B = 671e9

_ORBAX = r"""
import sys
import jax
import orbax.checkpoint as ocp
src, dst, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)) as c:  # MaxText's configuration
  tree = c.restore(src)
  c.save(dst, tree, save_args=jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk or None), tree))
"""


def _du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files)


def _same_arrays(a: str, b: str) -> bool:
  """Every array of two Orbax exports equal byte for byte (read in 16-row blocks)."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  x, y = stored_arrays(os.path.join(a, "0", "items")), stored_arrays(os.path.join(b, "0", "items"))
  if sorted(x) != sorted(y):
    return False
  for name, (store, _) in x.items():
    rows = store.shape[0] if store.shape else 1
    step = max(1, rows // 16)
    for start in range(0, rows, step):
      index = (slice(start, start + step),) if store.shape else ()
      if np.asarray(store[index].read().result()).tobytes() != np.asarray(y[name][0][index].read().result()).tobytes():
        return False
  return True


def _find(doc, name: str):
  """The shallowest value of key `name` (spaces, dashes and case ignored) in a JSON document, or None."""
  level = [doc]
  while level:
    deeper = []
    for node in level:
      items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
      for key, value in items:
        if isinstance(key, str) and key.lower().replace(" ", "_").replace("-", "_") == name:
          return value
        deeper.append(value)
    level = deeper
  return None


def decode_stats(dst: str) -> dict:
  """`chunks_decoded`, `bytes_decoded`, `bytes_stored` and their ratio from an export's report (None: absent)."""
  try:
    with open(os.path.join(dst, "quantization_report.json"), encoding="utf-8") as f:
      doc = json.load(f)
  except (OSError, ValueError):
    doc = {}
  stats = {key: _find(doc, key) for key in DECODE_KEYS}
  decoded, stored = stats["bytes_decoded"], stats["bytes_stored"]
  ok = isinstance(decoded, (int, float)) and isinstance(stored, (int, float)) and stored > 0
  stats["amplification"] = decoded / stored if ok else None
  return stats


def _amplification_text(stats: dict) -> str:
  if stats["amplification"] is None:
    return "n/a"
  chunks, worst = stats["chunks_decoded"], stats["most_decoded_array"]
  worst = (f", most {worst['decoded_per_stored']:.2f}: {'/'.join(worst['key'].split('/')[-2:])}"
           if isinstance(worst, dict) and isinstance(worst.get("decoded_per_stored"), (int, float))
           and isinstance(worst.get("key"), str) and "/" in worst["key"] else "")
  return f"{stats['amplification']:.2f}" + (f" ({chunks} chunks{worst})" if chunks is not None else "")


def _source_stats(step_dir: str) -> tuple[int, int, int, int]:
  """(bytes, arrays, chunks, largest chunk bytes) of a source, from its metadata."""
  nbytes = count = largest = 0
  arrays = stored_arrays(os.path.join(step_dir, "items"))
  for store, _ in arrays.values():
    chunk, itemsize = store.chunk_layout.read_chunk.shape, store.dtype.numpy_dtype.itemsize
    nbytes += math.prod(store.shape) * itemsize
    count += math.prod(-(-d // max(1, c)) for d, c in zip(store.shape, chunk))
    largest = max(largest, math.prod(min(d, c) for d, c in zip(store.shape, chunk)) * itemsize)
  return nbytes, len(arrays), count, largest


def make_source(root: str, name: str, tokens: list[str], chunking: str, env) -> tuple[str, float]:
  """The source of `name` chunked as `chunking` (step dir, seconds to write it); Orbax's are re-saved from the
  variant's 16 MB-chunk source (written once, kept at `root/name-base`)."""
  import export_sources  # pylint: disable=import-outside-toplevel

  base = os.path.join(root, f"{name}-base", "0")
  start = time.perf_counter()
  if not os.path.isdir(base):
    export_sources.write_source(base, tokens, chunk_bytes=CHUNKINGS["16MB"][1])
  who, nbytes = CHUNKINGS[chunking]
  if who == "writer":
    return base, time.perf_counter() - start
  step = os.path.join(root, f"{name}-{chunking}", "0")
  _measure.timed([sys.executable, "-c", _ORBAX, os.path.join(base, "items"), os.path.join(step, "items"),
                  str(nbytes)], env, cwd=REPO)
  return step, time.perf_counter() - start


def _cases(root: str, tool: list[str], source: str, bound: dict, hf: bool,
           baseline: str | None = None) -> list[tuple[str, str, list[str]]]:
  """(label, destination name, command) of every case; "DST" in a command stands for its destination."""
  me = [sys.executable, os.path.abspath(__file__)]
  cases = [("orbax restore+save", "orbax", [sys.executable, "-c", _ORBAX, os.path.join(source, "items"), "DST", "0"]),
           ("export", "unbounded", tool + ["--output", "DST"]),
           (f"export --max-memory {bound['orbax']} (1.5x floor)", "bounded",
            tool + ["--output", "DST", "--max-memory", bound["orbax"]])]
  if baseline:  # the same commands, run from the baseline's tree (its directory first on the path)
    base, name = ["sh", "-c", 'cd "$0" && PYTHONPATH="$0" exec "$@"', baseline] + tool, _tree_name(baseline)
    cases += [(f"export at {name}", "base_unbounded", base + ["--output", "DST"]),
              (f"export at {name} --max-memory {bound['orbax']}", "base_bounded",
               base + ["--output", "DST", "--max-memory", bound["orbax"]])]
  if hf:
    cases += [("export --layout deepseek-fp8", "hf", tool + ["--output", "DST", "--layout", "deepseek-fp8"]),
              (f"deepseek-fp8 --max-memory {bound['hf']} (1.5x floor)", "hf_bounded",
               tool + ["--output", "DST", "--layout", "deepseek-fp8", "--max-memory", bound["hf"]])]
  unbounded = os.path.join(root, "unbounded", "0")
  return cases + [("decode-only read of the source", "read", me + ["--read-floor", source]),
                  ("encode-only write of the output", "write", me + ["--write-floor", unbounded, "DST"])]


def _tree_name(tree: str) -> str:
  """A baseline tree's name in the output: its commit (short hash), or its directory's name."""
  done = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                        check=False)
  return done.stdout.strip() if done.returncode == 0 else os.path.basename(os.path.normpath(tree))


def _baseline_lines(tag: str, runs: dict, labels: dict) -> None:
  """Ours over the baseline's export, unbounded and bounded: the ratio of the medians and each round's."""
  for ours, theirs in (("unbounded", "base_unbounded"), ("bounded", "base_bounded")):
    if labels.get(ours) in runs and labels.get(theirs) in runs:
      a, b = runs[labels[ours]], runs[labels[theirs]]
      rounds = ", ".join(f"{x / y:.2f}" for x, y in zip(a["wall_seconds_runs"], b["wall_seconds_runs"]))
      print(f"[{tag}] {labels[ours]} / {labels[theirs]}: {a['wall_seconds'] / b['wall_seconds']:.2f} x (medians; "
            f"rounds {rounds}; CPU {a['cpu_seconds'] / b['cpu_seconds']:.2f} x)")


def _rounds(root: str, tag: str, cases, env, repeat: int, limit: float | None) -> dict[str, list]:
  """Runs every case `repeat` times, interleaved, each after `sync`, in an order rotated by one each round (Orbax
  first in the first round, which sets `limit`); the last round's destinations are kept, and the unbounded
  export's from round to round (the encode-only write reads it). A case killed at `limit` (default: from Orbax's
  first time) is not run again."""
  samples: dict[str, list] = {label: [] for label, _, _ in cases}
  skipped: set[str] = set()
  for round_ in range(repeat):
    for label, dst_name, cmd in cases[round_ % len(cases):] + cases[:round_ % len(cases)]:
      dst = os.path.join(root, dst_name)
      shutil.rmtree(dst, ignore_errors=True)
      if label in skipped or (dst_name == "write" and not os.path.isdir(os.path.join(root, "unbounded"))):
        continue
      os.sync()  # no earlier run's write-back under way
      run = _measure.timed([dst if c == "DST" else c for c in cmd], env, cwd=REPO, ok=(0, 1),
                           limit=None if dst_name == "orbax" else limit)
      if dst_name in ("read", "write") and not run.timed_out:  # the timed part, not the process's start-up
        wall, cpu, _, _ = run.stdout.split("FLOOR ", 1)[1].split()
        run = _measure.Run(float(wall), float(cpu), run.rss, run.returncode)
      samples[label].append(run)
      if dst_name == "orbax" and limit is None:
        limit = max(LIMIT_MIN, LIMIT_FACTOR * run.wall)
      if run.timed_out:
        shutil.rmtree(dst, ignore_errors=True)  # what a killed run left is no export
        skipped.add(label)
        print(f"[{tag}] {label}: killed at {limit:.0f} s (--case-timeout), not run again")
    if round_ < repeat - 1:
      for _, dst_name, _ in cases:
        if dst_name != "unbounded":
          shutil.rmtree(os.path.join(root, dst_name), ignore_errors=True)
  return {label: got for label, got in samples.items() if got}


def bench_source(root: str, tag: str, tokens: list[str], source: str, env, *, hf: bool, repeat: int,
                 limit: float | None, reference: str | None, baseline: str | None = None) -> dict:
  """Measures Orbax, the exports and the floor of the work on one source, `repeat` interleaved rounds."""
  logical, n_arrays, n_chunks, largest = _source_stats(source)
  out: dict = {"source": {"bytes": logical, "on_disk_bytes": _du(source), "arrays": n_arrays, "chunks": n_chunks,
                          "largest_chunk_bytes": largest}}
  print(f"[{tag}] source: {logical / 1e9:.2f} GB float32, {n_arrays} arrays in {n_chunks} chunks (largest "
        f"{largest / 1e6:.1f} MB), {_du(source) / 1e9:.2f} GB on disk")
  subprocess.run(["sh", "-c", 'cat "$@" > /dev/null', "cat"]
                 + [os.path.join(r, f) for r, _, fs in os.walk(source) for f in fs], check=True)  # warm cache
  tool = [sys.executable, "-m", "inspect_tool", "export", *tokens, *QUANT, "--checkpoint", source, "--format",
          "json", "--no-validate", "--quiet"]
  probe = os.path.join(root, "probe")
  floors = {"orbax": _measure.memory_floor(tool + ["--output", probe], env, cwd=REPO)}
  if hf:
    floors["hf"] = _measure.memory_floor(tool + ["--output", probe, "--layout", "deepseek-fp8"], env, cwd=REPO)
  shutil.rmtree(probe, ignore_errors=True)
  bound = {k: _measure.mib(FLOOR_FACTOR * v) for k, v in floors.items()}
  out["floor_bytes"] = floors
  print(f"[{tag}] smallest --max-memory the tool accepts: " + ", ".join(
      f"{'deepseek-fp8' if k == 'hf' else 'export'} {v / 2**20:.0f} MiB" for k, v in floors.items())
        + f"; bounded cases at {FLOOR_FACTOR}x")
  cases = _cases(root, tool, source, bound, hf, baseline)
  runs = {label: _measure.summary(got) for label, got in _rounds(root, tag, cases, env, repeat, limit).items()}
  orbax_s = runs["orbax restore+save"]["wall_seconds"]
  for label, r in runs.items():
    r["time_ratio_to_orbax"] = round(r["wall_seconds"] / orbax_s, 3)
    spread = f"{min(r['wall_seconds_runs']):.1f}-{max(r['wall_seconds_runs']):.1f}"
    more = "> " if r["timed_out"] else ""
    rss = r["peak_rss_bytes"] / 1e6 if r["peak_rss_bytes"] else math.nan
    print(f"[{tag}] {label:44s} {more}{r['wall_seconds']:7.1f} s ({spread})  CPU {r['cpu_seconds']:6.1f} s  "
          f"peak RSS {rss:6.0f} MB  {more}{r['time_ratio_to_orbax']:.2f} x Orbax's time  "
          f"{logical / r['wall_seconds'] / 1e6:5.0f} MB/s")
  labels = {dst_name: label for label, dst_name, _ in cases}
  _baseline_lines(tag, runs, labels)
  if all(labels[k] in runs for k in ("read", "write")):
    out["floor_seconds"] = floor_s = sum(runs[labels[k]]["wall_seconds"] for k in ("read", "write"))
    ratios = ", ".join(f"{'Orbax' if k == 'orbax' else labels[k]} {runs[labels[k]]['wall_seconds'] / floor_s:.2f} x"
                       for k in ("orbax", "unbounded", "bounded", "hf", "hf_bounded") if labels.get(k) in runs)
    print(f"[{tag}] floor of the work (decode-only read + encode-only write): {floor_s:.1f} s; {ratios} it")
  out["decode"] = {k: decode_stats(os.path.join(root, k)) for k in ("unbounded", "bounded", "hf", "hf_bounded")
                   if labels.get(k) in runs}
  print(f"[{tag}] decode amplification (bytes decoded / bytes stored): "
        + ", ".join(f"{labels[k]} {_amplification_text(s)}" for k, s in out["decode"].items()))
  for k, layout in (("bounded", "orbax"), ("hf_bounded", "hf")):
    if labels.get(k) in runs and not runs[labels[k]]["timed_out"]:
      budget = _measure.UNITS["MiB"] * int(bound[layout][:-3])
      print(f"[{tag}] {labels[k]}: peak RSS {runs[labels[k]]['peak_rss_bytes'] / 1e6:.0f} MB = "
            f"{runs[labels[k]]['peak_rss_bytes'] / budget:.2f} x its --max-memory")
  if all(os.path.isdir(os.path.join(root, d)) for d in ("unbounded", "bounded")):
    out["bounded_equals_unbounded"] = _same_arrays(os.path.join(root, "unbounded"), os.path.join(root, "bounded"))
    print(f"[{tag}] bounded export equals the unbounded one byte for byte: {out['bounded_equals_unbounded']}")
  if reference and os.path.isdir(os.path.join(root, "unbounded")):
    out["equals_reference"] = _same_arrays(reference, os.path.join(root, "unbounded"))
    print(f"[{tag}] export equals the export of the first source byte for byte: {out['equals_reference']}")
  bounded = runs.get(labels["bounded"])
  if bounded and not bounded["timed_out"]:
    rate = logical / bounded["wall_seconds"]
    one = PARAMS_671B * 4 / rate
    out["extrapolated_671b_seconds"] = {"one_host": round(one), "16_hosts": round(one / 16)}
    print(f"[{tag}] 671B (2.68 TB float32) at the bounded {rate / 1e6:.0f} MB/s: one host {one / 3600:.1f} h, "
          f"16 hosts {one / 16 / 3600:.2f} h")
  out["runs"] = runs
  out["by_case"] = {k: dict(runs[label], label=label) for k, label in labels.items() if label in runs}
  return out


def bench_variant(root: str, name: str, tokens: list[str], chunkings, env, *, hf: bool, repeat: int,
                  limit: float | None, baseline: str | None = None) -> dict:
  """Every chunking of one model's source, one after the other (each source removed after its cases)."""
  out: dict = {"model": tokens + QUANT}
  reference = None
  for i, chunking in enumerate(chunkings):
    tag = f"{name}/{chunking}"
    source, seconds = make_source(root, name, tokens, chunking, env)
    print(f"[{tag}] source written in {seconds:.1f} s")
    out[chunking] = bench_source(root, tag, tokens, source, env, hf=hf and i == 0, repeat=repeat, limit=limit,
                                 reference=reference, baseline=baseline)
    if i == 0 and len(chunkings) > 1:
      reference = os.path.join(root, f"{name}-reference-export")
      shutil.rmtree(reference, ignore_errors=True)
      if os.path.isdir(os.path.join(root, "unbounded")):
        os.rename(os.path.join(root, "unbounded"), reference)
      else:
        reference = None
    for d in ("orbax", "unbounded", "bounded", "hf", "hf_bounded", "read", "write", "base_unbounded", "base_bounded",
              f"{name}-{chunking}"):
      shutil.rmtree(os.path.join(root, d), ignore_errors=True)
  for d in (f"{name}-base", f"{name}-reference-export"):
    shutil.rmtree(os.path.join(root, d), ignore_errors=True)
  return out


def print_summary(results: dict) -> None:
  """One line per source: each case's median time as a multiple of Orbax's restore + save (target <= 1.00), its
  peak RSS, the floor of the work and the bounded export's decode amplification."""
  print("summary: median wall time / Orbax restore+save's (peak RSS GB); '>': killed at --case-timeout")
  names = {"unbounded": "export", "bounded": "1.5x floor", "hf": "deepseek-fp8", "hf_bounded": "fp8 1.5x floor"}
  print(f"{'source':18s} {'Orbax s':>8s} " + " ".join(f"{n:>15s}" for n in names.values())
        + f" {'floor s':>8s} {'decoded/stored':>15s}")
  for model, per_model in results.items():
    for chunking, out in per_model.items() if isinstance(per_model, dict) else ():
      if not isinstance(out, dict) or "by_case" not in out:
        continue
      by_case = out["by_case"]
      cells = []
      for kind in names:
        r = by_case.get(kind)
        cells.append(f"{'>' if r['timed_out'] else ''}{r['time_ratio_to_orbax']:.2f} ({r['peak_rss_bytes'] / 1e9:.1f})"
                     if r else "-")
      floor = f"{out['floor_seconds']:.1f}" if "floor_seconds" in out else "n/a"
      amp = out["decode"].get("bounded", {}).get("amplification")
      print(f"{model + '/' + chunking:18s} {by_case['orbax']['wall_seconds']:8.1f} "
            + " ".join(f"{c:>15s}" for c in cells) + f" {floor:>8s} {'n/a' if amp is None else f'{amp:.2f}':>15s}")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default=None, help="where to write (default: system temp)")
  parser.add_argument("--only", choices=sorted(VARIANTS), help="benchmark one model only")
  parser.add_argument("--chunks", help=f"comma-separated chunkings of the sources, of {sorted(CHUNKINGS)} "
                      "(default: the model's own)")
  parser.add_argument("--keep", action="store_true", help="keep the work directory (sources are removed)")
  parser.add_argument("--repeat", type=int, default=None,
                      help="rounds of every case, interleaved (median reported; default 3, 1 with --tiny)")
  parser.add_argument("--case-timeout", type=float, default=None, help="seconds before a case is killed")
  parser.add_argument("--tiny", action="store_true", help="smoke run: a 5.6 MB source, one round")
  parser.add_argument("--baseline", help="a checkout of an earlier commit whose export runs beside ours")
  parser.add_argument("--read-floor", help=argparse.SUPPRESS)
  parser.add_argument("--write-floor", nargs=2, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.read_floor:
    read_floor(args.read_floor)
    return 0
  if args.write_floor:
    write_floor(*args.write_floor)
    return 0
  chunks = tuple(args.chunks.split(",")) if args.chunks else None
  if chunks and not set(chunks) <= set(CHUNKINGS):
    parser.error(f"--chunks {args.chunks}: accepted: a comma-separated list of {', '.join(sorted(CHUNKINGS))}")
  root = os.path.abspath(tempfile.mkdtemp(prefix="bench_export_", dir=args.dir))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  results = {"machine": f"{os.cpu_count()} CPUs"}
  models = {"tiny": TINY} if args.tiny else {args.only: VARIANTS[args.only]} if args.only else VARIANTS
  try:
    for i, (name, (tokens, own)) in enumerate(models.items()):
      results[name] = bench_variant(root, name, tokens, chunks or own, env, hf=i == 0 and not args.tiny,
                                    repeat=args.repeat or (1 if args.tiny else 3), limit=args.case_timeout,
                                    baseline=args.baseline and os.path.abspath(args.baseline))
    print(json.dumps(results, indent=1))
    print_summary(results)
  finally:
    if args.keep:
      print(f"kept {root}")
    else:
      shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
