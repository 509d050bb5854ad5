"""aten.convolution_backward as the convolutions of equal values it is.

A training step through a convolution (the short causal convolutions of Mamba, GatedDeltaNet and
ShortConv blocks; a patch embedding) differentiates into `aten.convolution_backward`, which
torchlib cannot translate. Its three outputs are convolutions and a sum:

- **the input's gradient** is the transposed convolution of the output's gradient by the same
  weight, with the output padding that gives back the input's sizes
  (`conv_transpose(g, W, stride, padding, output_padding, groups, dilation)`, what
  `torch.nn.grad.conv1d_input` computed before it called this op);
- **the weight's gradient** correlates the input with the output's gradient. With the batch folded
  into the channels, that is one grouped convolution of the input by the output's gradient, its
  stride and dilation swapped, summed over the batch: `conv(x.view(1, N*Cin, ...), filters,
  stride=dilation, dilation=stride, groups=N*Cin)`, each input channel's filters its group's
  output gradients (`[N, G, Cin/G, Cout/G, ...]`), then the sum over N, the axes put in W's order
  and the kernel's extent kept;
- **the bias's gradient** is the output's gradient summed over every axis but the channels.

A forward convolution only (not a transposed one, whose backward no model here has): anything else
fails loudly. `export --check` compares the translated step with torch's own numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

aten = torch.ops.aten


def _input_grad(grad: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], groups: int) -> torch.Tensor:
    """The transposed convolution of `grad` by `weight` back to `inputs`' sizes."""
    kernel = weight.shape[2:]
    output_padding = [inputs.shape[2 + i] - ((grad.shape[2 + i] - 1) * stride[i] - 2 * padding[i]
                                             + dilation[i] * (kernel[i] - 1) + 1) for i in range(len(kernel))]
    return aten.convolution.default(grad, weight, None, list(stride), list(padding), list(dilation), True,
                                    output_padding, groups)


def _weight_grad(grad: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], groups: int) -> torch.Tensor:
    """The input correlated with `grad`: one grouped convolution over the batch folded into the
    channels (module doc). Input channel i of group k meets the output channels of group k only,
    so each input channel gets its group's output gradients as filters."""
    batch, in_channels, out_channels = inputs.shape[0], inputs.shape[1], grad.shape[1]
    spatial, rest = len(weight.shape) - 2, list(grad.shape[2:])
    per_in, per_out = in_channels // groups, out_channels // groups
    g = aten.reshape.default(grad, [batch, groups, 1, per_out, *rest])
    g = aten.expand.default(g, [batch, groups, per_in, per_out, *rest])  # [n, k, i, o]: group k's filters per input channel
    g = aten.reshape.default(g, [batch * in_channels * per_out, 1, *rest])
    x = aten.reshape.default(inputs, [1, batch * in_channels, *inputs.shape[2:]])
    w = aten.convolution.default(x, g, None, list(dilation), list(padding), list(stride), False, [0] * spatial,
                                 batch * in_channels)
    extent = list(w.shape[2:])
    w = aten.sum.dim_IntList(aten.reshape.default(w, [batch, groups, per_in, per_out, *extent]), [0])
    w = aten.reshape.default(aten.transpose.int(w, 1, 2), [out_channels, per_in, *extent])  # [k, o, i] -> W's [k*o, i]
    for i, size in enumerate(weight.shape[2:]):
        w = aten.slice.Tensor(w, 2 + i, 0, size)
    return w


def convolution_backward(grad_output: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
                         bias_sizes: Sequence[int] | None, stride: Sequence[int], padding: Sequence[int],
                         dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
                         output_mask: Sequence[bool]) -> tuple[torch.Tensor | None, ...]:
    """aten.convolution_backward.default as convolutions (module doc): (input's, weight's, bias's
    gradient), None where `output_mask` asks for none."""
    if transposed:
        raise NotImplementedError("aten.convolution_backward of a transposed convolution has no translation here")
    spatial = len(weight.shape) - 2
    stride, padding, dilation = ([v[0]] * spatial if len(v) == 1 else list(v) for v in (stride, padding, dilation))
    grad_input = _input_grad(grad_output, inputs, weight, stride, padding, dilation, groups) if output_mask[0] else None
    grad_weight = _weight_grad(grad_output, inputs, weight, stride, padding, dilation, groups) if output_mask[1] else None
    grad_bias = aten.sum.dim_IntList(grad_output, [0, *range(2, 2 + spatial)]) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias
