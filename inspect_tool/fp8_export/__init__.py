"""`inspect_checkpoint export`: the quantization-applied model of a config, written as an FP8 checkpoint.

One module per stage of the flow, in order:

* `plan`: which weights a quantizing op consumes, and at which granularity (traces the config's Qwix rules);
* `budget`: `--max-memory`, and how each array is cut into slices that fit it;
* `read`: the source arrays (an Orbax checkpoint through tensorstore, or the seeded init), slice by slice;
* `quantize`: the quantizer of every block shape (`quant.ptq_weights`), compiled ahead in the background;
* `write_orbax`: quantize and write the Orbax checkpoint (Qwix PTQ layout) slice by slice;
  `write_hf`: the Hugging Face DeepSeek-V3 FP8 release layout (`--layout deepseek-fp8`) instead;
* `validate`: the export, loaded back, against its source on a batch;
* `report`: `quantization_report.json` and the printed summary;
* `load`: an export loaded into the quantized model (`forward --checkpoint`, `diff`, validation);
* `pipeline`: the stages run in order inside a claimed, locked destination that appears atomically.
"""
