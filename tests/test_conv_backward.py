"""Training steps through a convolution (exporters/capture/conv_backward.py, and the cropping pad of
exporters/capture/tracing.py): `aten.convolution_backward` as the transposed convolution, the
grouped convolution over the batch and the sum it is, checked against torch's autograd on random
shapes, strides, paddings, dilations and groups (depthwise, grouped, dense; 1-D and 2-D); a pad
by negative amounts (a causal pad's backward) as the slice it is; and a user's model with a
depthwise causal convolution before a tensor-parallel MLP, whose training step verifies.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import torch.nn.functional as F  # noqa: E402, N812

import own_models as om  # noqa: E402
from refine.exporters.capture.conv_backward import convolution_backward  # noqa: E402
from refine.exporters.capture.tracing import cropping_pad, integer_isnan  # noqa: E402
from refine.testing import assert_refines  # noqa: E402


def _conv_case(seed: int) -> dict:
    """Random convolution arguments: 1-D or 2-D, groups 1, 2 or depthwise, stride, padding, dilation."""
    g = torch.Generator().manual_seed(seed)

    def pick(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    spatial = 1 + seed % 2
    groups = (1, 2, 0)[seed % 3]
    per_in, per_out = pick(1, 3), pick(1, 3)
    if groups == 0:  # depthwise
        groups, per_in = pick(2, 4), 1
    kernel = [pick(1, 4) for _ in range(spatial)]
    stride = [pick(1, 3) for _ in range(spatial)]
    dilation = [pick(1, 2) for _ in range(spatial)]
    padding = [pick(0, 2) for _ in range(spatial)]
    size = [dilation[i] * (kernel[i] - 1) + 1 + pick(0, 6) for i in range(spatial)]
    return {"x": torch.randn(pick(1, 3), groups * per_in, *size, dtype=torch.float64, generator=g),
            "w": torch.randn(groups * per_out, per_in, *kernel, dtype=torch.float64, generator=g),
            "b": torch.randn(groups * per_out, dtype=torch.float64, generator=g),
            "stride": stride, "padding": padding, "dilation": dilation, "groups": groups}


@pytest.mark.parametrize("seed", range(12))
def test_convolution_backward_is_torchs(seed: int) -> None:
    c = _conv_case(seed)
    conv = F.conv1d if c["x"].dim() == 3 else F.conv2d
    x, w, b = (c[k].clone().requires_grad_() for k in ("x", "w", "b"))
    y = conv(x, w, b, c["stride"], c["padding"], c["dilation"], c["groups"])
    grad = torch.randn_like(y)
    expected = torch.autograd.grad(y, (x, w, b), grad)
    got = convolution_backward(grad, c["x"], c["w"], [c["w"].shape[0]], c["stride"], c["padding"], c["dilation"],
                               False, [0] * len(c["stride"]), c["groups"], [True, True, True])
    for name, e, r in zip(("input", "weight", "bias"), expected, got):
        assert r is not None and r.shape == e.shape and torch.allclose(r, e), name


def test_only_the_gradients_asked_for_are_computed() -> None:
    c = _conv_case(0)
    grad = torch.randn(1)
    out = convolution_backward(grad, c["x"], c["w"], None, c["stride"], c["padding"], c["dilation"], False,
                               [0] * len(c["stride"]), c["groups"], [False, False, False])
    assert out == (None, None, None)


@pytest.mark.parametrize("pad", [(-2, 0), (1, -1), (-1, -2, 2, 0), (0, 0, -1, 3)])
def test_a_pad_by_negative_amounts_is_the_slice_that_crops(pad: tuple[int, ...]) -> None:
    x = torch.randn(2, 5, 6)
    assert torch.equal(cropping_pad(x, list(pad), 0.5), F.pad(x, pad, value=0.5))


def test_a_pad_without_negative_amounts_is_left_alone() -> None:
    assert cropping_pad(torch.randn(2, 3), [1, 2], 0.0) is NotImplemented


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integers_isnan_is_false_and_a_floats_is_left_alone(dtype: torch.dtype) -> None:
    """(a training trace's clamp of int64 ids tests isnan, which ONNX takes for floats only)"""
    ids = torch.arange(6).to(dtype)
    assert torch.equal(integer_isnan(ids), torch.isnan(ids))
    assert integer_isnan(torch.tensor([1.0, float("nan")])) is NotImplemented


class CausalConvMLP(torch.nn.Module):
    """A depthwise causal convolution over the sequence (Mamba's short convolution), then the MLP."""

    def __init__(self, d: int = 16, k: int = 3) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(d, d, k, groups=d, bias=True)
        self.mlp = om.MLP(d)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [batch, seq, d]
        h = self.conv(F.pad(x.transpose(1, 2), (self.k - 1, 0))).transpose(1, 2)
        return self.mlp(F.silu(h))


def _tp_plan(model: torch.nn.Module, mesh) -> torch.nn.Module:
    om.tp_plan(model.mlp, mesh)
    return model


def test_a_training_step_through_a_causal_convolution_refines() -> None:
    """The convolution replicated, the MLP under its TP plan: the step's gradients (the conv's
    through convolution_backward's translation and the pad's cropping backward) verify."""
    torch.manual_seed(0)
    batch = {"x": torch.randn(2, 5, 16), "target": torch.randn(2, 5, 16)}
    report = assert_refines(CausalConvMLP(), _tp_plan, batch, world_size=2, train=True, loss_fn=om.mse)
    assert {o.name for o in report.outputs} >= {"grad.conv.weight", "grad.conv.bias"}
