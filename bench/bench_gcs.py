"""Benchmarks `inspect_checkpoint export` to and from gs:// (a local GCS emulator) beside local -> local and beside
Orbax's own save of the same arrays to the same emulator, in one run.

Source: a float32 MaxText-layout checkpoint (`tests/export_sources.py`, 16 MB chunks), written locally and uploaded
to the emulator (`tests/gcs_emulator.py`: fake-gcs-server by default, `--emulator gcp-storage-emulator` for the
earlier one behind its proxy; started here on 127.0.0.1). Cases, each one process, wall time and peak RSS from
/usr/bin/time:
  * `export --no-validate` local -> local;
  * local -> gs:// (a new DST: every process writes its share straight into it, the commit marker last), and
    the same again with `--overwrite` over that export ("replacing": written under a staging prefix, then published
    by server-side copies so that the previous export stays whole until then: `inspect_tool/output/object_store.py`);
  * gs:// -> local and gs:// -> gs:// (the source read through tensorstore's gcs driver);
  * Orbax: `PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)` (MaxText's configuration) restores the local
    export's arrays, then saves them to the emulator (the same arrays to the same store), and to local disk; its
    save alone is timed inside the process too. Its data files on gs:// close at 400 MiB (Orbax's default there);
    a third case saves to gs:// with ours (`orbax_writer.REMOTE_DATA_FILE_BYTES`), for comparison.
Throughput is source bytes per wall second; `x local` is each case's wall time over local -> local's; the last lines
give local -> gs beside Orbax (time, and time beside Orbax's save alone; peak RSS; the median of each round's
ratio, the two cases of a round run close together), goal <= 1.2x, what writing
to gs:// adds to each: the export's local -> gs less its local -> local, Orbax's save to gs less its save to disk,
and the export's stages (writing the arrays, process 0's merge and checks, the manifest's read-back, publishing: the
pipeline's functions timed by a wrapper around the command) beside local -> local's.
The emulator runs on the same machine: the figures say what the protocol costs here, not what Cloud Storage's
bandwidth would give.

  .venv-py3.12/bin/python bench/bench_gcs.py [--dir /tmp] [--repeat 3] [--tiny] [--emulator fake-gcs-server]
      [--objects memory|files]

`--objects`: fake-gcs-server keeps the objects in its memory (the default) or in files under --dir. In files, most
of the emulator's time is the kernel copying each upload into the page cache of this machine (60-65% of its CPU
samples, `perf`), at a cost per byte that changed up to 3x between runs of the same upload here, and that is no
part of what Cloud Storage costs a client; in memory the emulator's time is the protocol's (HTTP, checksums).

Each round runs local -> local first, then the other cases rotated by one from the round before (`_order`).
`--tiny` (a smoke run): the 5.6 MB 4-layer deepseek3-tiny checkpoint of tests/data, one round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import gcs_emulator  # noqa: E402  pylint: disable=wrong-import-position
from inspect_tool.streaming import orbax_writer  # noqa: E402  pylint: disable=wrong-import-position

TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024"]
FULL = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_emb_dim=512",
        "base_moe_mlp_dim=512", "base_mlp_dim=1024", "num_experts=64", "first_num_dense_layers=1",
        "base_num_decoder_layers=4"]  # 1.36 GB float32 (bench_export.py's `scanned`)
QUANT = ["quantization=fp8_full"]
REPLACING = "local -> gs, replacing"
CASES = ("local -> local", "local -> gs", REPLACING, "gs -> local", "gs -> gs")
# The export with its stages timed: each prints "STAGE <name> <seconds>" (the pipeline's functions wrapped, no other
# change).
_EXPORT = r"""
import runpy, sys, time
from inspect_tool.fp8_export import pipeline
from inspect_tool.output import object_store
from inspect_tool.streaming import orbax_writer, write_orbax
def timed(owner, name, label):
  function = getattr(owner, name)
  def wrapper(*args, **kwargs):
    start = time.perf_counter()
    try:
      return function(*args, **kwargs)
    finally:
      print(f"STAGE {label} {time.perf_counter() - start:.3f}", flush=True)
  setattr(owner, name, wrapper)
for owner, name, label in ((write_orbax, "write_arrays", "write"), (orbax_writer.OrbaxArrayWriter, "finalize", "merge"),
                           (pipeline, "_write_manifest", "manifest"), (object_store, "publish", "publish")):
  timed(owner, name, label)
sys.argv = ["inspect_checkpoint", *sys.argv[1:]]
runpy.run_module("inspect_tool", run_name="__main__")
"""
STAGES = ("write", "merge", "manifest", "publish")
ORBAX, ORBAX_LOCAL = "orbax save -> gs", "orbax save -> local"
ORBAX_FILES = "orbax -> gs, our files"  # Orbax's save with our data-file size on gs://
PEERS = (ORBAX_LOCAL, ORBAX, ORBAX_FILES)
_ORBAX = r"""
import sys, time
import orbax.checkpoint as ocp
with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)) as c:  # MaxText's configuration
  tree = c.restore(sys.argv[1])
  start = time.perf_counter()
  if len(sys.argv) > 3:  # data files closed at this size (OCDBT's target_data_file_size)
    c.save(sys.argv[2], args=ocp.args.PyTreeSave(tree, ocdbt_target_data_file_size=int(sys.argv[3])))
  else:
    c.save(sys.argv[2], tree)
  print(f"SAVE {time.perf_counter() - start:.3f}")
"""


def _order(round_number: int) -> list[str]:
  """The cases of one round: local -> local first (its output is what Orbax restores), then the others rotated by
  the round's number, so that no case always follows the same one (the emulator's state carries over); replacing
  stays right after local -> gs, whose export it replaces."""
  units = [["local -> gs", REPLACING], ["gs -> local"], ["gs -> gs"], [ORBAX_LOCAL], [ORBAX], [ORBAX_FILES]]
  shift = round_number % len(units)
  return [CASES[0], *(case for unit in units[shift:] + units[:shift] for case in unit)]


def _timed(cmd: list[str], env) -> tuple[float, int, str]:
  """Wall seconds, peak RSS (bytes) and stdout of one process, from /usr/bin/time; a failure is raised with its
  stderr."""
  out = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M"] + cmd, capture_output=True, text=True, env=env,
                       cwd=REPO, check=False)
  if out.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd[3:8])} ... failed: {out.stderr[-2000:]}")
  _, wall, rss_kb = [l for l in out.stderr.splitlines() if l.startswith("TIME ")][-1].split()
  return float(wall), int(rss_kb) * 1024, out.stdout


def _source(root: str, tiny: bool) -> tuple[list[str], str, int]:
  """(model keys, local source step directory, its bytes)."""
  if tiny:
    src = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
  else:
    import export_sources  # pylint: disable=import-outside-toplevel
    src = os.path.join(root, "source")
    export_sources.write_source(os.path.join(src, "0"), FULL)
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(src) for f in files)
  return (TINY if tiny else FULL), src, size


def _remove(dst: str) -> None:
  """The previous round's output (each round writes a fresh DST)."""
  if dst.startswith("gs://"):
    from inspect_tool.storage import objects  # pylint: disable=import-outside-toplevel
    objects.delete_all(dst)
  else:
    shutil.rmtree(dst, ignore_errors=True)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--dir", default=None, help="where the local source, outputs and emulator data go")
  parser.add_argument("--repeat", type=int, default=3)
  parser.add_argument("--tiny", action="store_true", help="smoke run: the 5.6 MB tests/data source, one round")
  parser.add_argument("--emulator", default=gcs_emulator.FAKE_GCS,
                      choices=(gcs_emulator.FAKE_GCS, gcs_emulator.GCP_STORAGE_EMULATOR))
  parser.add_argument("--objects", default="memory", choices=("memory", "files"),
                      help="where fake-gcs-server keeps the objects (default: memory)")
  args = parser.parse_args()
  if args.objects == "memory" and args.emulator != gcs_emulator.FAKE_GCS:
    parser.error(f"--objects memory: {gcs_emulator.FAKE_GCS} only; accepted with --emulator {args.emulator}: "
                 "--objects files")
  repeat = 1 if args.tiny else args.repeat
  if args.dir:
    os.makedirs(args.dir, exist_ok=True)
  root = tempfile.mkdtemp(prefix="bench-gcs-", dir=args.dir)
  faithful = args.emulator == gcs_emulator.FAKE_GCS
  try:  # fake-gcs-server needs no proxy; gcp-storage-emulator works only behind it
    with gcs_emulator.emulator(Path(root) / "emulator", args.emulator, proxy=not faithful,
                               in_memory=args.objects == "memory") as gcs:
      os.environ.update(gcs.env)
      env = dict(os.environ, JAX_PLATFORMS="cpu")
      tokens, local_src, size = _source(root, args.tiny)
      remote_src = gcs.upload(local_src, f"gs://{gcs_emulator.BUCKET}/source")
      sources = {"local": local_src, "gs": remote_src}
      outputs = {"local": os.path.join(root, "out"), "gs": f"gs://{gcs_emulator.BUCKET}/out"}
      kept = os.path.join(root, "local-export")  # local -> local's output, which Orbax then restores and saves
      times: dict[str, list[float]] = {case: [] for case in (*CASES, *PEERS)}
      rss: dict[str, int] = {case: 0 for case in times}
      saves: dict[str, list[float]] = {case: [] for case in PEERS}
      stages: dict[str, dict[str, list[float]]] = {case: {stage: [] for stage in STAGES} for case in CASES}
      failed: dict[str, str] = {}
      for round_number in range(repeat):
        for case in _order(round_number):
          if case in failed:
            continue
          if case in PEERS:  # the local export's arrays (the first case's output, kept for this) saved again
            dst = f"gs://{gcs_emulator.BUCKET}/orbax" if case != ORBAX_LOCAL else os.path.join(root, "orbax")
            cmd = [sys.executable, "-c", _ORBAX, os.path.join(kept, "0", "items"), dst]
            if case == ORBAX_FILES:
              cmd.append(str(orbax_writer.REMOTE_DATA_FILE_BYTES))
          else:
            src, out = (part.strip() for part in case.split(",")[0].split("->"))
            dst = kept if case == CASES[0] else outputs[out]
            cmd = [sys.executable, "-c", _EXPORT, "export", *tokens, *QUANT, "--checkpoint", sources[src],
                   "--output", dst, "--no-validate", "--quiet", "--overwrite"]
          try:
            wall, peak, stdout = _timed(cmd, env)
          except RuntimeError as e:
            failed[case] = str(e).strip().splitlines()[-1][:160]
            continue
          times[case].append(wall)
          rss[case] = max(rss[case], peak)
          if case in PEERS:
            saves[case].append(float(stdout.split("SAVE ")[-1].split()[0]))
          else:
            for line in stdout.splitlines():
              if line.startswith("STAGE "):
                stages[case][line.split()[1]].append(float(line.split()[2]))
          if case not in (CASES[0], "local -> gs"):  # local -> gs's output is what REPLACING replaces
            _remove(dst)
        _remove(kept)
      base = statistics.median(times[CASES[0]])
      label = "tiny" if args.tiny else "scanned"
      print(f"[{label}] export --no-validate of a {size / 1e6:.1f} MB float32 source, median of {repeat}; "
            f"GCS = the local emulator ({args.emulator}, objects in {args.objects})")
      print(f"{'case':<24}{'wall s':>8}{'MB/s':>9}{'peak RSS MB':>13}{'x local':>9}")
      for case in (*CASES, *PEERS):
        if case in failed or not times[case]:
          reason = failed.get(case, "no run")
          if case.startswith("gs") and "does not exist" in reason:
            reason = "reading gs:// not available"
          print(f"{case:<24}  n/a ({reason})")
          continue
        wall = statistics.median(times[case])
        print(f"{case:<24}{wall:>8.2f}{size / 1e6 / wall:>9.1f}{rss[case] / 1e6:>13.0f}{wall / base:>8.2f}x")
      if all(times[case] for case in ("local -> gs", *PEERS)):
        med = {case: statistics.median(times[case]) for case in times if times[case]}
        save = {case: statistics.median(saves[case]) for case in PEERS}
        print(f"local -> gs beside Orbax: time {med['local -> gs'] / med[ORBAX]:.2f}x (its save alone "
              f"{save[ORBAX]:.2f} s: {med['local -> gs'] / save[ORBAX]:.2f}x), peak RSS "
              f"{rss['local -> gs'] / rss[ORBAX]:.2f}x (goal <= 1.2x)")
        print("rounds (wall s, in run order): " + "; ".join(
            f"{case} {', '.join(f'{t:.1f}' for t in times[case])}" for case in ("local -> gs", ORBAX, ORBAX_FILES)
            if times[case]))
        for peer in (ORBAX, ORBAX_FILES):
          if times[peer]:
            ratios = [ours / theirs for ours, theirs in zip(times["local -> gs"], times[peer])]
            print(f"local -> gs over {peer}, round by round: {', '.join(f'{r:.2f}' for r in ratios)}; median "
                  f"{statistics.median(ratios):.2f}x; over its median time {med['local -> gs'] / med[peer]:.2f}x")
        ours, theirs = med["local -> gs"] - med[CASES[0]], save[ORBAX] - save[ORBAX_LOCAL]
        print(f"what gs:// adds: export {ours:.2f} s (local -> gs less local -> local), Orbax {theirs:.2f} s (its save "
              f"to gs less its save to local disk): {ours / theirs if theirs > 0 else float('inf'):.2f}x")
        cells = []
        for stage in STAGES:
          local, remote = (statistics.median(stages[c][stage]) if stages[c][stage] else 0.0 for c in CASES[:2])
          cells.append(f"{stage} {remote:.2f} s ({remote - local:+.2f})")
        print(f"local -> gs by stage (beside local -> local): {', '.join(cells)}")
        if times[REPLACING]:
          publish = statistics.median(stages[REPLACING]["publish"]) if stages[REPLACING]["publish"] else 0.0
          print(f"replacing that export (--overwrite): {med[REPLACING]:.2f} s, {med[REPLACING] / med[ORBAX]:.2f}x "
                f"Orbax's restore + save to gs, of which publishing (the copy of the staging prefix) {publish:.2f} s")
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
