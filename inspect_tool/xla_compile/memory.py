"""XLA's per-device memory of a compiled program (`CompiledMemoryStats`), its peak, and the verdict.

peak = generated code + arguments + outputs − aliases (donated inputs reused as outputs) + temporaries: what one
device holds at once while the program runs. The verdict compares it with the memory of one device. When XLA
itself refuses to compile for lack of HBM, the verdict is "does not fit" with XLA's own message and figures.
"""

from __future__ import annotations

import dataclasses
import re

FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
          "generated_code_size_in_bytes")
_USED = re.compile(r"Used\s+([0-9.]+)([KMGT]?)\s+of\s+([0-9.]+)([KMGT]?)\s+hbm", re.IGNORECASE)
# libtpu 0.0.50's words when the temporaries alone overflow: "... required for HLO temporaries (18.89G) exceeds ..."
_TEMPORARIES = re.compile(r"HLO temporaries\s+\(([0-9.]+)([KMGT]?)\)\s+exceeds available HBM\s+\(([0-9.]+)([KMGT]?)\)",
                          re.IGNORECASE)
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _figure(message: str | None, pattern: re.Pattern, group: int) -> int | None:
  """Bytes of the size at `group` (its number; the unit follows) of `pattern` in XLA's `message`, if it is there."""
  found = pattern.search(message or "")
  return int(float(found.group(group)) * _UNIT[found.group(group + 1).upper()]) if found else None


@dataclasses.dataclass(frozen=True)
class XlaMemory:
  """One compiled program's per-device bytes (None where XLA refused it), Mosaic kernels, and the device's memory."""

  program: str  # "train" or "forward"
  topology: str
  stats: dict | None  # CompiledMemoryStats field → bytes
  tpu_custom_calls: int | None
  limit: int
  seconds: float
  refusal: str | None = None  # XLA's out-of-memory message
  cached: bool = False  # read from the cache of an earlier compile of the same program (`cache`)

  @classmethod
  def refused(cls, program, topology, message: str, limit: int, seconds: float, cached: bool = False) -> XlaMemory:
    return cls(program, topology, None, None, limit, seconds, message, cached)

  @property
  def peak(self) -> int | None:
    if self.stats is None:
      return None
    s = self.stats
    return (s["generated_code_size_in_bytes"] + s["argument_size_in_bytes"] + s["output_size_in_bytes"]
            - s["alias_size_in_bytes"] + s["temp_size_in_bytes"])

  @property
  def xla_used(self) -> int | None:
    """With a refusal: the bytes XLA said it needed (its "Used X of Y hbm"), when it said so."""
    return _figure(self.refusal, _USED, 1)

  @property
  def xla_temporaries(self) -> int | None:
    """With a refusal: XLA's temporaries, when it said only that they alone exceed the device's HBM."""
    return _figure(self.refusal, _TEMPORARIES, 1)

  @property
  def xla_available(self) -> int | None:
    """With a refusal: the HBM XLA said it can use (below the chip's nominal memory), when it said so."""
    return _figure(self.refusal, _USED, 3) or _figure(self.refusal, _TEMPORARIES, 3)

  @property
  def fits(self) -> bool:
    return self.refusal is None and self.peak <= self.limit

  def to_dict(self) -> dict:
    out = dict(self.stats or {f: None for f in FIELDS})
    out.update(peak_bytes=self.peak, tpu_custom_calls=self.tpu_custom_calls, device_memory_bytes=self.limit,
               fits=self.fits, topology=self.topology, compile_seconds=round(self.seconds, 1), from_cache=self.cached)
    if self.refusal is not None:
      out.update(xla_refusal=self.refusal, xla_used_bytes=self.xla_used, xla_temporaries_bytes=self.xla_temporaries)
    return out
