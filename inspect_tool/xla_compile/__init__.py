"""XLA's own verdict: compile a config's training step or forward pass for a TPU topology from any host (libtpu).

Modules: `libtpu` (installed at JAX's pin? its start-up environment), `topology` (MaxText's TPU slice names → the
devices to compile for), `state` (abstract parameters, optimizer state and batch with MaxText's shardings), `step`
(the training step and the forward pass), `sizes` (what the traced program and this host can hold, checked first),
`build` (trace, lower, compile; XLA's memory), `memory` (the record, its peak and verdict), `report` (text and JSON
beside the analytic plan).
"""

from __future__ import annotations

from inspect_tool.sharding import invocation as invocation_lib
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.xla_compile import build
from inspect_tool.xla_compile import libtpu
from inspect_tool.xla_compile import report as report_lib
from inspect_tool.xla_compile import sizes


def judge(cfg, topology: str, *, train: str | None = None, device_memory: str | None = None, leaves=None,
          plan_memory=None, overrides=None) -> report_lib.XlaVerdict:
  """XLA's verdict on `cfg` for `topology`: the compiled program's memory, beside `plan_memory` (the analytic plan
  of `leaves`, when given), with advice calibrated to XLA when its peak does not fit."""
  limit, source = invocation_lib.limit_of(device_memory, topology)
  sizes.check(cfg, topology)
  version = libtpu.require()
  result = build.compile_program(cfg, topology, train=train, limit=limit)
  devices = mesh_lib.topology_devices(topology) * mesh_lib.num_slices(cfg)
  advice = None
  if leaves is not None and plan_memory is not None:
    call = None if overrides is None else invocation_lib.Invocation(tuple(overrides), None, topology, train,
                                                                      device_memory)
    advice = report_lib.xla_advice(leaves, cfg, devices, plan_memory, result, call)
  return report_lib.XlaVerdict(result, version, devices, source, train, plan_memory, advice)
