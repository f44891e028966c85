"""NVFP4 stochastic rounding: the bytes for given uniform draws against the reference, reproducible from the
generator's state, fresh draws on every call, and unbiased (a statistical test with a stated confidence)."""

import numpy as np
import torch
from block_helpers import to_np32, wide_range

from fp8kit.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

import reference as ref


def _sr(seed: int, **kw) -> NVFP4Quantizer:
    return NVFP4Quantizer(stochastic_rounding=True, generator=torch.Generator().manual_seed(seed), **kw)


def test_bytes_for_given_draws_match_reference():
    """The draws are torch.rand of the rowwise input's shape, then of the columnwise (transposed) input's."""
    for x in (torch.randn(32, 64), wide_range((48, 32), torch.bfloat16, seed=2)):
        q = _sr(7)(x)
        g = torch.Generator().manual_seed(7)
        r_row = torch.rand(x.shape, generator=g).numpy()
        r_col = torch.rand(x.t().shape, generator=g).numpy()
        for data, scales, src, r in ((q._rowwise_data, q._rowwise_scale_inv, to_np32(x), r_row),
                                     (q._columnwise_data, q._columnwise_scale_inv, to_np32(x.t()), r_col)):
            want, want_s, _ = ref.nvfp4_quantize(src, rand=r)
            np.testing.assert_array_equal(data.numpy(), want)
            np.testing.assert_array_equal(scales[: src.shape[0], : src.shape[1] // 16].numpy(), want_s)


def test_deterministic_for_a_seed_fresh_per_call():
    x = torch.randn(32, 32)
    a, b = _sr(3)(x), _sr(3)(x)
    assert torch.equal(a._rowwise_data, b._rowwise_data) and torch.equal(a._columnwise_data, b._columnwise_data)
    q = _sr(3)
    assert not torch.equal(q(x)._rowwise_data, q(x)._rowwise_data)
    torch.manual_seed(11)  # no generator: torch's default generator, so its state decides
    c = NVFP4Quantizer(stochastic_rounding=True)(x)
    torch.manual_seed(11)
    d = NVFP4Quantizer(stochastic_rounding=True)(x)
    assert torch.equal(c._rowwise_data, d._rowwise_data)


def test_unbiased():
    """Mean of N = 2000 draws of each E2M1 value equals the scaled input v = clamp(x * f, -6, 6) within 5 sigma,
    sigma = (hi - lo) sqrt(p (1 - p) / N) per element (512 elements: under the hypothesis the whole test fails with
    probability below 512 * 5.8e-7 ~ 3e-4 by the normal approximation). Values already on the grid never move.
    Round to nearest, by contrast, is biased on the same input (its mean error is more than 5 sigma)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=g, dtype=torch.float64).float()
    n = 2000
    q = _sr(1, columnwise=False)
    total = torch.zeros(16, 32, dtype=torch.float64)
    for _ in range(n):
        codes = q(x)._rowwise_data
        total += torch.from_numpy(ref.nvfp4_values(codes.numpy()))
    mean = total.numpy() / n
    packed, scales, amax = ref.nvfp4_quantize(to_np32(x))
    s_dec = np.float32(1) / ref.nvfp4_global_scale(amax)
    f = np.float32(1) / (scales.view(ref.ml_dtypes.float8_e4m3fn).astype(np.float32) * s_dec)
    v = np.clip(to_np32(x).reshape(16, 2, 16) * f[:, :, None], -6, 6).reshape(16, 32).astype(np.float64)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    lo_i = np.searchsorted(grid, np.abs(v), side="right") - 1
    hi = grid[np.minimum(lo_i + 1, 7)]
    lo = grid[lo_i]
    p = np.where(hi > lo, (np.abs(v) - lo) / np.where(hi > lo, hi - lo, 1), 0)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / n)
    err = np.abs(mean - v)
    assert (err <= 5 * sigma + 1e-12).all(), float((err / np.maximum(sigma, 1e-30)).max())
    on_grid = sigma == 0
    assert on_grid.sum() < v.size and (err[on_grid] == 0).all()
    rne_err = ref.nvfp4_values(packed) - v
    assert abs(rne_err.mean()) > 5 * np.sqrt((sigma ** 2).sum()) / v.size
