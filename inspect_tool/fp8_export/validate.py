"""Export stage 5, validation: the export loaded back, against its source on a batch.

The source is run under the config's rules on the fly (Qwix QT: the quantization-applied model) and
unquantized, then the exported checkpoint read back, one model after the other, and they are compared per head
(main, each MTP depth): cosine, top-1 agreement, KL, relative error. The Orbax layout is read back into the
quantized model (`load`: its stored FP8 values); the `deepseek-fp8` layout through the Hugging Face reader
(`checkpoint.hf_restore`: fp8 × `weight_scale_inv` of its 128×128 block) and run under the same rules as the
source. The gate (`min_top1`) is the top-1 agreement of every head with the source under the rules; the
comparison with the unquantized source is information (the cost of quantizing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inspect_tool import model as model_lib
from inspect_tool import progress
from inspect_tool.checkpoint import load_export
from inspect_tool.checkpoint import hf_restore
from inspect_tool.run import runner as running
from quant import metrics

DEFAULT_MIN_TOP1 = 0.9
# The three forward passes, in the order they run, as the progress output names them.
PASSES = ("1/3: source under the rules (Qwix QT)", "2/3: source unquantized", "3/3: the export read back")


@dataclasses.dataclass(frozen=True)
class Validation:
  """Exported model vs the source under the same rules (gated) and vs the unquantized source (information)."""

  vs_quantized: tuple  # metrics.HeadComparison per head
  vs_unquantized: tuple
  min_top1: float
  batch_shape: tuple[int, int]
  tokens: str  # "fixed" or the tokens file
  method: str = ("whole models, one at a time: the source (under the rules, then unquantized), then the export")
  result: Any = dataclasses.field(default=None, compare=False, repr=False)  # the exported model's ForwardResult

  @property
  def passed(self) -> bool:
    return all(row.top1_agreement >= self.min_top1 for row in self.vs_quantized)

  def to_dict(self) -> dict:
    return {"batch_shape": list(self.batch_shape), "tokens": self.tokens, "min_top1": self.min_top1,
            "passed": self.passed, "method": self.method,
            "gate": "top1_agreement of every head vs the source under the same rules (QT)",
            "vs_quantized_source": [r.to_dict() for r in self.vs_quantized],
            "vs_unquantized_source": [r.to_dict() for r in self.vs_unquantized]}


def validate(cfg, source: str | None, exported: str, data, *, min_top1: float = DEFAULT_MIN_TOP1, mesh=None,
             tokens: str = "fixed") -> Validation:
  """Runs source (QT and unquantized) and the exported Orbax checkpoint on `data` and compares them per head."""
  return _compare(cfg, source, data, lambda: load_export.load_quantized_model(cfg, exported, mesh=mesh),
                  min_top1=min_top1, mesh=mesh, tokens=tokens)


def validate_hf(cfg, source: str | None, exported: str, data, *, min_top1: float = DEFAULT_MIN_TOP1, mesh=None,
                tokens: str = "fixed") -> Validation:
  """The same for a `deepseek-fp8` export: read back dequantized (`hf_restore`), run under the config's rules."""
  def read_back():
    model = hf_restore.load_checkpoint(model_lib.build_model(cfg, abstract=True), exported, mesh=mesh)
    return running.quantize_for_training(model, cfg)

  method = ("whole models, one at a time: the source (under the rules, then unquantized), then the export read "
            "back (fp8 x weight_scale_inv of its 128x128 block) under the same rules")
  return dataclasses.replace(_compare(cfg, source, data, read_back, min_top1=min_top1, mesh=mesh, tokens=tokens),
                             method=method)


def _compare(cfg, source, data, read_export, *, min_top1, mesh, tokens) -> Validation:
  model = running.load_model(cfg, source, mesh=mesh)
  quantized = running.forward(running.quantize_for_training(model, cfg), data, f"validation {PASSES[0]}")
  plain = running.forward(model, data, f"validation {PASSES[1]}")
  del model
  with progress.step("loading the exported checkpoint", plain=True):
    exported_model = read_export()
  result = running.forward(exported_model, data, f"validation {PASSES[2]}")
  del exported_model
  return Validation(tuple(metrics.compare_heads(quantized, result)), tuple(metrics.compare_heads(plain, result)),
                    float(min_top1), tuple(int(d) for d in data.tokens.shape), tokens, result=result)


# What compiling the three forward passes holds beside the models (XLA on the CPU, no compilation cache). Measured
# (tests/test_export_validate_memory.py's models, --no-compile-cache): validation added 0.42 GB to the peak RSS
# for a 68 MB float model and 0.61 GB for a 176 MB one, about 0.3 GB + 1.7 times the model.
COMPILE_BYTES = 384 * 2**20


def memory_needed(source_bytes: int) -> int:
  """About the peak bytes validation adds: one model at a time (the float source is the larger) and its forward
  pass's temporaries, counted as a second copy, and compiling the forward passes (`COMPILE_BYTES`)."""
  return 2 * int(source_bytes) + COMPILE_BYTES
