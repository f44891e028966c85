"""The FP8 current-scaling example from the documentation, with fp8kit's imports. Runs on CUDA or CPU."""

import torch

import fp8kit.pytorch as te
from fp8kit.recipe import Float8CurrentScaling, Format

device = "cuda" if torch.cuda.is_available() else "cpu"

# Create FP8 Current Scaling recipe
# Available formats:
# - Format.HYBRID (default) -- E4M3 for forward pass, E5M2 for backward pass
# - Format.E4M3 -- E4M3 for both forward and backward pass
recipe = Float8CurrentScaling(fp8_format=Format.HYBRID)

# Create a simple linear layer with bfloat16 parameters
layer = te.Linear(1024, 1024, params_dtype=torch.bfloat16, device=device)

# Forward and backward pass
inp = torch.randn(32, 128, 1024, dtype=torch.bfloat16, device=device)

with te.autocast(enabled=True, recipe=recipe):
    output = layer(inp)
    loss = output.sum()

loss.backward()

reference = torch.nn.functional.linear(inp.float(), layer.weight.float(), layer.bias.float())
error = (output.float() - reference).norm() / reference.norm()
print(f"relative error of the FP8 output against float32: {error:.4f}")
