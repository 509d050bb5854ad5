"""Batch: many model pairs verified at once (`refine batch DIR`), locally or on a Ray cluster.

- `entries`: the entries of a tree (model directories, ONNX pairs) and what a batch run is asked.
- `autoshard`: how a bare ONNX pair relates (the layouts of its inputs, inferred).
- `verify_entry`: one entry verified (in a process of its own), its result, the cache.
- `local`: the local pool of worker processes and the batch report; `output` its renderings.
- `ray_cluster`: entries as tasks on a Ray cluster (the ray extra).

May import: everything below the CLI (refine.pipeline and what it imports).
"""
