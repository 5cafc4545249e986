"""Two-pass quantization of a weight whose source is chunked along an axis its scales are shared over (experts,
rows): under a tight `--max-memory` the blocks cut along the source's chunks on every axis, each chunk is read at
most twice, and the quantized values and scales are Qwix's for the whole weight, when two processes share the
work too."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from qwix._src.core import qarray

import export_sources
from inspect_tool.configuration import config
from inspect_tool.streaming import budget
from inspect_tool.coverage import plan as plan_lib
from inspect_tool.paramtree import params
from inspect_tool.streaming import read
from inspect_tool.fp8_export import quantize
from inspect_tool.streaming import write_orbax

TOKENS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
          "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full"]
CHUNK = 64 << 10  # source chunks: along the first axis (experts of the routed experts), at most 64 KiB
SLICE = 64 << 10  # the slice budget the --max-memory below leaves


class _CountingSource:
  """The checkpoint source, counting the bytes read (decoded) from each array."""

  def __init__(self, source):
    self._source, self.read_bytes, self._keys = source, {}, {}

  def __getattr__(self, name):
    return getattr(self._source, name)

  def read_async(self, store, index):
    key = self._keys[id(store)]
    self.read_bytes[key] = self.read_bytes.get(key, 0) + math.prod(s.stop - s.start for s in index) * 4
    return self._source.read_async(store, index)

  def open(self, key):
    store = self._source.open(key)
    self._keys[id(store)] = key
    return store


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  step = tmp_path_factory.mktemp("src") / "0"
  export_sources.write_source(str(step), TOKENS, chunk_bytes=CHUNK)
  cfg = config.resolve_config(TOKENS)
  return cfg, str(step)


def _whole(step: str, key) -> np.ndarray:
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  items = step + "/items/"
  spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": {"driver": "file", "path": items},
                                         "path": ".".join(key) + "/"}}
  return ts.open(spec, open=True).result().read().result()


def test_blocks_across_shared_axes_give_qwix_values_over_two_processes(source, tmp_path):
  cfg, step = source
  plan = plan_lib.plan_export(cfg)
  src = _CountingSource(read.open_source(cfg, step, params.model_leaves(cfg)))
  max_memory = budget.reserve_bytes(True) + write_orbax.DECODING_CHUNKS * CHUNK + budget.SLICE_FACTOR * SLICE
  jobs = write_orbax.plan_jobs(plan, src, max_memory, held=0)
  two_pass = [job for job in jobs if job.two_pass]
  experts = [job for job in two_pass if job.leaf.key[-1] in ("wi_0", "wi_1", "wo")]
  assert len(experts) == 3 and all(job.slicing.count == 16 for job in experts), [j.slicing for j in experts]
  for job in two_pass:  # the blocks cut an axis the scales are shared over
    assert any(b < d for axis, (b, d) in enumerate(zip(job.slicing.block, job.leaf.shape))
               if axis not in job.quant.channel_axes)
  for job in experts:  # boxes of whole source chunks (experts), so that each is decoded once per pass
    chunk = src.chunk_shape(src.open(job.leaf.key))
    assert all(b % c == 0 or b == d for b, c, d in zip(job.read_block, chunk, job.leaf.shape)), job.read_block

  items = tmp_path / "dst" / "0" / "items"
  items.mkdir(parents=True)
  writers = [write_orbax.write_arrays(jobs, src, str(items), process_index=i, process_count=2,
                                      quantizers=quantize.Quantizers)[0] for i in (0, 1)]
  writers[0].finalize(str(items.parent), "items", process_count=2)
  for job in two_pass:  # every block read twice, but the last one of each group, which stays in memory
    nbytes = math.prod(job.leaf.shape) * 4
    last = sum(math.prod(s.stop - s.start for s in unit[-1]) * 4 for unit in job.units())
    assert src.read_bytes[job.leaf.key] == 2 * nbytes - last, job.leaf.key

  with ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(str(items))["params"]["params"]
  for job in two_pass:
    wq = job.quant
    node = restored
    for part in job.out_key[2:]:
      node = node[part]
    how = qarray.HowToQuantize(qtype=jnp.float8_e4m3fn, channelwise_axes=list(wq.channel_axes), tiled_axes={},
                               calibration_method="absmax")
    expected = qarray.quantize(jnp.asarray(_whole(step, job.leaf.key)).astype(jnp.bfloat16), how)
    qvalue, scale = node["array"]["qvalue"], node["array"]["scale"]
    assert np.asarray(qvalue).tobytes() == np.asarray(expected.qvalue).tobytes(), job.leaf.key
    assert np.asarray(scale).tobytes() == np.asarray(expected.scale).tobytes(), job.leaf.key
