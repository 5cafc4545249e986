"""`inspect_checkpoint export`: the quantization-applied model of a config, written as an FP8 checkpoint.

It stands on the streaming layer (`inspect_tool.streaming`: reads and writes of arrays within `--max-memory`) and on
the export plan (`inspect_tool.coverage.plan`: which weights a quantizing op consumes, and at which granularity). Its
own modules, in the order of the flow:

* `quantize`: the quantizer of every block shape (`quant.ptq_weights`), compiled ahead in the background, handed to
  `streaming.write_orbax` for the Orbax layout (Qwix PTQ's);
* `write_hf` (with `hf_matrices`, `hf_rows`): the Hugging Face DeepSeek-V3 FP8 release layout (`--layout
  deepseek-fp8`) instead;
* `validate`: the export, loaded back (`checkpoint.load_export`), against its source on a batch;
* `report`: `quantization_report.json` and the printed summary;
* `pipeline`: the stages run in order inside a claimed, locked destination that appears atomically.
"""
