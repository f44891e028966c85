"""What the CPU kernels' tests share: a few training steps of a model with the kernels on or off, and a torch
thread count for a scope."""

import contextlib

import torch

import fp8kit.pytorch as te
from fp8kit.pytorch import cpu_kernels


@contextlib.contextmanager
def threads(n: int):
    """torch's intra-op thread count set to `n` in this scope."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def train_steps(make_model, recipe, on: bool, rows: int, cols: int, steps: int = 3) -> list:
    """Outputs and input gradients of `steps` steps of `make_model()` (seeded, bf16 inputs [rows, cols], the loss
    sum(y^2)) with the CPU kernels `on` or off, then the parameters' gradients and the state dict's tensors."""
    torch.manual_seed(0)
    model = make_model()
    g = torch.Generator().manual_seed(1)
    out = []
    with cpu_kernels.switched(on):
        for _ in range(steps):
            x = torch.randn(rows, cols, generator=g).bfloat16().requires_grad_()
            with te.autocast(recipe=recipe):
                y = model(x)
            y.float().pow(2).sum().backward()
            out += [y.detach(), x.grad]
    state = [v for v in model.state_dict().values() if isinstance(v, torch.Tensor)]
    return out + [p.grad for p in model.parameters()] + state
