"""A transformers Trainer run in FP8 with fp8kit: training, evaluation outside FP8, a checkpoint, and a resumed run
that ends bit-identical to the uninterrupted one.

    python examples/hf_trainer.py [--model llama|gpt2] [--steps 40] [--out hf-trainer-out]

A small Llama (or GPT-2) built from a config (random init, no download) learns byte-level text (the Python standard
library's source). `fp8kit.integrations.accelerate.prepare_model` converts it and runs its forward under fp8kit's
autocast while it trains; `TrainingArguments(bf16=True)` adds bf16 autocast around everything else.
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from fp8kit.demo import load_corpus  # noqa: E402
from fp8kit.integrations.accelerate import prepare_model  # noqa: E402
from fp8kit.recipe import DelayedScaling, Format  # noqa: E402


class Windows(torch.utils.data.Dataset):
    """Consecutive windows of `block` tokens; labels are the inputs (transformers shifts them)."""

    def __init__(self, tokens: torch.Tensor, block: int):
        self.rows = tokens[: tokens.numel() // block * block].view(-1, block)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                           eos_token_id=0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=192,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                             pad_token_id=0))
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    return prepare_model(model, recipe, module_filter=lambda module, fqn: fqn != "lm_head")


def make_trainer(model, out: str, steps: int, corpus) -> Trainer:
    args = TrainingArguments(output_dir=out, max_steps=steps, save_steps=steps // 2, per_device_train_batch_size=8,
                             per_device_eval_batch_size=8, learning_rate=2e-3, lr_scheduler_type="cosine",
                             warmup_steps=steps // 10, bf16=True, use_cpu=True, logging_steps=steps // 4,
                             report_to="none", seed=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=Windows(corpus.train, 64),
                   eval_dataset=Windows(corpus.val[:64 * 16], 64))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    parser.add_argument("--steps", type=int, default=40, help="training steps (a checkpoint at half of them)")
    parser.add_argument("--out", default="hf-trainer-out")
    args = parser.parse_args(argv)
    if args.steps < 4 or args.steps % 2:
        parser.error(f"--steps must be an even number >= 4, got {args.steps}")
    hf_logging.set_verbosity_error()
    corpus = load_corpus(max_chars=200_000)

    trainer = make_trainer(build(args.model), args.out, args.steps, corpus)
    trainer.train()
    model = trainer.model
    layer = next(m for m in model.modules() if hasattr(m, "fp8_meta"))
    print(f"trained {args.steps} steps in FP8: training loss {trainer.state.log_history[-2]['loss']:.4f}, "
          f"{layer.fp8_meta['scaling_fwd'].update_count} delayed-scaling updates")
    print(f"evaluation (bf16, outside FP8): loss {trainer.evaluate()['eval_loss']:.4f}")

    checkpoint = os.path.join(args.out, f"checkpoint-{args.steps // 2}")
    resumed = make_trainer(build(args.model), args.out, args.steps, corpus)
    resumed.train(resume_from_checkpoint=checkpoint)
    a, b = model.state_dict(), resumed.model.state_dict()
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fp8_keys = sum(".fp8_meta." in k for k in a)
    print(f"resumed from {checkpoint}: final weights and FP8 state ({fp8_keys} fp8_meta tensors) "
          f"{'bit-identical' if same else 'DIFFERENT'} to the uninterrupted run")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
