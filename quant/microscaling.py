"""Microscaling numerics of DeepSeek-V4 and V3.1 releases: FP4 (e2m1) values two to a byte, e8m0 (ue8m0) scales.

* e2m1 (`float4_e2m1fn`): sign, 2 exponent bits, 1 mantissa bit; the values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, no inf
  or NaN. Code bit 3 is the sign, bits 0-2 the magnitude's index in that list. Rounding is to nearest, ties to
  the even code (as `ml_dtypes` casts); magnitudes beyond 6 saturate to 6; a negative value that rounds to 0 keeps
  its sign (-0). NaN or inf in a weight is refused (`QuantError`): e2m1 cannot hold them.
* Packing: two codes per byte along the last axis, element 2i in the low nibble, 2i+1 in the high one (DeepSeek's
  `float4_e2m1fn_x2`, the order transformers 5.24 unpacks: `lut[b & 0xF], lut[b >> 4]`).
* e8m0 (`float8_e8m0fnu`, DeepSeek's "ue8m0"): one byte, the scale 2^(byte - 127); 255 is NaN, there is no zero or
  sign. Byte b is exactly float32's biased exponent field of 2^(b-127) for b >= 1, which is how the codes are
  computed here. A scale is the smallest power of two at or above absmax / qmax (`pow2_ceil`), so that every value
  divided by it fits the element type without saturating, and the division is exact.
* Zero and tiny blocks: an all-zero block gets scale 1 (byte 127), as transformers' FP8 quantizer gives; a scale
  below 2^-126 is raised to 2^-126 (byte 1), so that the float32 arithmetic stays in normal numbers (the block's
  values then round towards zero; XLA on the CPU flushes subnormal inputs to zero, so a block of only subnormal
  values is a zero block). A scale never saturates upwards: absmax / 6 of a finite float32 is below 2^127.

`fp4_quantize` / `fp4_dequantize`: DeepSeek-V4's routed experts, one e8m0 scale per 32 consecutive values of a row
(the Linear's input axis). `quant.fp8.block_quantize(..., power_of_two=True)` gives the 128 × 128 FP8 blocks with
power-of-two scales (`scale_fmt: ue8m0`). The encoders are `jax.numpy` (they run under `jit`); the decoders
numpy (exact: XLA on the CPU flushes the subnormal 2^-127 to zero).
"""

from __future__ import annotations

import numpy as np

from quant import errors

E2M1_MAX = 6.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)
# Rounding thresholds between consecutive magnitudes and whether a tie goes up (to the even code) or down.
THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
E8M0_BIAS = 127
E8M0_NAN = 255
FP4_GROUP = 32  # values per e8m0 scale along a routed expert's input axis
MIN_SCALE_EXPONENT = -126  # scales below 2^-126 are raised to it (float32's smallest normal)


def e2m1_decode(codes) -> np.ndarray:
  """float32 values of e2m1 codes (the low 4 bits of each uint8)."""
  return E2M1_VALUES[np.asarray(codes).view(np.uint8) & 0xF]


def unpack_e2m1(packed) -> np.ndarray:
  """(..., n) bytes (uint8 or int8) → (..., 2n) codes, low nibble first."""
  packed = np.asarray(packed).view(np.uint8)
  return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def e8m0_decode(codes) -> np.ndarray:
  """float32 2^(code - 127) of uint8 codes (code 0 is 2^-127, a float32 subnormal); code 255 is NaN."""
  codes = np.asarray(codes).view(np.uint8).astype(np.int32)
  value = np.ldexp(np.float32(1.0), np.minimum(codes, E8M0_NAN - 1) - E8M0_BIAS).astype(np.float32)
  return np.where(codes == E8M0_NAN, np.float32(np.nan), value)


def check_finite(w, what: str = "weight") -> None:
  """Refuses NaN or inf (outside `jit`): e2m1 and e8m0 have no encoding of them."""
  w = np.asarray(w)
  bad = ~np.isfinite(w)
  if bad.any():
    index = np.unravel_index(int(np.argmax(bad)), w.shape)
    raise errors.QuantError(f"{what} holds {int(bad.sum())} NaN or inf value(s), e.g. {w[index]!r} at "
                            f"{list(map(int, index))}; FP4 (e2m1) and ue8m0 scales cannot encode them")


def fp4_dequantize(packed, scale_codes, group: int = FP4_GROUP) -> np.ndarray:
  """float32 (..., 2 * packed cols) of packed e2m1 bytes times their e8m0 scale per `group` values (numpy, exact)."""
  values = e2m1_decode(unpack_e2m1(packed))
  scale = np.repeat(e8m0_decode(scale_codes), group, axis=-1)
  if scale.shape != values.shape:
    raise errors.QuantError(f"FP4 scales of shape {tuple(np.shape(scale_codes))} do not fit packed values of "
                            f"shape {tuple(np.shape(packed))} in groups of {group}")
  with np.errstate(over="ignore"):  # 6 x 2^127 is beyond float32: inf, as any float32 reader computes it
    return values * scale
