"""`fp8kit demo --model te`: the demo GPT built from te.TransformerLayer has the plain model's parameters and
structure, trains in every precision, and its losses stay within 2% of the plain model's."""

import os

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.cli import build_parser
from fp8kit.demo import GPT, GPTConfig, TrainConfig, load_corpus, run_demo
from fp8kit.demo.te_model import TEGPT, build_model

pytestmark = pytest.mark.skipif(not hasattr(te, "LayerNormMLP"), reason="TransformerLayer needs te.LayerNormMLP")

SMALL = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)


def test_same_parameters_and_interface_as_the_plain_model():
    plain, model = build_model(SMALL, "plain"), build_model(SMALL, "te")
    assert isinstance(plain, GPT) and isinstance(model, TEGPT)
    assert model.num_params() == plain.num_params()
    assert isinstance(model.get_submodule(model.tracked_layer), te.LayerNormMLP)
    gen = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, SMALL.vocab_size, (3, SMALL.block_size), generator=gen) for _ in range(2))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, SMALL.block_size, SMALL.vocab_size) and abs(loss.item() - 4.85) < 0.1
    # the plain model's initial weights (built first from the same seed): the same outputs up to the GELU form
    torch.manual_seed(5)
    plain = build_model(SMALL, "plain").eval()
    torch.manual_seed(5)
    model = build_model(SMALL, "te").eval()
    torch.testing.assert_close(model(idx)[0], plain(idx)[0], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="unknown demo model 'tf'"):
        build_model(SMALL, "tf")
    # causal: a later token cannot change an earlier logit
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % SMALL.vocab_size
    assert torch.equal(model(changed)[0][:, :-1], model(idx)[0][:, :-1])


def test_cli_offers_the_te_model():
    args = build_parser().parse_args(["demo", "--model", "te"])
    assert args.model == "te"
    assert build_parser().parse_args(["demo"]).model == "plain"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--model", "gpt"])


def test_te_model_trains_within_two_percent_of_the_plain_model(tmp_path):
    """Both models under delayed scaling from the same initial weights and batches: every training loss and the
    final validation loss of the te model within 2% of the plain model's."""
    corpus = load_corpus(max_chars=40_000)
    cfg = dict(model=SMALL, steps=10, batch_size=4, lr=3e-3, warmup=2, eval_interval=10, eval_batches=1, seed=0,
               stats=False)
    runs = {}
    for arch in ("te", "plain"):
        results = run_demo(TrainConfig(arch=arch, **cfg), ["delayed"], str(tmp_path / arch), corpus=corpus,
                           progress=False, stream=open(os.devnull, "w"))
        assert results["config"]["arch"] == arch
        runs[arch] = results["runs"][0]
    te_run, plain_run = runs["te"], runs["plain"]
    assert te_run["final_val_loss"] < te_run["curves"]["train_loss"][0] - 0.3, "the te model did not learn"
    pairs = list(zip(te_run["curves"]["train_loss"], plain_run["curves"]["train_loss"]))
    pairs.append((te_run["final_val_loss"], plain_run["final_val_loss"]))
    assert max(abs(a / b - 1) for a, b in pairs) < 0.02, pairs
