"""fp8kit's MXFP8 against torchao's MX formats (`torchao.prototype.mx_formats`, a peer implementation of the OCP MX
rules). With torchao's RCEIL scale mode (cuBLAS's / TE's rounding up of amax / fp8_max) the bytes agree wherever the
rules are the same; the tests below pin the places where they differ (docs/numerics.md lists them)."""

import pytest
import torch
from block_helpers import all_bf16, wide_range

from fp8kit.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

mx_formats = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
config = pytest.importorskip("torchao.prototype.mx_formats.config")
RCEIL, FLOOR = config.ScaleCalculationMode.RCEIL, config.ScaleCalculationMode.FLOOR


def both(x: torch.Tensor, fmt: torch.dtype, mode=RCEIL):
    """((fp8kit scales, fp8kit bytes), (torchao scales, torchao bytes)), rowwise 1x32 blocks."""
    q = MXFP8Quantizer(fmt, columnwise=False)(x)
    m, k = x.shape
    ours = q._rowwise_scale_inv[:m, : k // 32], q._rowwise_data
    s, d = mx_formats.to_mx(x.contiguous(), fmt, 32, scaling_mode=mode)
    return ours, (s.view(torch.uint8).reshape(m, k // 32), d.view(torch.uint8).reshape(m, k))


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("name", ["all_bf16_shuffled", "all_bf16_ordered", "wide_bf16", "wide_f32", "randn"])
def test_same_bytes_where_the_rules_agree(fmt, name):
    x = {"all_bf16_shuffled": lambda: all_bf16((256, 256), True), "all_bf16_ordered": lambda: all_bf16((256, 256),
                                                                                                       False),
         "wide_bf16": lambda: wide_range((128, 256), torch.bfloat16, 1),
         "wide_f32": lambda: wide_range((128, 256), torch.float32, 1), "randn": lambda: torch.randn(128, 256)}[name]()
    (s, d), (ts, td) = both(x, fmt)
    # the rules differ for blocks holding NaN and blocks whose amax / fp8_max <= 2^-127 (scale byte 0)
    same_rules = ~torch.isnan(x.float()).reshape(x.shape[0], -1, 32).any(-1) & (s != 0)
    assert same_rules.float().mean() > 0.5
    assert torch.equal(s[same_rules], ts[same_rules])
    assert torch.equal(d.reshape(x.shape[0], -1, 32)[same_rules], td.reshape(x.shape[0], -1, 32)[same_rules])


def test_differences():
    fmt = torch.float8_e4m3fn
    x = torch.ones(32, 32)
    x[0, 3] = float("nan")  # 1. NaN: TE's kernels skip it in the amax; torchao's amax is NaN -> scale 255, all NaN
    x[1] = 2.0 ** -130  # 2. amax / 448 <= 2^-127: scale byte 0 for both, but torchao multiplies by 1, TE by 2^127
    x[2, 0] = 448.0 * 2.0 ** 10 * (1 + 2.0 ** -23)  # 3. ceil(log2) in float32 rounds down just above a power of two
    (s, d), (ts, td) = both(x, fmt)
    assert s[0, 0] == 127 - 8 and ts[0, 0] == 255 and torch.isnan(td[0].view(fmt).float()).all()
    assert torch.isnan(d[0].view(fmt).float()).sum() == 1
    assert s[1, 0] == ts[1, 0] == 0 and d[1, 0].view(fmt).float() == 2.0 ** -3 and td[1, 0] == 0
    assert s[2, 0] == 127 + 11 and ts[2, 0] == 127 + 10 and td[2, 0].view(fmt).float() == 448  # saturated
    # 4. FLOOR, torchao's default (the OCP spec's suggestion): 2^(floor(log2 amax) - 8) for E4M3; TE rounds up
    (s, _), (fs, _) = both(torch.full((32, 32), 500.0), fmt, FLOOR)
    assert s[0, 0] == 128 and fs[0, 0] == 127
