"""Compile a config's training step or forward pass for a TPU topology and read XLA's per-device memory.

`compile_program(cfg, topology, train=...)`: the model built abstractly (quantized as the config says), sharded as MaxText shards it (`state`),
traced for the topology's mesh (`model.partitioning`: activation shardings, experts and attention per device) with
the grouped matmul compiled for TPU (`quant.gmm.target`), lowered and compiled by libtpu on this host. XLA's
`CompiledMemoryStats` and the count of Mosaic kernels (`tpu_custom_call`) in the compiled program come back as a
`memory.XlaMemory`; XLA's own refusal for lack of HBM is a verdict too (`fits` False, with XLA's figure).
"""

from __future__ import annotations

import dataclasses
import re
import time

from flax import nnx
import jax

from inspect_tool import errors
from inspect_tool import model as model_lib
from inspect_tool import progress
from inspect_tool.configuration import remat_policies
from inspect_tool.coverage import trace as coverage_trace
from inspect_tool.model import partitioning
from inspect_tool.paramtree import params as params_lib
from inspect_tool.run import runner
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.sharding import placement
from inspect_tool.xla_compile import cache
from inspect_tool.xla_compile import libtpu
from inspect_tool.xla_compile import memory
from inspect_tool.xla_compile import optimizers
from inspect_tool.xla_compile import state as state_lib
from inspect_tool.xla_compile import step as step_lib
from inspect_tool.xla_compile import topology as topology_lib
from quant.gmm import target

_CUSTOM_CALL = re.compile(r'custom_call_target="tpu_custom_call"')
_OOM = re.compile(r"RESOURCE_EXHAUSTED|Ran out of memory in memory space hbm", re.IGNORECASE)


def _check(cfg, train: str | None) -> None:
  policy = str(cfg.remat_policy)
  if train and policy not in remat_policies.POLICIES:
    raise errors.ConfigError(f"remat_policy={errors.shown(policy)}: not one of MaxText's policies; accepted: "
                             f"remat_policy={', '.join(remat_policies.POLICIES)}")
  if not bool(cfg.scan_layers):
    raise errors.ConfigError("scan_layers=false: --compile builds MaxText's scanned decoder only; accepted: "
                             "scan_layers=true")


def _model(cfg):
  """The model the program runs, abstractly: under the config's quantization (Qwix QT, as `forward`, the export's
  validation and MaxText's training run it) when it has rules."""
  if not coverage_trace.config_rules(cfg):
    return model_lib.build_model(cfg, abstract=True)
  return nnx.eval_shape(lambda: runner.quantize_for_training(model_lib.build_model(cfg, abstract=False), cfg))


def _lower(cfg, train: str | None, abstract: state_lib.Abstract):
  if train:
    tx = optimizers.optimizer(cfg, train)
    opt_state = jax.eval_shape(tx.init, abstract.params)
    opt_sharding = state_lib.optimizer_sharding(opt_state, abstract.params, abstract.params_sharding, abstract.mesh)
    fn = jax.jit(step_lib.train_step(abstract.graphdef, tx, cfg),
                 in_shardings=(abstract.params_sharding, opt_sharding, abstract.rest_sharding, abstract.batch_sharding),
                 out_shardings=(abstract.params_sharding, opt_sharding, None), donate_argnums=(0, 1))
    return fn.lower(abstract.params, opt_state, abstract.rest, abstract.batch)
  fn = jax.jit(step_lib.forward(abstract.graphdef, cfg),
               in_shardings=(abstract.params_sharding, abstract.rest_sharding, abstract.batch_sharding))
  return fn.lower(abstract.params, abstract.rest, abstract.batch)


def maxtexts_kernel(cfg):
  """`cfg` with the grouped-matmul kernel MaxText compiles: with `gmm_backend=auto` (and no Tokamax), JAX's Megablox,
  which MaxText's own kernel is derived from. Our Pallas kernel (`gmm_backend=pallas`) is faster on a chip, but its
  scoped memory is not MaxText's: 1.49 x MaxText's peak for deepseek3-tiny at batch 1 x 256 on v5e-8, against
  0.97 x with Megablox (tests/test_xla_family.py)."""
  if cfg.gmm_backend != "auto" or cfg.use_tokamax_backend:
    return cfg
  return dataclasses.replace(cfg, gmm_backend="megablox")


def lower(cfg, devices: list, *, train: str | None = None):
  """(`cfg`'s training step or forward pass lowered for `devices`, its abstract inputs): compile-only TPU devices
  of a topology, or a TPU host's own devices (the same program, compiled and run there: bench_tpu_device)."""
  _check(cfg, train)
  cfg = maxtexts_kernel(cfg)
  leaves = params_lib.param_leaves(model_lib.build_model(cfg, abstract=True), include_non_params=True)
  model = _model(cfg)
  model.decoder.remat_policy = str(cfg.remat_policy) if train else None
  model.decoder.remat_cfg = cfg
  plan = placement.plan(leaves, cfg, len(devices))
  mesh = state_lib.device_mesh(plan, devices)
  abstract = state_lib.abstract(model, cfg, plan, mesh)
  with (partitioning.partitioned(state_lib.activation_partitioning(cfg, plan, mesh)),
        target.compiling_for("tpu", devices[0].device_kind)):
    return _lower(cfg, train, abstract), abstract


def compile_program(cfg, topology: str, *, train: str | None = None, limit: int | None = None) -> memory.XlaMemory:
  """XLA's per-device memory of `cfg`'s training step (`train`: the optimizer) or forward pass on `topology`."""
  _check(cfg, train)
  slices = mesh_lib.num_slices(cfg)
  devices = topology_lib.devices(topology, slices)
  chip = mesh_lib.topology_chip(topology)
  program = "train" if train else "forward"
  start = time.perf_counter()
  with progress.step(f"compiling the {'training step' if train else 'forward pass'} for {topology} (libtpu)"):
    lowered, _ = lower(cfg, devices, train=train)
    entry = cache.key(lowered.as_text(), topology, slices, libtpu.require())
    kept = cache.load(entry)
    cached = kept is not None
    if not cached:
      kept = xla_figures(lowered)
      cache.store(entry, kept)
  limit, seconds = limit or chip.memory, time.perf_counter() - start
  if "refusal" in kept:
    return memory.XlaMemory.refused(program, topology, kept["refusal"], limit, seconds, cached)
  return memory.XlaMemory(program, topology, kept["stats"], kept["tpu_custom_calls"], limit, seconds, None, cached)


def xla_figures(lowered) -> dict:
  """XLA's memory figures and Mosaic kernel count of `lowered` compiled, or its refusal for lack of HBM."""
  jax.config.update("jax_enable_compilation_cache", False)  # JAX cannot load back a compile-only executable
  try:
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except  (XLA's JaxRuntimeError)
    if not _OOM.search(str(e)):
      raise
    return {"refusal": errors.first_line(e)}
  return figures(compiled)


def figures(compiled) -> dict:
  """The `CompiledMemoryStats` fields and the count of Mosaic kernels of a compiled program."""
  stats = compiled.memory_analysis()
  return {"stats": {f: int(getattr(stats, f)) for f in memory.FIELDS},
          "tpu_custom_calls": len(_CUSTOM_CALL.findall(compiled.as_text()))}
