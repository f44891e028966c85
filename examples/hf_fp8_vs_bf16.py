"""GPT-2 and Llama from Hugging Face transformers (random init, byte-level text) trained in bf16 and in FP8.

    python examples/hf_fp8_vs_bf16.py                      # both models, 200 steps each precision
    python examples/hf_fp8_vs_bf16.py --model gpt2 --steps 20

Each model is built from a config (no download), converted with `fp8kit.pytorch.convert_model` (GPT-2's Conv1D
layers and Llama's Linear layers; the output head stays in high precision) and trained with the same seed, initial
weights and batches once in bf16 (`torch.autocast`) and once per FP8 recipe on top of it. The text is the Python
standard library's source, as in `fp8kit demo`. Prints the validation loss of each run (evaluated in bf16, outside
FP8) and its difference from bf16.
"""

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.demo import load_corpus  # noqa: E402
from fp8kit.demo.data import Batches  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format  # noqa: E402

RECIPES = {
    "bf16": None,
    "current": Float8CurrentScaling(fp8_format=Format.HYBRID),
    "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
}


def build(name: str, width: int, layers: int, block: int) -> torch.nn.Module:
    """A randomly initialised model over the 128 ASCII codes, without dropout."""
    if name == "gpt2":
        cfg = GPT2Config(vocab_size=128, n_positions=block, n_embd=width, n_layer=layers, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(vocab_size=128, hidden_size=width, intermediate_size=3 * width, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=block,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def loss_of(model, x, y):
    return model(input_ids=x, labels=y).loss


def train(name: str, recipe_name: str, corpus, args) -> dict:
    torch.manual_seed(args.seed)
    model = build(name, args.width, args.layers, args.block)
    recipe = RECIPES[recipe_name]
    if recipe is not None:
        te.convert_model(model, module_filter=lambda module, fqn: fqn != "lm_head")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = Batches(corpus.train, args.batch, args.block, args.seed)
    start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        x, _ = batches.get(step)  # labels = inputs: transformers shifts them
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
            loss = loss_of(model, x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{name} {recipe_name}: loss {loss.item()} at step {step}")
    seconds = time.perf_counter() - start
    model.eval()
    val = Batches(corpus.val, args.batch, args.block, args.seed + 7_777)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # evaluation in bf16, outside FP8
        val_loss = sum(loss_of(model, *[val.get(i)[0]] * 2).item() for i in range(8)) / 8
    return {"model": name, "recipe": recipe_name, "train_loss": loss.item(), "val_loss": val_loss, "s": seconds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["gpt2", "llama", "both"], default="both")
    parser.add_argument("--recipes", default="bf16,current,delayed")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-chars", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    corpus = load_corpus(max_chars=args.max_chars)
    names = ["gpt2", "llama"] if args.model == "both" else [args.model]
    recipes = [r.strip() for r in args.recipes.split(",")]
    print(f"{'model':6} {'recipe':8} {'train loss':>10} {'val loss':>9} {'vs bf16':>8} {'train s':>8}")
    for name in names:
        base = None
        for recipe_name in recipes:
            r = train(name, recipe_name, corpus, args)
            base = r["val_loss"] if recipe_name == "bf16" else base
            diff = f"{(r['val_loss'] / base - 1):+.2%}" if base is not None and recipe_name != "bf16" else ""
            print(f"{name:6} {recipe_name:8} {r['train_loss']:10.4f} {r['val_loss']:9.4f} {diff:>8} {r['s']:8.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
