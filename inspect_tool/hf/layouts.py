"""The Hugging Face layouts `export --layout` writes, and what each means for the writer, validation and the report.

* `deepseek-fp8`: DeepSeek-V3's FP8 release (`write_hf`); with `--scale-fmt ue8m0`, V3.1's: the same with every
  float32 `weight_scale_inv` a power of two and `scale_fmt: ue8m0` in config.json.
* `deepseek-bf16`: the same names in bfloat16, unquantized.
* `deepseek-v4`: DeepSeek-V4's release (`write_v4`): FP4 routed experts, FP8 with e8m0 scales, `expert_dtype: fp4`.
"""

from __future__ import annotations

import dataclasses

from inspect_tool import errors

NAMES = ("deepseek-fp8", "deepseek-bf16", "deepseek-v4")
SCALE_FORMATS = ("float", "ue8m0")
INTEGER_MODES = ("int8", "int4")  # MaxText quantization modes whose weights are integers: Qwix's layout only


@dataclasses.dataclass(frozen=True)
class HfLayout:
  """One `--layout` (and `--scale-fmt`) of a Hugging Face export."""

  name: str
  scale_fmt: str | None = None  # "ue8m0": power-of-two scales

  @property
  def fp8(self) -> bool:
    return self.name != "deepseek-bf16"

  @property
  def v4(self) -> bool:
    return self.name == "deepseek-v4"

  @property
  def label(self) -> str:
    """The manifest's layout name: `deepseek-fp8-ue8m0` for V3.1's."""
    return self.name + ("-ue8m0" if self.scale_fmt and not self.v4 else "")

  def report_format(self) -> dict:
    """`quantization_report.json`'s `format`: the layout and what it quantized and copied."""
    if self.v4:
      return {"layout": self.name, "scale_fmt": "ue8m0",
              "quantized": "routed experts: FP4 (int8 of two e2m1 values, low nibble first) + float8_e8m0fnu "
                           "scale per 32 values of a row; wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b and the "
                           "shared experts: float8_e4m3fn + float8_e8m0fnu scale per 128x128 block (DeepSeek-V4's "
                           "release)",
              "copied": "bfloat16 (embedding, head, norms, router, compressor and indexer projections); float32 "
                        "(mHC, hc_head, attn_sink, ape, gate bias); int32 tid2eid"}
    if not self.fp8:
      return {"layout": self.name, "quantized": None,
              "copied": "bfloat16 (every weight); e_score_correction_bias float32"}
    powers = " (every scale a power of two: scale_fmt ue8m0, DeepSeek-V3.1's)" if self.scale_fmt else ""
    return {"layout": self.name, "scale_fmt": self.scale_fmt or "float",
            "quantized": "float8_e4m3fn weight + float32 weight_scale_inv per 128x128 block of the (out, in) matrix "
                         f"(DeepSeek-V3's FP8 release){powers}: attention, dense MLP, shared and routed experts",
            "copied": "bfloat16 (router, norms, embedding, lm_head, eh_proj); e_score_correction_bias float32"}

  def options(self) -> list[str]:
    """The command-line options that choose this layout."""
    return ["--layout", self.name] + (["--scale-fmt", self.scale_fmt] if self.scale_fmt and not self.v4 else [])


def resolve(name: str, scale_fmt: str | None = None) -> HfLayout:
  """The layout of `--layout NAME [--scale-fmt FMT]`; a combination that means nothing is one line (exit 2)."""
  if name not in NAMES:
    raise errors.InputError(f"--layout {name!r} is not a Hugging Face layout; accepted: {', '.join(NAMES)}")
  if scale_fmt not in (None, *SCALE_FORMATS):
    raise errors.InputError(f"--scale-fmt {scale_fmt!r}; accepted: {', '.join(SCALE_FORMATS)}")
  if name == "deepseek-bf16" and scale_fmt == "ue8m0":
    raise errors.InputError("--scale-fmt ue8m0 with --layout deepseek-bf16: an unquantized layout has no scales; "
                            "accepted: --layout deepseek-fp8 --scale-fmt ue8m0")
  if name == "deepseek-v4" and scale_fmt == "float":
    raise errors.InputError("--scale-fmt float with --layout deepseek-v4: DeepSeek-V4's release stores ue8m0 scales; "
                            "accepted: --scale-fmt ue8m0 or none")
  fmt = "ue8m0" if name == "deepseek-v4" or scale_fmt == "ue8m0" else None
  return HfLayout(name, fmt)


def check_quantization(layout: HfLayout, quantization: str) -> None:
  """A FP8 layout quantizes as DeepSeek's release does, whatever the config's rules say: a config trained with
  integer weights (quantization=int8) is refused (one line, exit 2) rather than written as FP8 blocks."""
  if layout.fp8 and quantization in INTEGER_MODES:
    what = " ".join(layout.options())
    release = ("DeepSeek-V4's release (FP4 experts, e4m3 blocks)" if layout.v4
               else "DeepSeek's FP8 release (e4m3 blocks)")
    raise errors.InputError(f"quantization={quantization} with {what}: that layout stores {release}, not "
                            f"{quantization}; accepted: --layout orbax (Qwix's {quantization} layout), or {what} with "
                            "quantization=fp8_full or none")
