"""How close two runs of the same values must be, given the float formats the programs round to.

Every numeric comparison refine makes (the counterexample search, `export --check`, the
mutation judge) asks whether a rebuilt tensor equals the sequential one up to rounding:
max|a - b| <= tolerance * max(1, max|expected|). Rounding depends on the narrowest float format
the programs compute in. float32 programs are compared at 1e-4. Programs that round to a 16-bit
float on the way (torchtitan's grouped experts run their GEMMs in bfloat16: a Cast there and
back) differ between a sum of rounded partials and the rounded sum by a few units in the last
place of that format, so they are compared at a few of its units: bfloat16 (8 significant
bits, a unit of 2^-8 = 3.9e-3) at 1e-2, float16 (11 bits, 4.9e-4) at 1e-3.

This only decides what counts as the same number; no proof reads it. A verdict of VERIFIED comes
from the lemmas alone, so a looser tolerance never turns a bug into a proof: it can only let a
numeric search miss a counterexample whose error is within that format's rounding.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

FLOAT32_TOLERANCE = 1e-4
_NARROW_TOLERANCE = {onnx.TensorProto.BFLOAT16: 1e-2, onnx.TensorProto.FLOAT16: 1e-3}


def _float_types(model: onnx.ModelProto) -> Iterable[int]:
    """Element types the program computes in: Cast targets, declared values and initializers
    (its layer functions' Casts too)."""
    graph = model.graph
    for vi in (*graph.input, *graph.output, *graph.value_info):
        yield vi.type.tensor_type.elem_type
    for init in graph.initializer:
        yield init.data_type
    for node in (*graph.node, *(n for f in model.functions for n in f.node)):
        if node.op_type == "Cast":
            for attr in node.attribute:
                if attr.name == "to":
                    yield attr.i


def tolerance(models: Iterable[onnx.ModelProto]) -> float:
    """The relative tolerance for comparing these programs' values (module doc)."""
    types = {t for model in models for t in _float_types(model)}
    return max([FLOAT32_TOLERANCE, *(tol for t, tol in _NARROW_TOLERANCE.items() if t in types)])
