"""`DST/export_manifest.json`: per stored tensor what the quantizer did, and a sha256 of what was stored.

Every tensor of the export has an entry (`tensors`, in the order of the names): `name`, `shape` and `dtype` as
stored, `sha256` (`stored.StoredTensors.digest`), `source` (the MaxText leaf it came from: key, shape, dtype; null
for a tensor the layout adds) and `quantized`. A quantized weight also has `scale` (the scale tensor's name, its
layout, its count of blocks, and how many of its scales are zero, NaN or inf) and `error` (`tally.Tally.error`: the
largest and mean absolute dequantization error against the source, and the largest relative to the block's
absmax); a scale tensor names the weight it scales (`scale_of`) with the same counts.

The hashes and counts come from the writers as they write (`digests`); an array that several processes wrote parts
of is read back once the checkpoint is complete (`hashes`: each process hashes every such tensor whose running
number is its index modulo the process count, `HASH_WORKERS` at once, in pieces of its share of the budget, and
process 0 gathers the rest, `distributed.gather_text`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import threading

import numpy as np

from inspect_tool.distributed import runtime as distributed
from inspect_tool.manifest import digests as digests_lib
from inspect_tool.manifest import stored as stored_lib
from inspect_tool.manifest import tally as tally_lib
from inspect_tool.paramtree import tree
from inspect_tool.streaming import write_orbax

HASH_WORKERS = 2  # tensors hashed at once by a process
NAME = "export_manifest.json"
KIND = "inspect_checkpoint export manifest"
VERSION = 1
HASH = "sha256 of each tensor's elements in C order, as stored (little-endian)"


@dataclasses.dataclass(frozen=True)
class Described:
  """What the writer knows of one stored tensor: where it came from and, quantized, its scale."""

  source: dict | None = None  # {"key", "shape", "dtype"} of the MaxText leaf
  quantized: bool = False
  scale: str | None = None  # a quantized weight: its scale tensor's name
  layout: str = ""  # a quantized weight: how its scales are laid out
  scale_of: str | None = None  # a scale tensor: the weight it scales


def source_of(key, shape, dtype) -> dict:
  return {"key": "/".join(key), "shape": [int(d) for d in shape],
          "dtype": None if dtype is None else np.dtype(dtype).name}


def scale_digest(tensors: stored_lib.StoredTensors, name: str, piece_bytes: int,
                 into: np.ndarray | None = None) -> tuple[str, list[int]]:
  """(sha256, [zero, NaN, inf] counts) of the scale tensor `name`, read once (into `into`: `StoredTensors.pieces`)."""
  total = [0, 0, 0]

  def add(piece):
    for i, n in enumerate(digests_lib.counts(piece)):
      total[i] += n

  return tensors.digest(name, piece_bytes, add, into), total


def hashes(tensors: stored_lib.StoredTensors, described: dict[str, Described], piece_bytes: int,
           names: list[str]) -> dict:
  """name -> [sha256, zero, NaN, inf scale counts] of the stored tensors `names` (in the same order on every
  process), read back, this process's share hashed here (`HASH_WORKERS` at once, each in pieces of at most
  `piece_bytes` / `HASH_WORKERS`, read into one buffer per worker)."""
  index, count = distributed.process_index(), distributed.process_count()
  share = max(1, piece_bytes // HASH_WORKERS)
  buffers = threading.local()

  def one(name: str) -> list:
    if getattr(buffers, "piece", None) is None:
      buffers.piece = np.empty(share, np.uint8)
    if described.get(name, Described()).scale_of is not None:
      digest, found = scale_digest(tensors, name, share, buffers.piece)
      return [digest, *found]
    return [tensors.digest(name, share, into=buffers.piece), 0, 0, 0]

  names = [name for number, name in enumerate(names) if number % count == index]
  with concurrent.futures.ThreadPoolExecutor(HASH_WORKERS) as pool:
    futures = [pool.submit(one, name) for name in names]
    try:
      mine = {name: future.result() for name, future in zip(names, futures)}
    except BaseException:  # the first failure ends the pass: no other tensor is started
      for future in futures:
        future.cancel()
      raise
  out = {}
  for text in distributed.gather_text(json.dumps(mine)):
    out.update(json.loads(text))
  return out


def manifest(catalogue: dict[str, tuple], found: dict[str, list], described: dict[str, Described],
             tally: tally_lib.Tally, layout: str) -> dict:
  """The manifest of an export whose stored tensors are `catalogue` (name -> (shape, dtype), in the manifest's
  order) with `found` (name -> [sha256, zero, NaN, inf counts], `Digests.found` or `hashes`)."""
  entries = []
  for name, (shape, dtype) in catalogue.items():
    about = described.get(name, Described())
    entry = {"name": name, "shape": [int(d) for d in shape], "dtype": np.dtype(dtype).name,
             "sha256": found[name][0], "source": about.source, "quantized": about.quantized}
    if about.quantized:
      scale = found.get(about.scale, [None, 0, 0, 0])
      entry["scale"] = {"name": about.scale, "layout": about.layout,
                        "blocks": math.prod(catalogue[about.scale][0]) if about.scale in found else 0,
                        "zero": scale[1], "nan": scale[2], "inf": scale[3]}
      entry["error"] = tally.error(name)
    if about.scale_of is not None:
      entry.update(scale_of=about.scale_of, zero=found[name][1], nan=found[name][2], inf=found[name][3])
    entries.append(entry)
  return {"kind": KIND, "version": VERSION, "layout": layout, "hash": HASH,
          "totals": {"tensors": len(entries),
                     "bytes": sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in catalogue.values()),
                     "quantized": sum(e["quantized"] for e in entries)},
          "tensors": entries}


def orbax_catalogue(jobs) -> dict[str, tuple]:
  """name -> (shape, dtype) of every array of an Orbax export's plan (`streaming.write_orbax.ArrayJob`s), in the
  manifest's order (the names sorted)."""
  arrays = {".".join(key): (tuple(shape), dtype)
            for job in jobs for key, shape, dtype, *_ in write_orbax.destination_arrays(job)}
  return dict(sorted(arrays.items()))


def safetensors_catalogue(weight_map: dict[str, str], digests: digests_lib.Digests) -> dict[str, tuple]:
  """name -> (shape, dtype) of every tensor of a safetensors export (`weight_map`: name -> shard file), in the
  manifest's order: shard by shard, each shard's names in natural order (as its index lists them)."""
  names = sorted(weight_map, key=lambda name: (weight_map[name], tree.natural_key(name)))
  return {name: digests.tensor(name) for name in names}


# What a hash pass holds beside its pieces: the export's arrays opened and their database's nodes. Measured: a
# 53-array export of 256 KiB chunks peaks 16 MiB plus 3.3 pieces above the resident size it starts from.
HASH_OVERHEAD = 24 << 20


def piece_bytes_for(max_memory: int, held: int) -> int:
  """Bytes read at once by a hash pass under `max_memory` with `held` bytes resident: a quarter of what is left
  beside `HASH_OVERHEAD` (the piece, its decoded copy and tensorstore's buffers), between 64 KiB and 256 MiB."""
  return int(min(256 << 20, max(64 << 10, (max_memory - held - HASH_OVERHEAD) // 4)))


def orbax_described(jobs) -> dict[str, Described]:
  """What an Orbax export's writer planned (`streaming.write_orbax.ArrayJob`s), by stored array name."""
  out = {}
  for job in jobs:
    source = source_of(job.leaf.key, job.leaf.shape, job.leaf.dtype)
    wq = job.quant
    if wq is None:
      out[".".join(job.out_key)] = Described(source=source)
      continue
    weight, scale = ".".join(wq.qvalue_key), ".".join(wq.scale_key)
    shared = [axis for axis in range(len(job.leaf.shape)) if axis not in wq.channel_axes]
    out[weight] = Described(source=source, quantized=True, scale=scale,
                            layout=f"per channel, {wq.qtype}: one {wq.compute_dtype} scale per index of axes "
                                   f"{list(wq.channel_axes)}, shared over axes {shared} (Qwix PTQ)")
    out[scale] = Described(source=source, scale_of=weight)
  return out


def hf_described(origins: dict, scale_suffix: str = "_scale_inv", v4: bool = False) -> dict[str, Described]:
  """What a DeepSeek safetensors export's writer recorded (tensor name -> (MaxText key, shape, dtype)), by name;
  `v4`: DeepSeek-V4's release, whose `<x>.weight` is scaled by `<x>.scale` (FP4 experts: per 32 values)."""
  out = {}

  def scale_of(name: str) -> str:
    return name[:-len("weight")] + "scale" if v4 and name.endswith(".weight") else name + scale_suffix

  weights = {scale_of(name): name for name in origins if scale_of(name) in origins and scale_of(name) != name}
  for name, (key, shape, dtype) in origins.items():
    source = source_of(key, shape, dtype)
    if name in weights:
      out[name] = Described(source=source, scale_of=weights[name])
    elif scale_of(name) in origins:
      layout = ("1x32 groups: one float8_e8m0fnu scale per 32 values of a row, two e2m1 values per byte "
                "(DeepSeek-V4's FP4 experts)" if v4 and ".ffn.experts." in name else
                "128x128 blocks: one float8_e8m0fnu scale per block (DeepSeek-V4's release)" if v4 else
                "128x128 blocks: one float32 weight_scale_inv per block (DeepSeek-V3's release)")
      out[name] = Described(source=source, quantized=True, scale=scale_of(name), layout=layout)
    else:
      out[name] = Described(source=source)
  return out


def summary(doc: dict) -> dict:
  """The report's lines about the manifest: its name, tensors, and the largest errors over every tensor."""
  errors_ = [e["error"] for e in doc["tensors"] if e.get("error")]
  return {"name": NAME, "tensors": doc["totals"]["tensors"], "quantized": doc["totals"]["quantized"],
          "largest_error_over_block_absmax": max((e["max_over_block_absmax"] for e in errors_), default=0.0),
          "zero_nan_inf_scales": sum(e["zero"] + e["nan"] + e["inf"] for e in doc["tensors"] if "scale_of" in e)}
