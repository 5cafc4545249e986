"""XLA's per-device memory beside the analytic plan, the verdict taken from XLA's numbers, and its advice.

The advice: when XLA's peak does not fit, the analytic plan is scaled to agree with XLA here (its needed bytes ×
XLA's peak / the plan's) and `sharding.advice` finds the ways that fit under that calibration; each way is printed
as its `maxtext ... --compile` line, to be checked by XLA in turn.
"""

from __future__ import annotations

import dataclasses

from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.sharding import advice as advice_lib
from inspect_tool.sharding import invocation as invocation_lib
from inspect_tool.xla_compile import memory as memory_lib

ROWS = (("arguments", "argument_size_in_bytes"), ("outputs", "output_size_in_bytes"),
        ("aliases (donated)", "alias_size_in_bytes"), ("temporaries", "temp_size_in_bytes"),
        ("generated code", "generated_code_size_in_bytes"))
PROGRAMS = {"train": "the training step", "forward": "the forward pass"}


@dataclasses.dataclass(frozen=True)
class XlaVerdict:
  """One compiled program's XLA memory, the analytic plan of the same keys (None without one), the advice."""

  result: memory_lib.XlaMemory
  libtpu: str
  devices: int
  limit_source: str
  train: str | None = None
  plan: object = None  # sharding.memory.DeviceMemory
  advice: object = None  # sharding.advice.Advice when XLA's peak does not fit

  @property
  def fits(self) -> bool:
    return self.result.fits

  @property
  def ratio(self) -> float | None:
    """The analytic plan's needed bytes / XLA's peak."""
    if self.plan is None or self.result.peak is None or not self.result.peak:
      return None
    return self.plan.needed / self.result.peak

  def verdict(self) -> str:
    hb, r = summary_lib.human_bytes, self.result
    head = f"{self.limit_source}: "
    if r.refusal is not None:
      used = (f" (XLA needs {hb(r.xla_used)})" if r.xla_used else
              f" (XLA needs {hb(r.xla_temporaries)} of temporaries alone)" if r.xla_temporaries else "")
      return head + f"DOES NOT FIT: XLA refused to compile for lack of HBM{used}: {r.refusal}"
    if r.fits:
      return head + f"XLA's peak {hb(r.peak)}: fits ({hb(r.limit - r.peak)} to spare)"
    return head + f"XLA's peak {hb(r.peak)}: DOES NOT FIT (short by {hb(r.peak - r.limit)})"

  def text_lines(self) -> list[str]:
    hb, r = summary_lib.human_bytes, self.result
    what = PROGRAMS[r.program] + (f" with {self.train}" if self.train else "")
    how = "an earlier compile, from the cache" if r.cached else f"{r.seconds:.0f} s"
    out = ["", f"XLA's per-device memory ({what}, compiled for {r.topology}: {self.devices} devices, libtpu "
           f"{self.libtpu}, {how}):"]
    if r.stats is not None:
      for label, field in ROWS:
        out.append(f"  {label:<20}{hb(r.stats[field]):>12}")
      out.append(f"  {'peak':<20}{hb(r.peak):>12}   (code + arguments + outputs - aliases + temporaries)")
      out.append(f"  Mosaic kernels in the program (tpu_custom_call): {r.tpu_custom_calls}")
    if self.ratio is not None:
      out.append(f"  The analytic plan needs {hb(self.plan.needed)} per device: {self.ratio:.2f} × XLA's peak.")
    out.append(self.verdict())
    if self.advice is not None:
      scale = f" (its figures × {1 / self.ratio:.2f})" if self.ratio else ""
      out.append(f"What would fit, from the plan calibrated to XLA's peak{scale}; each line compiles again:")
      out += self.advice.report_lines()
    return out

  def markdown_lines(self) -> list[str]:
    r = self.result
    out = ["", "## XLA's per-device memory", "", "| | bytes |", "|---|---:|"]
    if r.stats is not None:
      out += [f"| {label} | {r.stats[field]} |" for label, field in ROWS] + [f"| peak | {r.peak} |"]
    return out + ["", self.verdict()]

  def to_dict(self) -> dict:
    return {r_key: self.result.to_dict() for r_key in (self.result.program,)} | {
        "fits": self.fits, "libtpu": self.libtpu, "devices": self.devices, "optimizer": self.train,
        "plan_needed_bytes": self.plan.needed if self.plan is not None else None, "plan_over_xla": self.ratio,
        "advice": self.advice.to_dict() if self.advice is not None else None}


def xla_advice(leaves, cfg, devices: int, plan_mem, result: memory_lib.XlaMemory,
               call: invocation_lib.Invocation | None):
  """The ways to fit, planned under the plan calibrated to XLA's peak (None when XLA's peak fits, or without a
  plan to calibrate)."""
  if result.fits or plan_mem is None:
    return None
  xla_needed = result.peak if result.peak is not None else result.xla_used
  if not xla_needed and result.xla_temporaries:  # beside them the arguments: the plan's state, XLA's to 0.1 %
    padding = plan_mem.activations.layout.state_padding if plan_mem.activations is not None else 0
    xla_needed = result.xla_temporaries + plan_mem.total.params + plan_mem.total.optimizer + padding
  if not xla_needed:
    return None
  usable = min(result.limit, result.xla_available or result.limit)  # XLA's usable HBM, where its refusal says it
  planning_limit = int(usable * plan_mem.needed / xla_needed)
  scaled = dataclasses.replace(plan_mem, limit=planning_limit, limit_source=advice_lib.XLA_SCALE)
  if call is not None:
    call = dataclasses.replace(call, compile=True, planning_limit=planning_limit)
  return advice_lib.advise(leaves, cfg, devices, scaled, call)
