"""How far the kernels' GELU may be from exact GELU, from what its arithmetic guarantees.

The kernels compute gelu(x) = h for x <= 0 and x - h for x > 0, with
h = x / 2 * erfc(|x| / sqrt(2)) and erfc from the Numerical Recipes fit (erfcc:
relative error under 1.2e-7 for every argument; csrc/vector_math.h). In float32 the
fit's exponent -z^2 + P(t) is where rounding grows with x: z = |x| * sqrt(1/2) carries
two roundings (the constant's and the product's), so z^2 is off by up to 4 z^2 units
roundoff, and the sum -z^2 + P(t) rounds once more at its size (z^2 units); exp turns
that absolute error of its argument into the same relative error of h. The other ops
(1 + z / 2, the division, nine Horner steps, exp within 2 ulp, three products) add a
bounded number of roundings; x - h adds half an ulp of the result.

torch's own GELU is not the reference: on AVX-512 it computes 1 + erf(u), which cancels
in the negative tail (0.1% off near x = -3.5), while the kernels' erfc does not."""

from __future__ import annotations

import math

import torch

_EPS = 2.0 ** -24  # float32's unit roundoff
_ERFC_FIT = 1.2e-7
_OTHER_OPS = 24  # roundings outside the exponent, each at most one unit roundoff (a generous count)


def exact_gelu(pre: torch.Tensor) -> torch.Tensor:
    """GELU of the float32 values `pre`, in float64."""
    x = pre.double()
    return x * 0.5 * torch.special.erfc(-x / math.sqrt(2))


def gelu_error_bound(pre: torch.Tensor) -> torch.Tensor:
    """Per element, the most the kernels' float32 GELU of `pre` may differ from exact GELU."""
    x = pre.double()
    z = x.abs() / math.sqrt(2)
    h = (x * 0.5 * torch.special.erfc(z)).abs()
    relative = _ERFC_FIT + (5 * z * z + _OTHER_OPS) * _EPS
    return h * relative + exact_gelu(pre).abs() * _EPS + torch.finfo(torch.float32).tiny


def assert_gelu_of(got: torch.Tensor, pre: torch.Tensor) -> None:
    """`got` is the kernels' GELU of `pre` (float32 pre-activations) within the bound."""
    error = (got.double() - exact_gelu(pre)).abs()
    bound = gelu_error_bound(pre)
    worst = int((error / bound).argmax())
    assert bool((error <= bound).all()), (
        f"GELU off by {error.flatten()[worst]:.3g} at x = {pre.flatten()[worst]:.6g}, "
        f"more than its bound {bound.flatten()[worst]:.3g}")
