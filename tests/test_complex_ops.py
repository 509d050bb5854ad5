"""exporters/capture/complex_ops.py: views of complex tensors (unsqueeze at positive and negative
axes, expand with kept axes, a move to the same dtype) translated on their real pairs, run by
the reference evaluator against torch; and a layer whose argument is complex (DeepSeek-V2's
rotary frequencies) captured through the layer markers (exporters/capture/layers.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from test_dispatch_ops import onnx_run  # noqa: E402


class ComplexRope(torch.nn.Module):
    """HF DeepSeek-V2's complex rotary embedding, with the view under test in the middle."""

    def __init__(self, view: str) -> None:
        super().__init__()
        self.view = view

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        freqs = torch.polar(torch.ones_like(angles), angles) * 0.75  # [S, D/2]
        if self.view == "unsqueeze":
            freqs = freqs.unsqueeze(1)  # [S, 1, D/2]
        elif self.view == "unsqueeze_negative":
            freqs = freqs.unsqueeze(-2)
        elif self.view == "expand":
            freqs = freqs.unsqueeze(1).expand(-1, x.shape[2], -1)  # [S, N, D/2]
        elif self.view == "to":
            freqs = freqs.unsqueeze(1).to(x.device)
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [B, S, N, D/2]
        return torch.view_as_real(xc * freqs).flatten(3)


@pytest.mark.parametrize("view", ["unsqueeze", "unsqueeze_negative", "expand", "to"])
def test_complex_views_match_torch(view: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 3, 8, generator=gen)
    angles = torch.randn(5, 4, generator=gen) * 3.0
    module = ComplexRope(view)
    (got,) = onnx_run(module, (x, angles), ["out"])
    want = module(x, angles).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(self.proj(x).reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs.unsqueeze(1)).flatten(2) + x


class Stack(torch.nn.Module):
    """Two identical layers taking complex frequencies: one body captured, one stub."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8, bias=False)  # the layers' input a tensor that needs grad, as each output is
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        freqs = torch.polar(torch.ones_like(angles), angles)
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, freqs)
        return x


def test_layer_with_a_complex_argument_is_captured_as_a_function() -> None:
    """The complex argument crosses the layer markers as its real pairs: one body, two calls,
    the values torch computes."""
    from onnx.reference import ReferenceEvaluator

    from refine.exporters.capture.layers import LAYER_DOMAIN
    from refine.exporters.capture.tracing import quiet, to_onnx

    torch.manual_seed(0)
    module = Stack()
    x, angles = torch.randn(5, 3, 8), torch.randn(5, 4)
    with quiet():
        model = to_onnx(module, (x, angles), ["out"], layers="layers")
    assert [f.domain for f in model.functions] == [LAYER_DOMAIN]
    assert sum(n.domain == LAYER_DOMAIN for n in model.graph.node) == 2
    names = [i.name for i in model.graph.input]
    (got,) = ReferenceEvaluator(model).run(None, dict(zip(names, (x.numpy(), angles.numpy()))))
    np.testing.assert_allclose(got, module(x, angles).detach().numpy(), rtol=1e-5, atol=1e-5)
