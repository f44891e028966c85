"""The demo's corpus and batches.

The default corpus exists offline on every machine: the top-level `*.py` files of the running interpreter's
standard library (`os.path.dirname(os.__file__)`), read in sorted name order and concatenated until `max_chars`.
Where that directory holds no sources (e.g. a stripped, bytecode-only Python), fp8kit's own sources are used.
Text is encoded as 7-bit ASCII bytes (anything else becomes "?"), so the vocabulary is always 128 symbols.
The last `val_fraction` of the text is held out for validation.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

VOCAB_SIZE = 128


@dataclass
class Corpus:
    train: torch.Tensor  # int64 [n_train] token ids
    val: torch.Tensor  # int64 [n_val]
    source: str  # where the text came from
    files: int
    chars: int
    sha256: str  # of the encoded text: equal hashes mean equal data

    def describe(self) -> str:
        return (f"{self.chars:,} characters from {self.files} files in {self.source} "
                f"(train {self.train.numel():,}, val {self.val.numel():,}; sha256 {self.sha256[:12]})")


def _python_files(directory: str) -> List[str]:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [os.path.join(directory, n) for n in names if n.endswith(".py")
            and os.path.isfile(os.path.join(directory, n))]


def default_sources() -> Tuple[str, List[str]]:
    """(directory, sorted .py files): the standard library, or fp8kit's own package as the fallback."""
    stdlib = os.path.dirname(os.__file__)
    files = _python_files(stdlib)
    if files:
        return stdlib, files
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = []
    for root, dirs, names in os.walk(package):
        dirs.sort()
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    return package, files


def encode(text: str) -> torch.Tensor:
    """ASCII bytes as int64 token ids (non-ASCII characters become '?')."""
    data = text.encode("ascii", errors="replace")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def decode(ids: torch.Tensor) -> str:
    return bytes(ids.to(torch.uint8).tolist()).decode("ascii")


def load_corpus(max_chars: int = 1_000_000, val_fraction: float = 0.1, path: Optional[str] = None) -> Corpus:
    """Read the corpus (`path`: a text file, or a directory whose *.py files are used; default as the module
    docstring says), encode it and split it."""
    if path is not None and os.path.isfile(path):
        source, files = path, [path]
    elif path is not None:
        source, files = path, _python_files(path)
        if not files:
            raise ValueError(f"no .py files in {path}")
    else:
        source, files = default_sources()
    pieces, total, used = [], 0, 0
    for name in files:
        if total >= max_chars:
            break
        try:
            with open(name, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        pieces.append(text[: max_chars - total])
        total += len(pieces[-1])
        used += 1
    ids = encode("".join(pieces))
    n_val = max(1, int(ids.numel() * val_fraction))
    if ids.numel() - n_val < 2:
        raise ValueError(f"corpus from {source} is too small ({ids.numel()} characters)")
    sha = hashlib.sha256(ids.to(torch.uint8).numpy().tobytes()).hexdigest()
    return Corpus(ids[:-n_val], ids[-n_val:], source, used, ids.numel(), sha)


class Batches:
    """Random windows of a token stream, in an order fixed by `seed` (the same for every recipe).

    `get(step)` returns (x, y) int64 `[batch_size, block_size]` with y = x shifted by one; the same step always
    gives the same batch, whatever was drawn before.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, block_size: int, seed: int):
        if data.numel() <= block_size + 1:
            raise ValueError(f"{data.numel()} tokens are too few for block_size {block_size}")
        self.data, self.batch_size, self.block_size, self.seed = data, batch_size, block_size, seed

    def get(self, step: int, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.data.numel() - self.block_size - 1, (self.batch_size,), generator=g)
        offsets = torch.arange(self.block_size + 1)
        windows = self.data[starts[:, None] + offsets]
        return windows[:, :-1].to(device), windows[:, 1:].to(device)
