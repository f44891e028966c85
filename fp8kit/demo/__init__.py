"""`fp8kit demo`: a character-level GPT trained in bf16 and in FP8 (current and delayed scaling), compared.

    from fp8kit.demo import TrainConfig, run_demo
    run_demo(TrainConfig(steps=100), ["bf16", "current", "delayed"], out="fp8kit-demo")

See docs/demo.md.
"""

from .data import Corpus, load_corpus
from .model import GPT, GPTConfig
from .run import results_table, run_demo
from .train import RECIPES, TrainConfig, train_one

__all__ = ["Corpus", "load_corpus", "GPT", "GPTConfig", "results_table", "run_demo", "RECIPES", "TrainConfig",
           "train_one"]
