"""A reference NVFP4 quantizer and GEMM in plain torch arithmetic, Transformer Engine's
`custom_recipes.reference_nvfp4` API (`NVFP4QuantizerRef`, `NVFP4TensorRef`), the oracle of TE's NVFP4 tests.

Written apart from fp8kit's fast path (`fp8kit.pytorch.nvfp4_cast`): every float32 operation of the rules is done
in float64 on float32 values and rounded to float32 (for +, -, *, / of float32 operands that gives the correctly
rounded float32 result, float64 having more than twice float32's precision); E4M3 block scales are rounded by their
spacing (`_e4m3_round`), E2M1 values by comparisons with the midpoints between neighbours (`_e2m1_codes`).

The rules (docs/numerics.md, "NVFP4"), for a tensor (or, row-scaled, a row) with amax A (NaN ignored):
global encode scale S = 2688 / A (float32 max where it overflows; 1 where A is 0 or S is 0), D = 1 / S; block
scale s = e4m3(min(block_amax * (S * (1/6)), 448)); encode factor f = min(1 / (s * D), float32 max); values
e2m1(clamp(x * f, -6, 6)) rounded to nearest even, x's sign bit kept, NaN giving code 0. Tiles 1x16 or 16x16; the
columnwise usage quantizes the transpose (after the random Hadamard transform with `with_rht`). Dims that are not
multiples of the tile are zero-padded; the data is trimmed back, the scales are not (as TE's reference).

`qgemm` (TE's reference GEMM): per 16-wide K block j in order, y = y + (sx_j * sw_j) * P_j in float32 (P_j the
exact block dot product), then y = alpha * y with alpha = (amax_x * amax_w) / (6 * 6 * 448 * 448) (the rowwise
amaxes, or the columnwise ones for a wgrad; a row-scaled operand's vector broadcast over its output rows, or its
output columns for a wgrad), then + out (float32) with `accumulate`, then the output dtype.
Not implemented (NotImplementedError): `pow_2_scales` (MXFP4) and `nvfp4_use_4over6`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch

from ..hadamard import WGRAD_SIGNS
from ..quantized_tensor import QuantizedTensorStorage, Quantizer
from . import gemm, reference_utils

__all__ = ["NVFP4QuantizerRef", "NVFP4TensorRef", "cast_to_fp4x2", "cast_from_fp4x2", "get_wgrad_sign_vector"]

_F32_MAX = float(torch.finfo(torch.float32).max)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between code i and i + 1
_GEMM_DIVISOR = 6.0 * 6.0 * 448.0 * 448.0


def _f32(t: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to float32 and held in float64 again."""
    return t.float().double()


def _nan_free_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.double().abs()
    return torch.where(torch.isnan(a), torch.zeros((), dtype=a.dtype, device=a.device), a)


def _e2m1_codes(v: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of v (float64, |v| <= 6): the code below |v| plus one past each midpoint it exceeds, up at a
    midpoint only toward an even code; bit 3 from `negative`; NaN gives 0."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        up = (mag > mid) | ((mag == mid) & ((i + 1) % 2 == 0))
        code += up.to(torch.uint8)
    code |= negative.to(torch.uint8) << 3
    return torch.where(torch.isnan(v), torch.zeros_like(code), code)


def _e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """float64 values in [0, 448] rounded to E4M3 (nearest, ties to even), as float64: the spacing is 2^-9 below
    2^-6 (subnormals) and 2^(e - 3) in [2^e, 2^(e + 1))."""
    _, exp = torch.frexp(v)  # v = m * 2^exp, m in [0.5, 1)
    step = torch.pow(2.0, torch.clamp(exp.double() - 1, min=-6.0) - 3.0)
    return torch.round(v / step) * step


def cast_to_fp4x2(x: torch.Tensor) -> torch.Tensor:
    """The E2M1 codes of the 2-D `x` (values already in [-6, 6]), two per byte, the even element in the low nibble."""
    codes = _e2m1_codes(x.double(), torch.signbit(x))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def cast_from_fp4x2(x: torch.Tensor, dq_dtype: torch.dtype) -> torch.Tensor:
    """The values (`dq_dtype`) of packed E2M1 bytes (rows, n) -> (rows, 2n)."""
    table = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float64, device=x.device)
    codes = torch.stack((x & 0x0F, x >> 4), dim=-1).reshape(x.shape[0], -1)
    return table[codes.long()].to(dq_dtype)


def get_wgrad_sign_vector() -> torch.Tensor:
    """TE's fixed signs of the random Hadamard transform (float32 (16,))."""
    return torch.tensor(WGRAD_SIGNS, dtype=torch.float32)


def _hadamard64(size: int, signs: bool) -> torch.Tensor:
    """diag(signs) @ H / sqrt(size) in float64, H by Sylvester's construction."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    if signs:
        h = get_wgrad_sign_vector().double()[:, None] * h
    return h / size ** 0.5


def _global_encode(amax: torch.Tensor) -> torch.Tensor:
    """S = 2688 / amax (float64 holding float32), float32 max on overflow, 1 for amax 0 or S 0."""
    s = _f32(torch.tensor(2688.0, dtype=torch.float64, device=amax.device) / amax)
    s = torch.where(torch.isnan(s) | (s > _F32_MAX), torch.full_like(s, _F32_MAX), s)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


@dataclasses.dataclass
class NVFP4TensorRef(QuantizedTensorStorage):
    """What `NVFP4QuantizerRef.quantize` returns: packed E2M1 `data` (M, K/2) and its E4M3 `scale` (float8_e4m3fn,
    (M, K/16)); `data_t` / `scale_t` the same of the transpose; `global_amax_row` / `global_amax_col` float32 (1,)
    (or one per row when row-scaled); the nominal `dtype`, `device`, `quant_dtype` and `original_shape`."""

    data: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    data_t: Optional[torch.Tensor] = None
    scale_t: Optional[torch.Tensor] = None
    global_amax_row: Optional[torch.Tensor] = None
    global_amax_col: Optional[torch.Tensor] = None
    nvfp4_use_4over6: bool = False
    nvfp4_e4m3_max: int = 448

    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    quant_dtype: Optional[Union[reference_utils.Fp4Formats, torch.dtype]] = None
    original_shape: Optional[Tuple[int, ...]] = None
    _quantizer: Optional[Quantizer] = None

    @property
    def custom(self) -> bool:
        """A custom (reference) tensor: GEMMs go through its quantizer's `qgemm`."""
        return True

    def prepare_for_saving(self):
        tensors = [self.data, self.data_t, self.scale, self.scale_t]
        self.data = self.data_t = self.scale = self.scale_t = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self.data, self.data_t, self.scale, self.scale_t = tensors[:4]
        return tensors[4:]

    @property
    def _data(self):
        return self.data

    @_data.setter
    def _data(self, value):
        self.data = value

    @property
    def _scale_inv(self):
        return self.scale

    @_scale_inv.setter
    def _scale_inv(self, value):
        self.scale = value

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Drop the layouts not asked for; a layout that is absent cannot be made from the other (RuntimeError)."""
        for usage, name in ((rowwise_usage, "data"), (columnwise_usage, "data_t")):
            if usage and getattr(self, name) is None:
                raise RuntimeError(f"NVFP4TensorRef: cannot make {name} from the other layout; quantize again")
            if usage is False:
                setattr(self, name, None)

    def size(self, *args, **kwargs) -> torch.Size:
        """The logical shape (not the packed data's)."""
        if self.original_shape is None:
            raise RuntimeError("NVFP4TensorRef.size(): original_shape is not set")
        return torch.Size(self.original_shape)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """e2m1 * e4m3 scale / S (per row when row-scaled) from `data` (the 2-D rowwise layout), in `dtype`."""
        if self.data is None:
            raise RuntimeError("NVFP4TensorRef.dequantize: no rowwise data")
        values = cast_from_fp4x2(self.data, torch.float64)
        rows, cols = values.shape
        block = cols // self.scale.shape[1] if self.scale.shape[1] else 16
        scale = self.scale[:rows].double().repeat_interleave(block, dim=1)[:, :cols]
        decode = _f32(1.0 / _global_encode(self.global_amax_row.double())).reshape(-1, 1)
        out = _f32(_f32(values * scale) * decode)
        return out.reshape(self.original_shape).to(dtype or self.dtype or torch.float32)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(dtype={self.dtype}, device={self.device}, quant_dtype={self.quant_dtype}, "
                f"original_shape={self.original_shape})")


class NVFP4QuantizerRef(Quantizer):
    """TE's signature: NVFP4QuantizerRef(dtype, rowwise=True, columnwise=True, pow_2_scales=False, eps=0.0,
    quant_tile_shape=(1, 16), row_scaled_nvfp4=False, nvfp4_use_4over6=False, nvfp4_e4m3_max=448,
    nvfp4_4over6_err_mode="MAE", nvfp4_4over6_err_use_fast_math=False, with_rht=False, with_random_sign_mask=True).
    `quantize(x)` gives an NVFP4TensorRef (module docstring for the rules); `qgemm` the reference GEMM."""

    def __init__(self, dtype: reference_utils.Fp4Formats, rowwise: bool = True, columnwise: bool = True,
                 pow_2_scales: bool = False, eps: float = 0.0, quant_tile_shape: Tuple[int, int] = (1, 16),
                 row_scaled_nvfp4: bool = False, nvfp4_use_4over6: bool = False, nvfp4_e4m3_max: int = 448,
                 nvfp4_4over6_err_mode: str = "MAE", nvfp4_4over6_err_use_fast_math: bool = False,
                 with_rht: bool = False, with_random_sign_mask: bool = True) -> None:
        if row_scaled_nvfp4 and not rowwise:
            raise ValueError("NVFP4QuantizerRef: row-scaled NVFP4 requires rowwise usage")
        if pow_2_scales:
            raise NotImplementedError("NVFP4QuantizerRef: pow_2_scales=True (MXFP4) is not implemented in fp8kit")
        if nvfp4_use_4over6:
            raise NotImplementedError("NVFP4QuantizerRef: nvfp4_use_4over6=True is not implemented in fp8kit")
        if tuple(quant_tile_shape) not in ((1, 16), (16, 16)):
            raise ValueError(f"NVFP4QuantizerRef: quant_tile_shape must be (1, 16) or (16, 16), got "
                             f"{quant_tile_shape}")
        if int(nvfp4_e4m3_max) not in (448, 256):
            raise ValueError(f"NVFP4QuantizerRef: nvfp4_e4m3_max must be 448 or 256, got {nvfp4_e4m3_max}")
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.internal = True
        self.dtype = dtype
        self.pow_2_scales, self.eps = False, eps
        self.quant_tile_shape = tuple(quant_tile_shape)
        self.row_scaled_nvfp4 = bool(row_scaled_nvfp4)
        self.nvfp4_use_4over6, self.nvfp4_e4m3_max = False, 448
        self.nvfp4_4over6_err_mode = str(nvfp4_4over6_err_mode).upper()
        self.nvfp4_4over6_err_use_fast_math = bool(nvfp4_4over6_err_use_fast_math)
        self.with_rht, self.with_random_sign_mask = bool(with_rht), bool(with_random_sign_mask)

    @property
    def custom(self) -> bool:
        return True

    supports_allgather_fp8 = False
    supports_dequantize = False

    # ---- quantization -------------------------------------------------------------------------------------------

    def _apply_rht(self, x: torch.Tensor) -> torch.Tensor:
        """Each 16 values along the last dim times the transform, summed in float64, rounded to float32 then to x's
        dtype."""
        if not self.with_rht:
            return x
        dim = self.quant_tile_shape[1]
        if x.shape[-1] % dim:
            raise ValueError(f"NVFP4QuantizerRef: inner dim {x.shape[-1]} is not a multiple of {dim} (RHT)")
        h = _hadamard64(dim, self.with_random_sign_mask).to(x.device)
        return (x.double().reshape(-1, dim) @ h).float().to(x.dtype).reshape(x.shape)

    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        a = _nan_free_abs(x)
        if self.row_scaled_nvfp4:
            return a.amax(dim=1).float() if a.shape[1] else torch.zeros(a.shape[0], device=x.device)
        return (a.max() if a.numel() else a.new_zeros(())).float().reshape(1)

    def _quantize_2d(self, x: torch.Tensor, amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(packed (M, N/2), E4M3 scales (M_pad, N_pad/16)) of the 2-D `x` with float32 `amax` ((1,) or (M,))."""
        ty, tx = self.quant_tile_shape
        m, n = x.shape
        xp = torch.nn.functional.pad(x, (0, -n % tx, 0, -m % ty))
        mp, np_ = xp.shape
        a = _nan_free_abs(xp)
        if ty == 16:
            block = a.reshape(mp // 16, 16, np_ // 16, 16).amax(dim=(1, 3)).repeat_interleave(16, dim=0)
        else:
            block = a.reshape(mp, np_ // 16, 16).amax(dim=2)
        if self.row_scaled_nvfp4:
            if ty != 1:
                raise ValueError("NVFP4QuantizerRef: row-scaled NVFP4 supports the 1x16 tile only")
            amax = torch.nn.functional.pad(amax, (0, mp - m))
        s_enc = _global_encode(amax.double()).reshape(-1, 1)
        s_dec = _f32(1.0 / s_enc)
        mult = _f32(s_enc * _f32(torch.tensor(1.0 / 6.0, dtype=torch.float64)))
        scale = _e4m3_round(torch.clamp(_f32(block * mult), max=448.0))
        factor = torch.clamp(_f32(1.0 / _f32(scale * s_dec)), max=_F32_MAX)
        v = _f32(xp.double().reshape(mp, np_ // 16, 16) * factor[:, :, None]).reshape(mp, np_)
        v = torch.clamp(v, -6.0, 6.0)
        codes = _e2m1_codes(v, torch.signbit(xp))
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4))[:m, : n // 2].contiguous()
        return packed, scale.to(torch.float8_e4m3fn)

    def _quantize(self, tensor: torch.Tensor):
        """(qx, sx, qx_t, sx_t, global_amax_row, global_amax_col) of the 2-D `tensor`."""
        col_input = self._apply_rht(tensor.t().contiguous()) if self.columnwise_usage else None
        amax_row = self._amax(tensor)
        amax_col = self._amax(col_input) if col_input is not None else amax_row
        qx = sx = qx_t = sx_t = None
        if self.rowwise_usage:
            qx, sx = self._quantize_2d(tensor, amax_row)
        if col_input is not None:
            qx_t, sx_t = self._quantize_2d(col_input, amax_col)
        return qx, sx, qx_t, sx_t, amax_row, amax_col

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype not in reference_utils.HIGH_PRECISION_FLOAT_DTYPES:
            raise TypeError(f"NVFP4QuantizerRef: unsupported input dtype {tensor.dtype}, expected one of "
                            f"{reference_utils.HIGH_PRECISION_FLOAT_DTYPES}")
        if tensor.dim() < 2:
            raise ValueError(f"NVFP4QuantizerRef: needs a tensor of 2 or more dims, got shape {tuple(tensor.shape)}")
        return tensor.contiguous().reshape(-1, tensor.shape[-1])

    def quantize(self, tensor: torch.Tensor, **kwargs) -> NVFP4TensorRef:  # noqa: ARG002 (TE's signature)
        return self.quantize_impl(tensor)

    def quantize_impl(self, tensor: torch.Tensor) -> NVFP4TensorRef:
        x = self._checked(tensor)
        with torch.no_grad():  # bytes and amaxes: nothing to differentiate
            qx, sx, qx_t, sx_t, amax_row, amax_col = self._quantize(x)
        return NVFP4TensorRef(data=qx, scale=sx, data_t=qx_t, scale_t=sx_t, global_amax_row=amax_row,
                              global_amax_col=amax_col, dtype=x.dtype, device=x.device, quant_dtype=self.dtype,
                              original_shape=tuple(tensor.shape), _quantizer=self)

    def update_quantized(self, src: torch.Tensor, dst: NVFP4TensorRef, *,
                         noop_flag: Optional[torch.Tensor] = None) -> NVFP4TensorRef:
        """Quantize `src` into `dst` (skipped when `noop_flag` is nonzero: a host read, as TE's reference)."""
        if noop_flag is not None and noop_flag.item() != 0:
            return dst
        new = self.quantize_impl(src)
        for field in dataclasses.fields(NVFP4TensorRef):
            if field.name not in ("device", "_quantizer"):
                setattr(dst, field.name, getattr(new, field.name))
        return dst

    def transpose_qresult(self, qresult):
        raise NotImplementedError("NVFP4QuantizerRef: transpose_qresult is not implemented for FP4")

    @property
    def is_data_t_transposed_in_memory(self) -> bool:
        raise NotImplementedError("NVFP4QuantizerRef.is_data_t_transposed_in_memory is not implemented for FP4")

    def copy(self) -> "NVFP4QuantizerRef":
        out = NVFP4QuantizerRef(self.dtype, self.rowwise_usage, self.columnwise_usage, False, self.eps,
                                self.quant_tile_shape, self.row_scaled_nvfp4, False, 448, self.nvfp4_4over6_err_mode,
                                self.nvfp4_4over6_err_use_fast_math, self.with_rht, self.with_random_sign_mask)
        out.internal = self.internal
        return out

    # ---- the reference GEMM -------------------------------------------------------------------------------------

    @staticmethod
    def _alpha(qresult_x, qresult_w, gemm_type) -> torch.Tensor:
        for name, q in (("qresult_x", qresult_x), ("qresult_w", qresult_w)):
            if q is None:
                raise ValueError(f"NVFP4QuantizerRef.qgemm: {name} is required (its global amax)")
        wgrad = gemm_type == gemm.GEMMType.WGRAD
        ax = qresult_x.global_amax_col if wgrad else qresult_x.global_amax_row
        aw = qresult_w.global_amax_col if wgrad else qresult_w.global_amax_row
        if ax is None or aw is None:
            raise ValueError("NVFP4QuantizerRef.qgemm: the operands' global amaxes are not set")
        partial = _f32(ax.double() * aw.double())
        if partial.numel() > 1:  # a row-scaled operand: per output column for a wgrad, per output row otherwise
            partial = partial.reshape(1, -1) if wgrad else partial.reshape(-1, 1)
        else:
            partial = partial.reshape(())
        return _f32(partial / _GEMM_DIVISOR)

    def qgemm(self, qx: torch.Tensor, qw: torch.Tensor, m_params, out_dtype: torch.dtype, sx: torch.Tensor,
              sw: torch.Tensor, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
              accumulate: bool = False, gemm_type=gemm.GEMMType.FPROP, qresult_x=None,
              qresult_w=None) -> torch.Tensor:
        """`x @ w^T` (M, N) from packed operands qx (M, K/2), qw (N, K/2) with E4M3 scales sx (M, K/16), sw (N, K/16)
        (float8_e4m3fn, or their bytes as uint8); see the module docstring."""
        if bias is not None:
            raise ValueError("NVFP4QuantizerRef.qgemm: bias is not supported")
        vx, vw = cast_from_fp4x2(qx, torch.float64), cast_from_fp4x2(qw, torch.float64)
        (m, k), (n, kw) = vx.shape, vw.shape
        if k != kw:
            raise ValueError(f"NVFP4QuantizerRef.qgemm: K differs: qx has {k}, qw has {kw}")
        if k % 32 or n % 8:
            raise ValueError(f"NVFP4QuantizerRef.qgemm: K must be a multiple of 32 and N of 8, got K={k}, N={n}")
        sx, sw = (s.view(torch.float8_e4m3fn) if s.dtype == torch.uint8 else s for s in (sx, sw))
        sx, sw = sx.double(), sw.double()
        if tuple(sx.shape) != (m, k // 16) or tuple(sw.shape) != (n, k // 16):
            raise ValueError(f"NVFP4QuantizerRef.qgemm: scale shapes {tuple(sx.shape)}, {tuple(sw.shape)} do not "
                             f"fit M={m}, N={n}, K={k}")
        alpha = self._alpha(qresult_x, qresult_w, gemm_type)
        y = torch.zeros(m, n, dtype=torch.float64, device=vx.device)
        for j in range(k // 16):
            blk = slice(16 * j, 16 * (j + 1))
            partial = vx[:, blk] @ vw[:, blk].t()  # exact: multiples of 1/4 below 576
            y = _f32(y + torch.outer(sx[:, j], sw[:, j]) * partial)  # the scaled product is exact too
        if k > 0:
            y = _f32(alpha * y)
        if accumulate:
            if out is None:
                raise ValueError("NVFP4QuantizerRef.qgemm: accumulate=True needs out")
            y = _f32(y + out.double())
        elif out is not None:
            raise ValueError("NVFP4QuantizerRef.qgemm: out is only used with accumulate=True")
        return y.float().to(out_dtype)
