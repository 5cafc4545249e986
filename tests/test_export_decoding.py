"""No re-decoding: on sources saved by Orbax itself (one chunk per array, streamed when no whole chunk fits; chunks
capped by `chunk_byte_size`, which
straddle the axes the scales are shared over), every read is a box of whole source chunks, each chunk is decoded
once (one pass) or at most twice (two passes), as tensorstore's own chunk-read counter confirms, and the export
holds Qwix's values for the whole weights."""

from __future__ import annotations

import itertools
import math
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from qwix._src.core import qarray

import orbax_sources
from inspect_tool.configuration import config
from inspect_tool.streaming import absmax_ahead
from inspect_tool.streaming import budget
from inspect_tool.streaming import chunk_stream
from inspect_tool.coverage import plan as plan_lib
from inspect_tool.paramtree import params
from inspect_tool.streaming import read
from inspect_tool.streaming import read_plan
from inspect_tool.fp8_export import report
from inspect_tool.fp8_export import quantize
from inspect_tool.streaming import write_orbax

MODEL = ["model_name=deepseek3-tiny", "override_model_config=true", "mtp_num_layers=0", "base_emb_dim=256",
         "vocab_size=16384", "base_moe_mlp_dim=512", "base_mlp_dim=1024", "num_experts=8",
         "base_num_decoder_layers=3", "first_num_dense_layers=1"]
TOKENS = MODEL + ["quantization=fp8_full"]
MIB = 2**20
WI_0 = "params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0"


@pytest.fixture(scope="module", params=[None, MIB], ids=["one-chunk-per-array", "chunks-of-1MiB"])
def source(request, tmp_path_factory):
  step = tmp_path_factory.mktemp("orbax_src") / "0"
  chunks = orbax_sources.write_source(str(step), MODEL, chunk_byte_size=request.param)
  return str(step), chunks, request.param


def _chunk_reads() -> int:
  """tensorstore's count of chunks read (decoded) through its chunk cache, in this process so far."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  found = ts.experimental_collect_matching_metrics("/tensorstore/cache/chunk_cache/reads")
  return sum(v["value"] for m in found for v in m["values"])


class _Recording:
  """The checkpoint source, recording every decoded read (array key, index) the writer asks for, and the boxes it
  streams (`streamed`)."""

  def __init__(self, source):
    self._source, self.reads, self._keys, self.streamed = source, [], {}, []

  def __getattr__(self, name):
    return getattr(self._source, name)

  def open(self, key):
    store = self._source.open(key)
    self._keys[id(store)] = key
    return store

  def read_async(self, store, index, counted=True):
    if counted:
      self.reads.append((self._keys[id(store)], index))
    return self._source.read_async(store, index, counted)

  def cached_box(self, key, index):  # its slices decode the box's chunks once: replayed as the box
    self.reads.append((key, index))
    return self._source.cached_box(key, index)

  def read_streamed_async(self, key, index):
    self.streamed.append((key, index))
    return self._source.read_streamed_async(key, index)


class _Inflated:
  """The bytes every zstd decoder the process starts has put out (zstandard's stream readers, counted at
  `readinto`): what streamed reads decoded, measured at the decoder."""

  def __init__(self, monkeypatch):
    import zstandard  # pylint: disable=import-outside-toplevel

    self.total, original, counter, lock = 0, zstandard.ZstdDecompressor.stream_reader, self, threading.Lock()

    class Reader:
      def __init__(self, inner):
        self._inner = inner

      def readinto(self, view):
        n = self._inner.readinto(view)
        with lock:  # streams decode in threads of their own
          counter.total += n
        return n

      def __getattr__(self, name):
        return getattr(self._inner, name)

    monkeypatch.setattr(zstandard.ZstdDecompressor, "stream_reader",
                        lambda decompressor, *a, **k: Reader(original(decompressor, *a, **k)))


def _replayed(src, reads) -> tuple[int, dict]:
  """(chunks tensorstore decodes for the recorded reads, replayed one by one; chunk -> times it is read)."""
  before, times = _chunk_reads(), {}
  for key, index in reads:
    store = src.open(key)
    store[index].read().result() if index else store.read().result()
    chunk = src.chunk_shape(store)
    ranges = [range(s.start // c, -(-s.stop // c)) for s, c in zip(index, chunk)]
    for cell in itertools.product(*ranges):
      times[key, cell] = times.get((key, cell), 0) + 1
  return _chunk_reads() - before, times


def _export(step: str, available: int, dst):
  """Plans within `available` bytes beside the reserve (held = 0) and writes; returns (jobs, source, the report's
  decoding figures, tensorstore's count of the chunks the (not streamed) reads decode, chunk -> times read)."""
  cfg = config.resolve_config(TOKENS)
  plan = plan_lib.plan_export(cfg)
  src = _Recording(read.open_source(cfg, step, params.model_leaves(cfg)))
  jobs = write_orbax.plan_jobs(plan, src, budget.reserve_bytes(True) + available, held=0)
  dst.mkdir(parents=True)
  writer, _ = write_orbax.write_arrays(jobs, src, str(dst), quantizers=quantize.Quantizers)
  writer.finalize(str(dst.parent), "items")
  counted = report.decoding(src.decodes, {job.leaf.key: read.nbytes(job.leaf) for job in jobs})
  measured, times = _replayed(src, src.reads)
  return jobs, src, counted, measured, times


def _check_aligned(jobs, src) -> None:
  """Every box is made of whole source chunks (or whole axes), or is one run of the array in C order when it is
  streamed; every slice divides its box."""
  for job in jobs:
    if job.streamed:
      numbers = np.arange(math.prod(job.leaf.shape)).reshape(job.leaf.shape)
      for index in read_plan.boxes(job.leaf.shape, job.read_block):
        run = numbers[index].reshape(-1)
        assert (np.diff(run) == 1).all(), (job.leaf.key, index)
      continue
    chunk = src.chunk_shape(src.open(job.leaf.key))
    for box, side, c, d in zip(job.read_block, job.slicing.block, chunk, job.leaf.shape):
      assert box % c == 0 or box == d, (job.leaf.key, job.read_block, chunk)
      assert box % side == 0 or box == d, (job.leaf.key, job.read_block, job.slicing.block)


def _qwix(step: str, key, wq):
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{step}/items/",
                                         "path": ".".join(key) + "/"}}
  whole = jnp.asarray(ts.open(spec, open=True).result().read().result()).astype(jnp.bfloat16)
  how = qarray.HowToQuantize(qtype=jnp.float8_e4m3fn, channelwise_axes=list(wq.channel_axes), tiled_axes={},
                             calibration_method="absmax")
  return qarray.quantize(whole, how)


def _check_values(step: str, dst, jobs) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  with ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(str(dst))["params"]["params"]
  experts = [job for job in jobs if job.quant is not None and ".".join(job.leaf.key) == WI_0]
  for job in experts + [job for job in jobs if job.two_pass]:
    node = restored
    for part in job.out_key[2:]:
      node = node[part]
    expected = _qwix(step, job.leaf.key, job.quant)
    assert np.asarray(node["array"]["qvalue"]).tobytes() == np.asarray(expected.qvalue).tobytes(), job.leaf.key
    assert np.asarray(node["array"]["scale"]).tobytes() == np.asarray(expected.scale).tobytes(), job.leaf.key


def _check_streamed(jobs, src, counted, measured: int, inflated) -> dict:
  """The zstd decoders put out each streamed array once (one pass) or twice (two passes), as the report counts it;
  the other chunks the report counts are those tensorstore decoded (`measured`). Returns key -> bytes of each
  streamed array."""
  streamed = {job.leaf.key: job for job in jobs if job.streamed}
  arrays = {key: math.prod(job.leaf.shape) * np.dtype(job.leaf.dtype).itemsize for key, job in streamed.items()}
  assert inflated.total == sum((1 + job.two_pass) * arrays[key] for key, job in streamed.items())
  for key, job in streamed.items():
    assert src.decodes[key] == [1 + job.two_pass, (1 + job.two_pass) * arrays[key]], key
  assert counted["chunks_decoded"] - sum(src.decodes[key][0] for key in streamed) == measured
  return arrays


def test_a_tight_budget_decodes_each_chunk_at_most_twice(source, tmp_path, monkeypatch):
  step, chunks, cap = source
  largest = max(math.prod(c) for c in chunks.values()) * 4
  # Room for one chunk-sized box, the chunk decoded into it and small slices: no box spanning the experts' shared
  # axes fits beside it when chunks are capped, so they are quantized in two passes.
  inflated = _Inflated(monkeypatch)
  jobs, src, counted, measured, times = _export(step, 2 * largest + 12 * 2**16, tmp_path / "dst" / "items")
  _check_aligned(jobs, src)
  arrays = _check_streamed(jobs, src, counted, measured, inflated)
  assert measured == sum(times.values())  # tensorstore's own counter agrees
  assert max(times.values()) <= 2
  assert counted["decoded_per_stored"] <= 2 and counted["most_decoded_array"]["decoded_per_stored"] <= 2
  for key, (n, nbytes) in src.decodes.items():
    assert nbytes <= 2 * math.prod(src.leaf(key).shape) * 4, key
  wi_0 = next(job for job in jobs if ".".join(job.leaf.key) == WI_0)
  if cap:  # chunks (8, 2, 128, 128) cut axis 2, over which the scales are shared: two passes, boxes of one chunk
    assert chunks[WI_0] == (8, 2, 128, 128) and wi_0.two_pass and wi_0.read_block == chunks[WI_0]
    assert 1 < src.decodes[wi_0.leaf.key][1] / (math.prod(wi_0.leaf.shape) * 4) <= 2
  else:  # one chunk: decoded once into a cache of its own, its slices read from it
    assert not wi_0.two_pass and wi_0.read_block == wi_0.leaf.shape and wi_0.slicing.count > 1
    assert wi_0.cached and not wi_0.ahead and wi_0.leaf.key not in arrays  # a cached chunk before a streamed cut
    assert counted["decoded_per_stored"] == 1
  _check_values(step, tmp_path / "dst" / "items", jobs)


def test_a_budget_under_one_chunk_streams_the_chunk_in_boxes_once(source, tmp_path, monkeypatch):
  """One chunk per array, a budget under the largest chunk (16 MiB, the output head) beside the reserve: the largest
  arrays are decoded from their stored chunk front to back into boxes smaller than the array (one run of it each),
  each chunk once (twice in two passes), with Qwix's values. Chunks of 1 MiB: the same budget reads boxes of whole
  chunks."""
  step, chunks, cap = source
  largest = max(math.prod(c) for c in chunks.values()) * 4
  inflated = _Inflated(monkeypatch)
  jobs, src, counted, measured, times = _export(step, 10 * MIB, tmp_path / "dst" / "items")
  _check_aligned(jobs, src)
  wi_0 = next(job for job in jobs if ".".join(job.leaf.key) == WI_0)
  _check_streamed(jobs, src, counted, measured, inflated)
  assert measured == sum(times.values()) and max(times.values(), default=0) <= 2
  if cap:
    assert not any(job.streamed for job in jobs) and inflated.total == 0
  else:
    assert largest == 16 * MIB and wi_0.streamed and math.prod(wi_0.read_block) < math.prod(wi_0.leaf.shape), wi_0
    assert inflated.total > 0 and counted["decoded_per_stored"] <= 2
  assert not any(job.ahead_box for job in jobs)  # no room for a stream of its own: pass 1 in the export's reads
  _check_values(step, tmp_path / "dst" / "items", jobs)


def test_streamed_two_pass_weights_gather_their_absmax_ahead(source, tmp_path, monkeypatch):
  """Where the budget also holds a stream of its own (windows and runs of 256 KiB here), pass 1 of the streamed
  two-pass experts runs ahead in a thread (`absmax_ahead`): the export's own reads take each box once, each chunk is
  still decoded twice in all (as the decoders count it), and the weights hold Qwix's values. A chunked source is
  not streamed: nothing runs ahead."""
  step, chunks, cap = source
  monkeypatch.setattr(chunk_stream, "MAPPED_WINDOW_BYTES", 256 * 2**10)  # the source's files, mapped
  monkeypatch.setattr(absmax_ahead, "BOX_BYTES", 256 * 2**10)
  inflated = _Inflated(monkeypatch)
  jobs, src, counted, measured, times = _export(step, 9 * MIB, tmp_path / "dst" / "items")
  ahead = [job for job in jobs if job.ahead_box]
  _check_streamed(jobs, src, counted, measured, inflated)
  assert measured == sum(times.values()) and max(times.values(), default=0) <= 2
  if cap:
    assert not ahead and not any(job.streamed for job in jobs)
  else:
    experts = ".".join(WI_0.split(".")[:-1])
    assert sorted(".".join(job.leaf.key) for job in ahead) == [f"{experts}.{n}" for n in ("wi_0", "wi_1", "wo")]
    for job in ahead:
      assert job.two_pass and job.streamed and math.prod(job.ahead_box) * 4 <= 256 * 2**10, job
      boxes = read_plan.boxes(job.leaf.shape, job.read_block)
      assert [index for key, index in src.streamed if key == job.leaf.key] == boxes  # pass 2 only, in order
  _check_values(step, tmp_path / "dst" / "items", jobs)


def test_where_one_pass_fits_every_chunk_is_decoded_once(source, tmp_path, monkeypatch):
  step, _, _ = source
  inflated = _Inflated(monkeypatch)
  jobs, src, counted, measured, times = _export(step, 48 * MIB, tmp_path / "dst" / "items")
  _check_aligned(jobs, src)
  assert not any(job.two_pass for job in jobs)
  _check_streamed(jobs, src, counted, measured, inflated)
  assert max(times.values()) == 1  # every chunk read once
  assert measured == len(times) and counted["bytes_decoded"] == counted["bytes_stored"] > 0
  assert counted["decoded_per_stored"] == 1 and counted["most_decoded_array"]["decoded_per_stored"] == 1
  _check_values(step, tmp_path / "dst" / "items", jobs)


def _metric(name: str) -> int:
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  return sum(v.get("value", 0) for m in ts.experimental_collect_matching_metrics(name) for v in m["values"])


def _quiet_metrics() -> tuple[int, int]:
  """The file-read and decode counters once no other thread of the process (an earlier test's writer or compile
  thread, under load) moves them: they count the whole process."""
  import gc  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  gc.collect()
  names = ("/tensorstore/kvstore/file/bytes_read", "/tensorstore/internal/riegeli/noncontiguous_bytes")
  last, deadline = None, time.monotonic() + 30
  while True:
    now = tuple(_metric(name) for name in names)
    if now == last or time.monotonic() > deadline:
      return now
    last = now
    time.sleep(0.3)


def test_the_slices_of_a_cached_box_decode_its_chunk_once(source):
  """tensorstore's own counters: reading a one-chunk box slice by slice through `cached_box` reads its stored
  bytes from disk once and decodes it once; the same slices read each through a handle of its own decode it once
  each."""
  step, chunks, cap = source
  cfg = config.resolve_config(TOKENS)
  src = read.open_source(cfg, step, params.model_leaves(cfg))
  key = tuple(WI_0.split("."))
  store = src.open(key)
  box = tuple(slice(0, c) for c in chunks[WI_0])  # one source chunk
  decoded, stored = src.chunk_bytes(store), src.stored_chunk_bytes(store)
  if not cap:  # one shard, its index read: zstd of normal float32 values; else as decoded (an upper bound)
    assert 0.8 * decoded < stored < decoded
  assert stored <= decoded
  whole = np.asarray(store[box].read().result())
  slices = [(slice(i, i + 1),) + box[1:] for i in range(box[0].stop)]

  def read_slices(view) -> tuple[int, int, list]:
    disk, decoding = _quiet_metrics()
    parts = [view(index) for index in slices]
    return (_metric("/tensorstore/kvstore/file/bytes_read") - disk,
            _metric("/tensorstore/internal/riegeli/noncontiguous_bytes") - decoding, parts)

  tries = []
  for _ in range(3):  # the counters are the process's: another thread's reads can only add to a try
    before = dict(src.decodes)
    view = src.cached_box(key, box)
    disk, decoding, parts = read_slices(lambda index, view=view: view[tuple(slice(s.start, s.stop) for s in index)])
    assert np.concatenate(parts).tobytes() == whole.tobytes()
    assert src.decodes[key][0] - before.get(key, [0])[0] == 1  # counted once, as the box
    tries.append((disk, decoding))
    if disk < decoded + 2**20 and decoding < decoded + 2**20:
      break
  disk, decoding = min(tries)
  assert disk < decoded + 2**20 and decoded <= decoding < decoded + 2**20, tries
  cached_disk = disk
  # The counters can tell: each slice read through a handle of its own (a fresh context, so nothing is kept between
  # reads) reads and decodes the whole chunk again. (Through one handle tensorstore sometimes keeps a decoded
  # chunk between reads by itself, so that is no baseline.)
  def fresh(index):
    other = read.open_source(cfg, step, params.model_leaves(cfg))
    return other.read(other.open(key), index)

  disk, decoding, parts = read_slices(fresh)
  assert decoding >= len(slices) * decoded and disk >= len(slices) * cached_disk - 2**16, (disk, decoding)
  assert np.concatenate(parts).tobytes() == whole.tobytes()


def test_the_hf_layout_streams_one_chunk_arrays_in_boxes_of_many_rows(source, tmp_path, monkeypatch):
  """The deepseek-fp8 writer within 24 MiB of work: the arrays stored as one chunk too large to read whole beside its
  decoded copy (the 16 MiB embedding and head) are streamed, each decoded once, in boxes of many rows (not row by
  row), and the files are those of the writer with the default work memory. Chunks of 1 MiB: nothing is streamed."""
  from inspect_tool.streaming import chunk_stream  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import write_hf  # pylint: disable=import-outside-toplevel

  step, chunks, cap = source
  cfg = config.resolve_config(MODEL)
  boxes, read_async = [], chunk_stream.ChunkStream.read_async
  monkeypatch.setattr(chunk_stream.ChunkStream, "read_async",
                      lambda stream, index, out: boxes.append((stream.shape, out.nbytes)) or read_async(stream, index, out))

  def write(dst, work_bytes):
    src = read.open_source(cfg, step, params.model_leaves(cfg))
    views = {key: src.view(key) for key in src.keys()}
    dst.mkdir()
    write_hf.write_deepseek_fp8(views, cfg, str(dst), work_bytes=work_bytes,
                                chunk_shape=lambda key: src.chunk_shape(src.open(key)),
                                read_overhead=lambda key, box: src.read_overhead(src.open(key), box))
    src.close_stream()
    return src

  src = write(tmp_path / "bounded", 24 * MIB)
  streamed = {shape for shape, _ in boxes}
  if cap:
    assert not boxes
  else:
    assert streamed == {(16384, 256), (256, 16384)}, streamed
    for shape in streamed:
      key = next(key for key in src.keys() if tuple(src.leaf(key).shape) == shape)
      assert src.decodes[key][0] == 1, key  # decoded once, front to back
      sizes = [nbytes for s, nbytes in boxes if s == shape]
      assert len(sizes) <= 32 and sum(sizes) == math.prod(shape) * 4, (shape, sizes)  # row by row: 16384
  write(tmp_path / "unbounded", write_hf.DEFAULT_WORK_BYTES)
  names = sorted(p.name for p in (tmp_path / "unbounded").iterdir())
  assert names == sorted(p.name for p in (tmp_path / "bounded").iterdir())
  for name in names:
    assert (tmp_path / "bounded" / name).read_bytes() == (tmp_path / "unbounded" / name).read_bytes(), name
