"""How an FP8 scale is calibrated: the accepted spellings of `calibration`, parsed and checked (no JAX)."""

from __future__ import annotations

from quant import errors

CALIBRATIONS = ("absmax", "absmax,<factor>", "rms,<factor>", "fixed,<bound>", "fixed,<-bound>,<bound>")


def parse_calibration(calibration: str) -> tuple[str, tuple[float, ...]]:
  """Splits '<method>[,<args>]' and validates it for symmetric fp8 quantization."""
  method, *raw = str(calibration).strip().lower().split(",")
  try:
    args = tuple(float(a) for a in raw)
  except ValueError:
    args = None
  bad = args is None
  if not bad and method == "absmax":
    bad = len(args) > 1
  elif not bad and method == "rms":
    bad = len(args) != 1
  elif not bad and method == "fixed":
    if len(args) == 1:
      args = (-args[0], args[0])
    bad = len(args) != 2 or args[0] > 0 or args[1] < 0 or args[0] >= args[1] or args[0] + args[1] != 0
  elif not bad:
    bad = True
  if bad:
    raise errors.QuantError(
        f"unsupported calibration method {calibration!r} for fp8; accepted: {', '.join(CALIBRATIONS)}")
  return method, args
