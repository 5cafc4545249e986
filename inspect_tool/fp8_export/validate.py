"""Export stage 5, validation: the export loaded back, against its source on a batch.

The export read back is compared per head (main, each MTP depth) with the source run with the export's own
numerics (gated), and with the source unquantized (information): cosine, top-1 agreement, KL, relative error.
* The Orbax (Qwix) layout loads into the quantized model (`load_export`: its stored FP8 values); its own numerics
  are the config's rules on the fly (Qwix QT), which it reproduces.
* `deepseek-fp8` is read through the Hugging Face reader (`hf_restore`: fp8 × `weight_scale_inv` of its 128×128
  block); its own numerics are DeepSeek's serving ones (`layout_numerics`): the source's weights through the same
  128×128 e4m3 blocks and, on both sides, activations quantized 1×128 before every FP8 Linear. Running that export
  under the config's Qwix rules would quantize its weights a second time, per channel.
The gate is the KL divergence of every head from the source under the export's numerics: at most `max_kl` nats
(0.015 by default, MaxText's `max_kl_div`), so an exact write passes at about 0 and top-1 agreement on nearly flat
logits (a random init) cannot fail it; top-1 and cosine stay in the report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inspect_tool import model as model_lib
from inspect_tool import progress
from inspect_tool.checkpoint import load_export
from inspect_tool.hf import restore as hf_restore
from inspect_tool.fp8_export import layout_numerics
from inspect_tool.run import runner as running
from quant import metrics

DEFAULT_MAX_KL = 0.015  # nats per position, MaxText's `max_kl_div`
GATE = "kl of every head vs the source under the export's own numerics <= max_kl (nats)"
# The three forward passes, as the progress output names them (numbered in the order they run).
SOURCE_QUANTIZED, SOURCE_PLAIN, EXPORT = "source under the export's numerics", "source unquantized", "the export read back"
QWIX_NUMERICS = "the config's rules, Qwix QT"
LAYOUT_NUMERICS = "128x128 e4m3 weight blocks, 1x128 e4m3 activations"  # DeepSeek's FP8 serving numerics
BF16_NUMERICS = "bf16 weights, unquantized"
V4_NUMERICS = ("fp4 experts (e2m1, ue8m0 per 32 values), 128x128 e4m3 blocks with ue8m0 scales, bf16 / float32 "
               "rest; activations unquantized")


@dataclasses.dataclass(frozen=True)
class Validation:
  """Exported model vs the source under the export's own numerics (gated) and vs the unquantized source."""

  vs_quantized: tuple  # metrics.HeadComparison per head
  vs_unquantized: tuple
  max_kl: float
  batch_shape: tuple[int, int]
  tokens: str  # "fixed" or the tokens file
  numerics: str = QWIX_NUMERICS  # what the source ran under for `vs_quantized`
  method: str = ("whole models, one at a time: the source (under the export's numerics, then unquantized), then "
                 "the export read back")
  result: Any = dataclasses.field(default=None, compare=False, repr=False)  # the exported model's ForwardResult

  @property
  def passed(self) -> bool:
    return all(row.kl <= self.max_kl for row in self.vs_quantized)

  def to_dict(self) -> dict:
    return {"batch_shape": list(self.batch_shape), "tokens": self.tokens, "max_kl": self.max_kl,
            "passed": self.passed, "method": self.method, "gate": GATE, "numerics": self.numerics,
            "vs_quantized_source": [r.to_dict() for r in self.vs_quantized],
            "vs_unquantized_source": [r.to_dict() for r in self.vs_unquantized]}


def validate(cfg, source, exported, data, *, max_kl: float = DEFAULT_MAX_KL, mesh=None,
             tokens: str = "fixed") -> Validation:
  """Runs source (QT and unquantized; a path, None for the random init, or the `weights.Weights` its command
  resolved) and the exported Orbax checkpoint (its path, or the `locate.ResolvedPath` its writer wrote) on `data`
  and compares them per head."""
  model = running.load_model(cfg, source, mesh=mesh)
  quantized = running.forward(running.quantize_for_training(model, cfg), data, f"validation 1/3: {SOURCE_QUANTIZED}")
  plain = running.forward(model, data, f"validation 2/3: {SOURCE_PLAIN}")
  del model
  return _compare(quantized, plain, data, lambda: load_export.load_quantized_model(cfg, exported, mesh=mesh),
                  max_kl=max_kl, tokens=tokens)


def validate_hf(cfg, source, exported: str, data, *, layout, max_kl: float = DEFAULT_MAX_KL,
                mesh=None, tokens: str = "fixed") -> Validation:
  """The same for a Hugging Face export (`layout`: `hf_layouts.HfLayout`), under the layout's own numerics
  (`layout_numerics`): the source with its weights as the layout stores them (`deepseek-fp8`: 128×128 e4m3 blocks,
  bf16 rest) and the export read back dequantized (`hf_restore`), both with activations quantized 1×128.
  `deepseek-bf16`: every weight in bf16, activations as they are; `deepseek-v4`: FP4 experts, power-of-two FP8
  blocks, bf16 / float32 rest, activations as they are."""
  fp8 = layout.fp8 and not layout.v4  # activations quantized 1x128 (DeepSeek-V3's serving numerics)
  model = running.load_model(cfg, source, mesh=mesh)
  plain = running.forward(model, data, f"validation 1/3: {SOURCE_PLAIN}")
  with progress.step("the source's weights as the layout stores them", plain=True):
    model = layout_numerics.layout_weights(model, cfg, layout)
  numerics = layout_numerics.under_layout if fp8 else (lambda m, _: m)
  quantized = running.forward(numerics(model, cfg), data, f"validation 2/3: {SOURCE_QUANTIZED}")
  del model

  def read_back():
    return numerics(hf_restore.load_checkpoint(model_lib.build_model(cfg, abstract=True), exported, mesh=mesh), cfg)

  stored = ("fp4 x e8m0 per 32 values (experts), fp8 x e8m0 of its 128x128 block" if layout.v4 else
            "fp8 x weight_scale_inv of its 128x128 block, activations 1x128" if fp8 else "bf16 weights")
  method = ("whole models, one at a time: the source (unquantized, then under the layout's numerics), then the "
            f"export read back ({stored})")
  names = V4_NUMERICS if layout.v4 else LAYOUT_NUMERICS if fp8 else BF16_NUMERICS
  if layout.scale_fmt and not layout.v4:
    names = names.replace("128x128 e4m3 weight blocks", "128x128 e4m3 weight blocks with power-of-two scales")
  return dataclasses.replace(_compare(quantized, plain, data, read_back, max_kl=max_kl, tokens=tokens),
                             numerics=names, method=method)


def _compare(quantized, plain, data, read_export, *, max_kl, tokens) -> Validation:
  with progress.step("loading the exported checkpoint", plain=True):
    exported_model = read_export()
  result = running.forward(exported_model, data, f"validation 3/3: {EXPORT}")
  del exported_model
  return Validation(tuple(metrics.compare_heads(quantized, result)), tuple(metrics.compare_heads(plain, result)),
                    float(max_kl), tuple(int(d) for d in data.tokens.shape), tokens, result=result)


# What compiling the three forward passes holds beside the models (XLA on the CPU, no compilation cache). Measured
# (tests/test_export_validate_memory.py's models, --no-compile-cache): validation added 0.42 GB to the peak RSS
# for a 68 MB float model and 0.61 GB for a 176 MB one, about 0.3 GB + 1.7 times the model. The deepseek-fp8 layout's
# validation (the source under the layout's own numerics, activation tiles included) peaked 0.9 MiB over 2 x the
# model + 384 MiB in its memory cgroup (2026-12-06): 64 MiB more for its extra programs.
COMPILE_BYTES = 448 * 2**20


def memory_needed(source_bytes: int) -> int:
  """About the peak bytes validation adds: one model at a time (the float source is the larger) and its forward
  pass's temporaries, counted as a second copy, and compiling the forward passes (`COMPILE_BYTES`)."""
  return 2 * int(source_bytes) + COMPILE_BYTES
