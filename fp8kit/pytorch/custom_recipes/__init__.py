"""Transformer Engine's `transformer_engine.pytorch.custom_recipes` package, as fp8kit provides it: pure-Python
reference quantizers that TE's tests use as oracles (`reference_nvfp4.NVFP4QuantizerRef`), with their helper
modules (`reference_utils`, `gemm`). They are written apart from fp8kit's fast paths (float64 where exact, one
float32 rounding per rule), so that a test comparing the two compares two implementations.
"""
