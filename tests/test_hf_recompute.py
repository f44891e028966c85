"""A Hugging Face model converted with convert_model trains with its own activation checkpointing bit-identically to
the same steps without it (SPEC section 8b), in both of torch's checkpoint modes and for both recipes."""

import os
import warnings

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _llama(checkpointing, use_reentrant):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    te.convert_model(model)
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    return model


def _run(recipe, checkpointing, use_reentrant, steps=2):
    model = _llama(checkpointing, use_reentrant)
    assert sum(isinstance(m, te.Linear) for m in model.modules()) == 2 * 7 + 1
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    seen = []
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 24), generator=g)
        with te.autocast(recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        seen.append([loss.detach()] + [p.grad.clone() for p in model.parameters()]
                    + [t.clone() for m in model.modules() if isinstance(m, te.Linear)
                       for s in (m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"]) if s is not None
                       for t in (s.amax_history, s.scale)])
        opt.step()
    return seen


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent"),
                                    Float8CurrentScaling()], ids=["delayed", "current"])
def test_hf_gradient_checkpointing_is_bit_identical(recipe, use_reentrant):
    want = _run(recipe, False, use_reentrant)
    got = _run(recipe, True, use_reentrant)
    for step, (a, b) in enumerate(zip(got, want)):
        assert len(a) == len(b)
        for i, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), f"step {step}, tensor {i}"
