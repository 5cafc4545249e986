"""Streaming arrays: bounded reads and writes of checkpoint arrays, under `--max-memory`.

The layer `export` and `import` both stand on. One module per job, in the order the data passes:

* `budget`: `--max-memory`, the process's resident memory, and how an array is cut into slices;
* `source`: the interface every array source implements (`ArraySource`: what it must give, what it may, with
  defaults), and `Keyed`, its figures per array key;
* `read`: the source arrays (an Orbax checkpoint through tensorstore, or a seeded init), box by box, decodes counted;
* `read_plan`: chunk-aligned boxes cut into slices, and the smallest budget that reads an array (the floor);
* `box_reads`: boxes in order, up to two read ahead within and across arrays as the budget holds them;
* `chunk_stream`: an array stored as one chunk, decoded front to back into its boxes;
* `absmax_ahead`: pass 1 of streamed two-pass weights, in a thread of its own;
* `write_orbax`, `orbax_writer`: every array into an Orbax checkpoint (OCDBT + zarr3, a database per process), copied
  or quantized by the quantizers the caller gives; `verify`: the merged checkpoint checked before the commit;
* `safetensors_writer`: safetensors files written tensor by tensor, with their index; `object_shards`: such a file
  streamed into objects on gs:// and composed there;
* `job_plan`: one plan per job (the processes agree before any writes) and the job's temporary directory.
* `job_runner`: the write sequence of `export` (both layouts) and `import`, on one process or many: the plan agreed,
  the temporary destination, test points, barriers, the report, the commit.
"""
