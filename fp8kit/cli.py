"""The `fp8kit` command (also `python -m fp8kit`): `fp8kit demo`, `fp8kit bench`.

Every subcommand has `--help`. Bad arguments print one line, `fp8kit <command>: error: ...`, and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import fp8kit
from fp8kit.bench_common import device_argument
from fp8kit.bench_common import positive_int as _positive_int

PRESETS = {
    # The three default runs take about 2m10s on an idle 2-core CPU (see docs/demo.md).
    "tiny": dict(n_layer=4, n_embd=128, n_head=4, block_size=64, batch_size=32, steps=250, lr=2e-3),
    # nanoGPT's Shakespeare-character model: for a GPU.
    "small": dict(n_layer=6, n_embd=384, n_head=6, block_size=256, batch_size=64, steps=2000, lr=1e-3),
}
# The names of fp8kit.demo.train.RECIPES (kept here so that parsing does not import torch; tests/test_cli.py checks
# they agree) and the default run.
RECIPE_NAMES = ("bf16", "current", "delayed", "mxfp8", "block", "nvfp4", "nvfp4-nosr", "nvfp4-norht", "nvfp4-no2d")
DEFAULT_RECIPES = ("bf16", "current", "delayed")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (no usage dump) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _recipe_list(text: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in RECIPE_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of {', '.join(RECIPE_NAMES)}, got {text!r}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a recipe is listed twice in {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fp8kit", description="FP8 training with Transformer Engine's per-tensor recipes.")
    parser.add_argument("--version", action="version", version=f"fp8kit {fp8kit.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo", help="train a small GPT in bf16 and in FP8/FP4 (current, delayed, block scaling) and compare",
        description="Train a character-level GPT (fp8kit Linear layers) on the Python standard library's source, "
                    "once per precision with the same seed, initial weights and data order; print a table of "
                    "losses and throughput and write results.json, loss.png, delayed_scaling.png and FP8 "
                    "statistics CSVs into --out.")
    demo.add_argument("--steps", type=_positive_int, help="training steps per run (default: the preset's)")
    demo.add_argument("--recipes", type=_recipe_list, default=list(DEFAULT_RECIPES),
                      help=f"comma list of {','.join(RECIPE_NAMES)} (default: {','.join(DEFAULT_RECIPES)})")
    demo.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    demo.add_argument("--out", default="./fp8kit-demo", help="output directory (default: ./fp8kit-demo)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order")
    demo.add_argument("--size", choices=sorted(PRESETS), default="tiny",
                      help="model preset: tiny (CPU, default) or small (GPU); the options below override it")
    for name, help_text in (("--n-layer", "transformer blocks"), ("--n-embd", "embedding width"),
                            ("--n-head", "attention heads"), ("--block-size", "context length"),
                            ("--batch-size", "sequences per step")):
        demo.add_argument(name, type=_positive_int, help=f"{help_text} (default: the preset's)")
    demo.add_argument("--lr", type=_positive_float, help="peak learning rate (default: the preset's)")
    demo.add_argument("--eval-interval", type=_positive_int, default=50,
                      help="steps between validation losses (default: 50)")
    demo.add_argument("--corpus", help="a text file, or a directory whose *.py files are read "
                                       "(default: the standard library of this Python)")
    demo.add_argument("--max-chars", type=_positive_int, default=1_000_000,
                      help="corpus size cap in characters (default: 1000000)")
    demo.add_argument("--model", choices=("plain", "te"), default="plain",
                      help="plain: a GPT written with fp8kit Linear layers (default); te: the same GPT built from "
                           "te.TransformerLayer blocks (Transformer Engine's module)")
    demo.add_argument("--no-stats", action="store_true", help="do not record FP8 numerics statistics")
    demo.add_argument("--compile", action="store_true",
                      help="train with torch.compile: each step's forward and loss (both autocasts inside) as one "
                           "fullgraph graph, the backward by AOT autograd, the optimizer eager; no FP8 statistics")
    demo.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"), default="inductor",
                      help="torch.compile backend for --compile (default: inductor; aot_eager: bit-identical to "
                           "the eager run)")
    demo.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    demo.set_defaults(run=_run_demo, subparser=demo)

    from fp8kit import bench

    bench.add_arguments(commands.add_parser(
        "bench", help="time Linear forward+backward in FP8 against bf16 and peers; quantize throughput",
        description=bench.__doc__.split("\n\n")[0]))
    return parser


def _run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fp8kit.demo import GPTConfig, TrainConfig, load_corpus, run_demo

    preset = dict(PRESETS[args.size])
    for key in ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "steps", "lr"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    device = device_argument(parser, args.device)
    try:
        model = GPTConfig(n_layer=preset["n_layer"], n_embd=preset["n_embd"], n_head=preset["n_head"],
                          block_size=preset["block_size"])
    except ValueError as e:
        parser.error(str(e))
    fp8 = [r for r in args.recipes if r != "bf16"]
    blocks32 = [r for r in args.recipes if r.startswith(("mxfp8", "nvfp4"))]
    if blocks32 and (model.n_embd % 32 or (preset["batch_size"] * model.block_size) % 32):
        parser.error(f"{blocks32[0]} quantizes blocks of 32 (MXFP8) or 16 values with GEMM dims multiples of 32 "
                     "(NVFP4): it needs --n-embd and batch-size x block-size multiples of 32")
    if device.startswith("cuda") and fp8 and (model.n_embd % 16 or (preset["batch_size"] * model.block_size) % 8):
        parser.error("FP8 GEMMs on CUDA need --n-embd a multiple of 16 and batch-size x block-size a multiple of 8")
    cfg = TrainConfig(model=model, steps=preset["steps"], batch_size=preset["batch_size"], lr=preset["lr"],
                      eval_interval=min(args.eval_interval, preset["steps"]), seed=args.seed, device=device,
                      stats=not args.no_stats, arch=args.model, compile=args.compile,
                      compile_backend=args.compile_backend)
    try:
        corpus = load_corpus(max_chars=args.max_chars, path=args.corpus)
    except (OSError, ValueError) as e:
        parser.error(f"argument --corpus: {e}")
    if corpus.val.numel() <= model.block_size + 1:
        parser.error(f"the corpus ({corpus.chars} characters) is too small for --block-size {model.block_size}")
    try:
        run_demo(cfg, args.recipes, args.out, corpus=corpus, progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the finished runs are in {args.out}/results.json", file=sys.stderr)
        return 130
    except FloatingPointError as e:  # a run diverged; the runs before it are on disk
        print(f"fp8kit demo: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
