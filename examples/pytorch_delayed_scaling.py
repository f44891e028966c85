"""The FP8 delayed-scaling example from the documentation, with fp8kit's imports. Runs on CUDA or CPU."""

import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling

device = "cuda" if torch.cuda.is_available() else "cpu"

# Create FP8 Delayed Scaling recipe
recipe = DelayedScaling(
    margin=0,  # Margin for scaling factor computation (default: 0)
    amax_history_len=1024,  # Length of amax history window (default: 1024)
    amax_compute_algo="max",  # How to compute amax from history (default: "max")
)

# Create a linear layer with bfloat16 parameters
layer = te.Linear(1024, 1024, params_dtype=torch.bfloat16, device=device)

# Forward and backward pass
inp = torch.randn(32, 128, 1024, dtype=torch.bfloat16, device=device)

with te.autocast(enabled=True, recipe=recipe):
    output = layer(inp)
    loss = output.sum()

loss.backward()

meta = layer.fp8_meta["scaling_fwd"]
print("forward amax (input, weight, output):", meta.amax_history[-1].tolist())
print("forward scale:", meta.scale.tolist())
print("backward scale (grad_output, grad_input):", layer.fp8_meta["scaling_bwd"].scale.tolist())
