"""An audit of fp8kit's accelerator path on `meta` tensors (no GPU): every torch operation and every Triton launch
is seen, and

- host synchronisations fail at once (`.item()`, `bool(tensor)`, `.tolist()`, data-dependent shapes, copies from
  the device to the host), naming the operation;
- host-to-device copies and CPU tensors passed to device operations are recorded (`transfers`, `mixed`);
- `torch._scaled_mm` gets the checks its CUDA implementation makes beyond its meta function (which already checks
  row-major `a`, column-major `b`, FP8 dtypes and dimensions divisible by 16): no E5M2 x E5M2, float32 one-element
  scales on the operands' device, and the bias rules;
- full-size memory passes are counted per role: a pass is one kernel (a torch operation that moves data, or a Triton
  launch) that reads or writes a tensor with as many elements as a role's tensor (for a Linear: x, W, dy), and
  `bytes` adds up what those kernels read and write of such tensors. GEMMs are counted apart (`gemms`).

Meta tensors cannot tell an FP8 GEMM's inputs from their copies, so roles are told apart by element count: pick
shapes whose M*K, N*K and M*N differ.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Operations that make the host wait for the device (or that are data-dependent in shape).
SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default,
            aten.masked_select.default, aten.allclose.default, aten.unique_dim.default, aten._unique2.default,
            aten.item.default}
# Operations that move no data: allocation and metadata.
NO_DATA = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
           aten._unsafe_view.default, aten.lift_fresh.default, aten.set_.source_Tensor, aten.resize_.default}
COPY_OPS = {aten._to_copy.default, aten.copy_.default, aten.lift_fresh_copy.default}


class HostSync(AssertionError):
    """An operation in the audited region would synchronise the host with the device."""


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _tensors(tree):
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class AcceleratorAudit(TorchDispatchMode):
    """Use as a context manager around the region to audit; `roles` maps a role name to the element count of its
    full-size tensors. Kernel launches are counted by `add_launches` (records of
    `fp8kit.pytorch.kernels.observe_launches`)."""

    def __init__(self, roles: dict):
        super().__init__()
        self.roles = dict(roles)
        self.passes = collections.Counter()
        self.bytes = collections.Counter()
        self.ops = collections.defaultdict(list)  # role -> names of the kernels that made its passes
        self.gemms = []  # (a shape, b shape, a dtype, b dtype) per _scaled_mm
        self.transfers = []  # host-to-device copies
        self.mixed = []  # device operations given a CPU tensor

    def _role_of(self, t: torch.Tensor):
        for role, numel in self.roles.items():
            if t.numel() == numel:
                return role
        return None

    def count(self, name: str, reads, writes) -> None:
        """Count one kernel that reads `reads` and writes `writes` (tensors)."""
        touched = collections.Counter()
        for t in list(reads) + list(writes):
            role = self._role_of(t)
            if role is not None:
                touched[role] += t.numel() * t.element_size()
        for role, nbytes in touched.items():
            self.passes[role] += 1
            self.bytes[role] += nbytes / self.roles[role]
            self.ops[role].append(name)

    def add_launches(self, launches) -> None:
        for launch in launches:
            self.count(launch.kernel, launch.reads, launch.writes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if func in SYNC_OPS:
            raise HostSync(f"host synchronisation in the accelerator path: {func}")
        devices = {t.device.type for t in inputs}
        if func in COPY_OPS:
            target = kwargs.get("device")
            target = torch.device(target).type if target is not None else None
            if func is aten.copy_.default:
                target = args[0].device.type
            source = args[1].device.type if func is aten.copy_.default else args[0].device.type
            if source != "cpu" and target == "cpu":
                raise HostSync(f"device-to-host copy in the accelerator path: {func}")
            if source == "cpu" and target not in (None, "cpu"):
                self.transfers.append(str(func))
        elif "cpu" in devices and len(devices) > 1:
            self.mixed.append(f"{func}: {[(t.device.type, tuple(t.shape)) for t in inputs]}")
        if func is aten._scaled_mm.default:
            self._check_scaled_mm(*args, **kwargs)
        out = func(*args, **kwargs)
        if func is aten._scaled_mm.default:
            self.gemms.append((tuple(args[0].shape), tuple(args[1].shape), args[0].dtype, args[1].dtype))
        elif func not in NO_DATA and not _is_view(func):
            self.count(str(func), inputs, _tensors(out))
        return out

    @staticmethod
    def _check_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                         use_fast_accum=False):
        """What aten/src/ATen/native/cuda/Blas.cpp checks and the meta function does not."""
        assert not (a.dtype == b.dtype == torch.float8_e5m2), "Multiplication of two Float8_e5m2 matrices"
        for s in (scale_a, scale_b):
            assert s.dtype == torch.float32 and s.numel() == 1 and s.device == a.device, \
                f"tensor-wise scales must be float32 one-element tensors on {a.device}: {s.dtype} {s.shape}"
        assert b.device == a.device
        out = out_dtype or a.dtype
        if bias is not None:
            assert out != torch.float32, "Bias is not supported when out_dtype is set to Float32"
            assert bias.dtype in (torch.bfloat16, torch.float16) and bias.dtype == out, \
                f"bias {bias.dtype} with out_dtype {out}"
            assert bias.device == a.device and tuple(bias.shape) == (b.shape[1],)
