"""Layer-call bodies are shape-inferred once per body up to value names
(refine/lowering/program.py BodyInference): the ranks' bodies are the same code traced again
with other value names. Sharing must be exact: a body that differs in anything inference reads
is inferred on its own, and a later body's own declared types are still checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from refine.errors import InputError
from refine.lowering import program
from refine.lowering.shapes import value_types

PATH = Path("rank0.onnx")


def _piece(tag: str, shape: list[int], declared: list[int] | None = None) -> onnx.ModelProto:
    """x [2, 12] -> Reshape(x, Constant(shape)) -> Relu -> y; internal values named after `tag`
    (as torch names them differently on each rank), with node metadata like the exporter's."""
    const = helper.make_node("Constant", [], [f"{tag}_shape"], name=f"{tag}/Constant",
                             value=numpy_helper.from_array(np.array(shape, np.int64)))
    reshape = helper.make_node("Reshape", ["x", f"{tag}_shape"], [f"{tag}_view"], name=f"node_view_{tag}")
    reshape.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=repr(["", f"layer_{tag}", "view"]))
    relu = helper.make_node("Relu", [f"{tag}_view"], ["y"], name=f"node_relu_{tag}")
    value_info = [helper.make_tensor_value_info(f"{tag}_view", TensorProto.FLOAT, declared)] if declared else []
    graph = helper.make_graph([const, reshape, relu], "body", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], value_info=value_info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _dims(model: onnx.ModelProto, name: str) -> list[int]:
    return [d.dim_value for d in value_types(model.graph)[name].tensor_type.shape.dim]


@pytest.fixture
def inferences(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The graph names actually run through shape inference."""
    seen: list[str] = []
    real = program.infer_shapes

    def counting(model: onnx.ModelProto, path: Path, world_size: int) -> onnx.ModelProto:
        seen.append(model.graph.node[0].output[0])
        return real(model, path, world_size)

    monkeypatch.setattr(program, "infer_shapes", counting)
    return seen


def test_bodies_equal_up_to_names_are_inferred_once(inferences: list[str]) -> None:
    infer = program.BodyInference(2)
    first = infer(_piece("a", [2, 3, 4]), PATH)
    second = infer(_piece("b", [2, 3, 4]), PATH)
    assert inferences == ["a_shape"]
    assert _dims(first, "a_view") == _dims(second, "b_view") == [2, 3, 4]
    assert _dims(second, "y") == [2, 3, 4]
    assert [n.name for n in second.graph.node] == ["b/Constant", "node_view_b", "node_relu_b"]  # its own names


def test_a_body_differing_in_a_constant_is_inferred_on_its_own(inferences: list[str]) -> None:
    infer = program.BodyInference(2)
    infer(_piece("a", [2, 3, 4]), PATH)
    other = infer(_piece("b", [2, 6, 2]), PATH)
    assert inferences == ["a_shape", "b_shape"]
    assert _dims(other, "b_view") == [2, 6, 2]


def test_a_shared_body_still_checks_its_own_declared_types() -> None:
    infer = program.BodyInference(2)
    infer(_piece("a", [2, 3, 4], declared=[2, 3, 4]), PATH)
    with pytest.raises(InputError, match="b_view.*declared with shape"):
        infer(_piece("b", [2, 3, 4], declared=[2, 4, 3]), PATH)


def _gathered(tag: str, group: list[int]) -> onnx.ModelProto:
    """x [2, 3] -> dist.AllGather over `group` along axis 0 -> y (the program of one TP position,
    which the ranks of another DP row run with their own group)."""
    from refine import dist

    dist.register_schemas()
    node = dist.all_gather("x", "y", group, axis=0, name=f"gather_{tag}")
    graph = helper.make_graph([node], "main", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), dist.dist_opset()])


def test_graphs_differing_in_group_members_only_are_inferred_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference reads a group's size only: the same program over another group of that size
    shares the first one's types; a group of another size is inferred on its own."""
    seen: list[list[int]] = []
    real = program.infer_shapes

    def counting(model: onnx.ModelProto, path: Path, world_size: int) -> onnx.ModelProto:
        seen.append(list(model.graph.node[0].attribute[0].ints) or list(model.graph.node[0].attribute[1].ints))
        return real(model, path, world_size)

    monkeypatch.setattr(program, "infer_shapes", counting)
    infer = program.BodyInference(8)
    assert _dims(infer(_gathered("a", [0, 1]), PATH), "y") == [4, 3]
    assert _dims(infer(_gathered("b", [2, 3]), PATH), "y") == [4, 3]
    assert _dims(infer(_gathered("c", [4, 5, 6, 7]), PATH), "y") == [8, 3]
    assert len(seen) == 2


def _chunk(tag: str, k: int, sizes: list[int], source_is_input: bool = True, shared: bool = False,
           late_position: bool = False) -> onnx.ModelProto:
    """x [8, 3] -> chunk `k` of SplitToSequence(x, sizes) -> Relu -> y (a sequence-parallel
    layer's own chunk: `k` is the rank). With `shared`, the position constant is also added to
    the chunk (another reader, for which its value matters); with `late_position`, it is made
    right before its SequenceAt (as torch emits it on some ranks), not with the other constants."""
    position = helper.make_node("Constant", [], [f"{tag}_k"], value=numpy_helper.from_array(np.array(k, np.int64)))
    nodes = [helper.make_node("Constant", [], [f"{tag}_sizes"], value=numpy_helper.from_array(np.array(sizes, np.int64)))]
    if not late_position:
        nodes.append(position)
    source = "x"
    if not source_is_input:
        nodes.append(helper.make_node("Constant", [], [f"{tag}_x"], value=numpy_helper.from_array(np.ones((8, 3), np.float32))))
        source = f"{tag}_x"
    nodes.append(helper.make_node("SplitToSequence", [source, f"{tag}_sizes"], [f"{tag}_seq"], axis=0))
    if late_position:
        nodes.append(position)
    nodes.append(helper.make_node("SequenceAt", [f"{tag}_seq", f"{tag}_k"], [f"{tag}_chunk"]))
    last = f"{tag}_chunk"
    if shared:
        nodes.append(helper.make_node("Cast", [f"{tag}_k"], [f"{tag}_kf"], to=TensorProto.FLOAT))
        nodes.append(helper.make_node("Add", [last, f"{tag}_kf"], [f"{tag}_plus"]))
        last = f"{tag}_plus"
    nodes.append(helper.make_node("Relu", [last], ["y"]))
    graph = helper.make_graph(nodes, "body", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_the_ranks_chunks_of_equal_size_are_inferred_once(inferences: list[str]) -> None:
    """A sequence-parallel layer differs between ranks only in the chunk it takes: with equal
    chunks the chunk's type does not depend on which, so one inference serves every rank."""
    infer = program.BodyInference(4)
    shapes = [_dims(infer(_chunk(f"r{k}", k, [2, 2, 2, 2]), PATH), "y") for k in range(4)]
    assert shapes == [[2, 3]] * 4
    assert inferences == ["r0_sizes"]


def test_a_chunk_position_made_elsewhere_in_the_body_shares_the_inference(inferences: list[str]) -> None:
    """torch emits a rank's position Constant among the body's constants on some ranks and right
    before its SequenceAt on others: where it stands changes no type, so one inference serves
    both, and the later body's position is typed by its own attribute."""
    infer = program.BodyInference(4)
    first = infer(_chunk("r0", 0, [2, 2, 2, 2]), PATH)
    later = infer(_chunk("r3", 3, [2, 2, 2, 2], late_position=True), PATH)
    assert inferences == ["r0_sizes"]
    assert _dims(first, "y") == _dims(later, "y") == [2, 3]
    position = value_types(later.graph)["r3_k"].tensor_type
    assert position.elem_type == TensorProto.INT64 and list(position.shape.dim) == []


@pytest.mark.parametrize("case", ["unequal", "out_of_range", "static_source", "shared"])
def test_chunk_positions_that_can_change_a_type_or_a_value_keep_their_own_inference(
        case: str, inferences: list[str]) -> None:
    """Unequal chunks (a fused QKV split), a position out of range, a chunk of a stated tensor
    (folding reads its values) and a position constant read elsewhere too are each inferred on
    their own."""
    infer = program.BodyInference(4)
    make = {"unequal": lambda tag, k: _chunk(tag, k, [4, 2, 2]),
            "out_of_range": lambda tag, k: _chunk(tag, k * 5, [2, 2, 2, 2]),
            "static_source": lambda tag, k: _chunk(tag, k, [2, 2, 2, 2], source_is_input=False),
            "shared": lambda tag, k: _chunk(tag, k, [2, 2, 2, 2], shared=True)}[case]
    first = infer(make("a", 0), PATH)
    second = infer(make("b", 1), PATH)
    assert inferences == ["a_sizes", "b_sizes"]
    if case == "unequal":
        assert _dims(first, "y") == [4, 3] and _dims(second, "y") == [2, 3]
