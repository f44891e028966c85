"""Elementwise maps of 8- and 16-bit codes on the CPU by table lookup, in cache-sized chunks.

A function of an 8- or 16-bit input (the CPU cast uses it for the FP8 byte of a bf16 value times a fixed scale,
and for that byte's value widened to bf16) is a table of 256 or 65536 entries. Applying it to a large tensor is
then one gather (`index_select`), whose result is bit-identical to the function however the table was made, in
whatever way the table's own maker rounds. Indices must be int32 or int64, so the codes are widened to int32 a
chunk at a time into a small buffer that stays in the core's cache, and each chunk is gathered straight into its
slice of the outputs: the input is read once and each output written once, instead of a pass over main memory per
elementwise step.
"""

from __future__ import annotations

from typing import Sequence

import torch

CHUNK = 1 << 16  # codes per gather: a 256 KiB int32 index buffer (L2-resident alongside its outputs)


def gather(codes: torch.Tensor, tables: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
    """`outs[i][j] = tables[i][codes[j]]` for 1-D contiguous CPU tensors: `codes` uint8 or uint16, each table 1-D
    with an entry per code value, each out 1-D of `codes`' length and its table's dtype."""
    n = codes.numel()
    index = torch.empty(min(n, CHUNK), dtype=torch.int32)
    # the chunk views made by `split` in one call each (slicing chunk by chunk in Python cost ~15 us a chunk)
    for code_part, *out_parts in zip(codes.split(CHUNK), *(out.split(CHUNK) for out in outs)):
        part = index if code_part.numel() == CHUNK else index[:code_part.numel()]
        part.copy_(code_part)
        for table, out in zip(tables, out_parts):
            torch.index_select(table, 0, part, out=out)
