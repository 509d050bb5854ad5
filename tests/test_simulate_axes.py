"""The simulator runs every op with every axis form ONNX allows: a negative axis (attribute or
input) gives what the same positive axis gives, for each op family that takes one. (onnx's
reference GatherElements read axis=-1 wrongly and failed, so a real bug went without its
counterexample: torch's `x.gather(-1, idx)` exports exactly that.)"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from refine.diagnose.simulate import KERNELS, evaluate

RNG = np.random.default_rng(7)
X = RNG.standard_normal((3, 4, 5)).astype(np.float32)
IDX = RNG.integers(-5, 5, (3, 4, 2)).astype(np.int64)  # (negative indices count from the end)
UPDATES = RNG.standard_normal((3, 4, 2)).astype(np.float32)


def i64(values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# op -> (inputs given the last axis as `a`, attributes given `a`, number of outputs)
FAMILIES = {
    "GatherElements": (lambda a: [X, IDX], lambda a: {"axis": a}, 1),
    "ScatterElements": (lambda a: [X, IDX, UPDATES], lambda a: {"axis": a}, 1),
    "Gather": (lambda a: [X, i64([0, -1])], lambda a: {"axis": a}, 1),
    "Concat": (lambda a: [X, X], lambda a: {"axis": a}, 1),
    "Split": (lambda a: [X, i64([2, 3])], lambda a: {"axis": a}, 2),
    "Softmax": (lambda a: [X], lambda a: {"axis": a}, 1),
    "LogSoftmax": (lambda a: [X], lambda a: {"axis": a}, 1),
    "Hardmax": (lambda a: [X], lambda a: {"axis": a}, 1),
    "ArgMax": (lambda a: [X], lambda a: {"axis": a}, 1),
    "CumSum": (lambda a: [X, i64(a)], lambda a: {}, 1),
    "Flatten": (lambda a: [X], lambda a: {"axis": a}, 1),
    "ReduceSum": (lambda a: [X, i64([a])], lambda a: {}, 1),
    "ReduceMax": (lambda a: [X, i64([a])], lambda a: {}, 1),
    "ReduceMean": (lambda a: [X, i64([a])], lambda a: {}, 1),
    "ReduceLogSumExp": (lambda a: [X, i64([a])], lambda a: {}, 1),
    "Squeeze": (lambda a: [X[:, :, :1], i64([a])], lambda a: {}, 1),
    "Slice": (lambda a: [X, i64([1]), i64([3]), i64([a])], lambda a: {}, 1),
    "TopK": (lambda a: [X, i64([2])], lambda a: {"axis": a}, 2),
    "LayerNormalization": (lambda a: [X, np.ones(5, np.float32), np.zeros(5, np.float32)], lambda a: {"axis": a}, 1),
    "Compress": (lambda a: [X, np.array([True, False, True, True, False])], lambda a: {"axis": a}, 1),
}


def run(op: str, inputs: list[np.ndarray], attrs: dict, outputs: int) -> list[np.ndarray]:
    names = [f"in{k}" for k in range(len(inputs))]
    graph = helper.make_graph(
        [helper.make_node(op, names, [f"out{k}" for k in range(outputs)], **attrs)], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(names, inputs)],
        [helper.make_tensor_value_info(f"out{k}", TensorProto.UNDEFINED, None) for k in range(outputs)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return evaluate(model, dict(zip(names, inputs)))


@pytest.mark.parametrize("op", sorted(FAMILIES))
def test_a_negative_axis_is_the_positive_one(op: str) -> None:
    make_inputs, make_attrs, outputs = FAMILIES[op]
    positive = run(op, make_inputs(2), make_attrs(2), outputs)
    negative = run(op, make_inputs(-1), make_attrs(-1), outputs)
    for p, n in zip(positive, negative):
        np.testing.assert_array_equal(p, n)


def test_gather_elements_follows_torch_gather() -> None:
    """Index values in [-s, s): out[i][j][k] = x[i][j][idx[i][j][k]] along the last axis."""
    import itertools

    [got] = run("GatherElements", [X, IDX], {"axis": -1}, 1)
    for i, j, k in itertools.product(*map(range, IDX.shape)):
        assert got[i, j, k] == X[i, j, IDX[i, j, k]]


@pytest.mark.parametrize("kernel, strides", [([1, 1], [1, 1]), ([2, 2], [2, 2]), ([3, 3], [1, 1])])
def test_max_pool_indices_are_flat_over_batch_and_channels(kernel, strides):
    """MaxPool's indices as the ONNX spec has them (flat over N x C x H x W), unit strides too:
    torch.onnx's max_pool2d_with_indices subtracts a 1x1 pool's indices as each channel's offset,
    so the reference's per-channel indices sent a max-pool's backward out of range."""
    torch = pytest.importorskip("torch")
    shape = (3, 2, 5, 5)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=kernel, strides=strides)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("i", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    y, i = ReferenceEvaluator(model, new_ops=KERNELS).run(None, {"x": x})
    want_y, want_i = torch.nn.functional.max_pool2d(torch.tensor(x), kernel, strides, return_indices=True)
    offsets = np.arange(shape[0] * shape[1]).reshape(shape[0], shape[1], 1, 1) * shape[2] * shape[3]
    np.testing.assert_array_equal(y, want_y.numpy())
    np.testing.assert_array_equal(i - offsets, want_i.numpy())


@pytest.mark.parametrize("group, stride, output_padding", [(2, 1, 0), (2, 2, 1), (4, 2, 0), (1, 2, 1)])
def test_grouped_conv_transpose_is_torch_s(group, stride, output_padding):
    """A grouped ConvTranspose (a grouped convolution's input gradient in a training step) as
    torch computes it: onnx's reference kernel cut the weight by output channels and failed."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(group + stride)
    x = rng.standard_normal((3, 8, 5, 4)).astype(np.float32)
    w = rng.standard_normal((8, 3, 3, 2)).astype(np.float32)
    b = rng.standard_normal(3 * group).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], group=group, strides=[stride, stride],
                            output_padding=[output_padding, output_padding], pads=[1, 0, 1, 0])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "xwb"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    [y] = ReferenceEvaluator(model, new_ops=KERNELS).run(None, {"x": x, "w": w, "b": b})
    want = torch.nn.functional.conv_transpose2d(torch.tensor(x), torch.tensor(w), torch.tensor(b), stride=stride,
                                                padding=(1, 0), output_padding=output_padding, groups=group)
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-5, atol=1e-5)
