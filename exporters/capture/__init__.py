"""Capture: a torch module and its ranks -> ONNX programs and refine.json.

- `export`: `export(seq_module, rank_factory, example_inputs, world_size, out)`, the one entry
  every strategy goes through (capture each program, check, write the directory atomically).
- `tracing`: torch.export / torch.onnx under the fake process group; `collectives`: the
  `_c10d_functional` ops -> `dist` ops; `rename`: tensor and node names; `layouts`: DTensor
  placements and Megatron attributes -> refine.json layouts; `layers`: each distinct layer
  outlined as an ONNX local function; `train`, `train_layers`: a training step (loss and
  every gradient) captured as one program; `row_indexing`: `x[arange, idx]` as gather and
  scatter; `numeric`: the numeric check of an export against torch.

May import: refine's base modules, refine.lowering, refine.diagnose.simulate, exporters.errors.
"""
