"""The sizes of the program `--compile` traces, checked before anything is traced: one line naming the key and the
largest value accepted (`check`).

The program holds MaxText's batch, int32 [per_device_batch_size × devices, max_target_length], split over the
devices that share it (JAX's IndivisibleError otherwise: `per_device_batch_size=0.3` on v5p-8), and per device the
routed experts' sorted token copies (`model.moe_dispatch`): the device's tokens × num_experts_per_tok, times
MaxText's worst-case ragged all-to-all buffer factor min(EP, experts // K) with expert parallelism. JAX indexes
each dimension with int32 (`configuration.limits.INT32_MAX`): `per_device_batch_size=200000` on v5p-8 (3.3e9
copies per device) was an OverflowError from the dispatch. Splash attention (`model.splash`: `attention=flash`, or
`autoselected` from `MIN_LENGTH` tokens) cuts the sequence into blocks that must divide it (its ValueError for
`max_target_length=1000`), and builds its mask tables on this host, int32 per pair of blocks: they must fit the
memory this host has (`max_target_length=1000000000` asked numpy for 13.9 TiB). A step compiled for several
slices is refused: the mesh is built for one slice's devices.
"""

from __future__ import annotations

import math

from inspect_tool import errors
from inspect_tool.configuration import limits
from inspect_tool.host import memory as host_memory
from inspect_tool.model import splash
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.sharding import rules as rules_lib

INT32_LIMIT = "2^31-1, the largest dimension a traced program indexes (JAX's int32 indices)"
# Splash attention's mask tables, as JAX's `process_mask` builds them on the host for a causal mask of T × T tokens
# cut into bq × bkv blocks (measured with tracemalloc, jax 0.12: 66–89 bytes per block of the (T/bq) × (T/bkv)
# grid at its peak, plus the blocks it compares and about 1 MiB; `tests/test_compile_sizes.py` holds this to the
# library).
MASK_BYTES_PER_BLOCK = 96
MASK_FIXED_BYTES = 1 << 20
MASK_PAIRS = ((False, "sa_block_q", "sa_block_kv"), (False, "sa_block_q_dq", "sa_block_kv_dq"),
              (True, "sa_block_q_dkv", "sa_block_kv_dkv"))  # forward, dq and dkv: each kernel's own tables


def check(cfg, topology: str) -> None:
  """Refuses (one line, exit 2) a config whose compiled step on `topology` JAX or this host cannot represent."""
  slices = mesh_lib.num_slices(cfg)
  if slices > 1:
    raise errors.ConfigError(f"num_slices={slices}: --compile compiles for the devices of one --topology {topology} "
                             "slice; accepted: num_slices=1")
  _Step(cfg, mesh_lib.build_mesh(cfg, mesh_lib.topology_devices(topology))).check()


def _number(value: float) -> int | float:
  return int(value) if float(value).is_integer() else round(float(value), 6)


class _Step:
  """The sizes of one config's compiled step on one mesh; `why(rows, length)` says what a batch of `rows` sequences
  of `length` tokens would break (None: nothing)."""

  def __init__(self, cfg, mesh):
    self.cfg, self.mesh, rules = cfg, mesh, rules_lib.effective_rules(cfg)
    self.devices = mesh.devices
    self.parts = [_shards(tuple(cfg.input_data_sharding_logical_axes), rules, mesh),
                  _shards(("activation_batch", "activation_norm_length"), rules, mesh)]
    ep, k = _shards(("exp",), rules, mesh, drop="fsdp")[0], int(cfg.num_experts_per_tok)
    self.factor = min(ep, cfg.num_experts // k) if ep > 1 else 1
    self.ep, self.k = ep, k
    self.moe = cfg.num_moe_layers > 0 and bool(cfg.sparse_matmul)
    self.splash = _splash(cfg)
    self.available, self.source = host_memory.available_memory()

  def pdbs(self, rows: int) -> str:
    return f"per_device_batch_size={_number(rows / self.devices)}"

  def why(self, rows: int, length: int) -> tuple[str, str] | None:
    """(the key to name, what breaks) for a batch of `rows` × `length`, or None; the key is "batch" when either
    per_device_batch_size or max_target_length would do."""
    if rows > limits.INT32_MAX:
      return "per_device_batch_size", f"the batch would hold {rows} sequences on {self.devices} devices, past " \
          f"{INT32_LIMIT}"
    for batch_parts, length_parts in self.parts:
      if rows % batch_parts:
        return "per_device_batch_size", (f"{rows} sequence(s) on {self.devices} devices, which the batch's "
                                         f"{batch_parts} shards ({self.mesh.describe()}) do not divide (JAX's "
                                         "IndivisibleError)")
      if length % length_parts:
        return "max_target_length", (f"the sequence's {length_parts} shards ({self.mesh.describe()}) do not divide "
                                     "it (JAX's IndivisibleError)")
    batch_parts, length_parts = self.parts[1]
    copies = (rows // batch_parts) * (length // length_parts) * self.k * self.factor
    if self.moe and copies > limits.INT32_MAX:
      buffer = f" × {self.factor}, the ragged all-to-all buffer of {self.ep} expert shards" if self.factor > 1 else ""
      return "batch", (f"the routed experts would sort {copies} token copies per device ({rows // batch_parts} "
                       f"sequence(s) × {length // length_parts} tokens × num_experts_per_tok={self.k}{buffer}), past "
                       f"{INT32_LIMIT}")
    if self.splash:
      for key in splash.BLOCK_KEYS:
        block = min(int(getattr(self.cfg, key)), length)
        if length % block:
          return "max_target_length", (f"splash attention (attention={self.cfg.attention}) cuts the sequence into "
                                       f"blocks of {key}={block}, which do not divide it")
      needed = _mask_bytes(self.cfg, length)
      if self.available is not None and needed > self.available:
        return "max_target_length", (f"splash attention's mask tables, built on this host, would take "
                                     f"{needed / 2**30:.1f} GiB; {self.source} is {self.available / 2**30:.1f} GiB")
    return None

  def check(self) -> None:
    cfg = self.cfg
    if self.splash:
      for key in splash.BLOCK_KEYS:
        if int(getattr(cfg, key)) < 1:
          raise errors.ConfigError(f"{key}={getattr(cfg, key)}: splash attention's blocks must be a positive "
                                   "integer; accepted: 1 or more (MaxText's default: 512)")
    rows, length = int(round(float(cfg.per_device_batch_size) * self.devices)), int(cfg.max_target_length)
    found = self.why(rows, length) if rows >= 1 else None  # no sequence at all: `state.abstract` names it
    if found is None:
      return
    key, what = found
    unit = math.lcm(*(parts[0] for parts in self.parts))  # sequences: a multiple of every batch sharding
    if key == "batch":  # fewer sequences when one per shard would do, else a shorter sequence
      key = "per_device_batch_size" if self.why(unit, length) is None else "max_target_length"
    if key == "per_device_batch_size":
      given, value = f"per_device_batch_size={_number(cfg.per_device_batch_size)}", rows
      most = unit * _largest(lambda n: self.why(n * unit, length) is None, limits.INT32_MAX // unit)
      multiple, largest, trivial = self.pdbs(unit), self.pdbs(most), unit == self.devices
    else:
      given, value = f"max_target_length={length}", length
      unit = math.lcm(*(parts[1] for parts in self.parts),
                      *(int(getattr(cfg, k)) for k in splash.BLOCK_KEYS if self.splash))
      most = unit * _largest(lambda n: self.why(rows, n * unit) is None, limits.INT32_MAX // unit)
      multiple, largest, trivial = f"max_target_length={unit}", f"max_target_length={most}", unit == 1
    if most == 0:
      accepted = f"accepted: none with the other keys as given ({self.pdbs(rows)}, max_target_length={length})"
    elif value <= most:  # small enough: only not a multiple
      accepted = f"accepted: a multiple of {multiple}"
    else:
      accepted = f"largest accepted: {largest}" + ("" if trivial else f" (a multiple of {multiple})")
    raise errors.ConfigError(f"{given}: {what}; {accepted}")


def _largest(ok, high: int) -> int:
  """The largest n in [0, high] with `ok(n)` (0 when none; `ok` holds for every n up to the largest)."""
  low = 0
  while low < high:
    middle = (low + high + 1) // 2
    low, high = (middle, high) if ok(middle) else (low, middle - 1)
  return low


def _shards(logical, rules, mesh, drop: str | None = None) -> tuple[int, ...]:
  """Per dimension of `logical`, the devices it is split over on `mesh`."""
  spec = rules_lib.spec_for(tuple(logical), rules, mesh)
  found = [math.prod(mesh.shape[a] for a in rules_lib.entry_axes(entry) if a != drop) for entry in spec]
  return tuple(found + [1] * (len(logical) - len(found)))


def _splash(cfg) -> bool:
  """Whether the compiled attention is the splash kernel (`model.attention`: MLA without the indexer)."""
  attention = str(cfg.attention)
  applies = attention == "flash" or attention == "autoselected" and int(cfg.max_target_length) >= splash.MIN_LENGTH
  return applies and cfg.attention_type == "mla" and cfg.decoder_block != "deepseek4" and not cfg.use_indexer


def mask_bytes(bq: int, bkv: int, length: int) -> int:
  """Host bytes that building one splash mask's tables takes, for `length` tokens in `bq` × `bkv` blocks."""
  return MASK_BYTES_PER_BLOCK * (length // bq) * (length // bkv) + 4 * bq * bkv + MASK_FIXED_BYTES


def _mask_bytes(cfg, length: int) -> int:
  """Host bytes of every splash mask's tables for a sequence of `length` (the same blocks are built once)."""
  pairs = {(dkv, min(int(getattr(cfg, q)), length), min(int(getattr(cfg, kv)), length)) for dkv, q, kv in MASK_PAIRS}
  return sum(mask_bytes(q, kv, length) for _, q, kv in pairs)
