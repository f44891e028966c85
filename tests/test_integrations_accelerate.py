"""fp8kit.integrations.accelerate: the forward wrapper, Hugging Face accelerate, and a transformers Trainer run
(training in FP8, evaluation outside FP8, checkpoint, bit-identical resume)."""

import copy
import io
import os
import pickle

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
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

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.integrations.accelerate import ACCELERATE_DEFAULT_RECIPE, FP8Forward, prepare_model  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

RECIPE = DelayedScaling(amax_history_len=4)
hf_logging.set_verbosity_error()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def tokens(seed, n=4):
    return torch.randint(0, 128, (n, 32), generator=torch.Generator().manual_seed(seed))


def states(model):
    return [m.fp8_meta["scaling_fwd"] for m in model.modules() if hasattr(m, "fp8_meta")]


# ---- the wrapper -----------------------------------------------------------------------------------------


def test_training_forward_runs_in_fp8_and_eval_forward_does_not():
    torch.manual_seed(0)
    model = llama()
    stock = copy.deepcopy(model)
    assert prepare_model(model, RECIPE) is model
    assert isinstance(model.forward, FP8Forward) and type(model.model.layers[0].mlp.up_proj) is te.Linear
    x = tokens(0)
    # Training mode: the same as the converted model called under te.autocast by hand.
    manual = te.convert_model(copy.deepcopy(stock))
    with te.autocast(recipe=RECIPE):
        expected = manual(input_ids=x, labels=x).loss
    loss = model(input_ids=x, labels=x).loss
    assert torch.equal(loss, expected) and loss != stock(input_ids=x, labels=x).loss
    assert all(s is not None and s.update_count == 1 for s in states(model))
    # Eval mode: the stock model's numbers, and the FP8 state does not move.
    model.eval()
    stock.eval()
    before = [s.amax_history.clone() for s in states(model)]
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, stock(input_ids=x).logits)
    assert all(torch.equal(b, s.amax_history) for b, s in zip(before, states(model)))
    model.forward.use_during_eval = True
    with torch.no_grad():
        assert not torch.equal(model(input_ids=x).logits, stock(input_ids=x).logits)


def test_copies_run_their_own_forward():
    torch.manual_seed(0)
    model = prepare_model(gpt2(), Float8CurrentScaling())
    x = tokens(1)
    expected = model(input_ids=x).logits
    twins = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    twins.append(torch.load(buffer, weights_only=False))  # the whole module, as torch.save(model) users do
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(2)  # the original changes; the copies must not follow
    assert not torch.equal(model(input_ids=x).logits, expected)
    for twin in twins:
        assert twin.forward.module is twin and twin.forward.recipe == Float8CurrentScaling()
        assert torch.equal(twin(input_ids=x).logits, expected)


def test_prepare_model_arguments():
    model = prepare_model(llama())
    assert model.forward.recipe == ACCELERATE_DEFAULT_RECIPE and model.forward.recipe.amax_history_len == 1024
    assert model.forward.recipe.amax_compute_algo == "most_recent"  # accelerate's TERecipeKwargs defaults
    with pytest.raises(ValueError, match="prepared already"):
        prepare_model(model)
    with pytest.raises(TypeError, match="recipe must be"):
        prepare_model(llama(), recipe="delayed")
    with pytest.raises(TypeError, match="use_during_eval must be a bool"):
        prepare_model(llama(), use_during_eval=1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        prepare_model("llama")
    with pytest.raises(ValueError, match="holds no fp8kit layer"):
        prepare_model(llama(), convert=False)
    kept = prepare_model(llama(), module_filter=lambda m, fqn: "mlp" not in fqn)
    assert type(kept.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert type(kept.model.layers[0].self_attn.q_proj) is te.Linear
    with pytest.warns(UserWarning, match="converted no layer"):
        prepare_model(torch.nn.Sequential(torch.nn.ReLU()))


def test_with_an_accelerator():
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = prepare_model(gpt2(), RECIPE)
    reference = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x = tokens(step)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # what accelerate adds: bf16 autocast around it
            ref = reference(input_ids=x, labels=x).loss
        ref.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        assert torch.equal(loss, ref)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert all(s.update_count == 3 for s in states(model))
    bare = accelerator.unwrap_model(model, keep_fp32_wrapper=False)  # leaves the FP8 wrapper callable
    x = tokens(9)
    with torch.no_grad():
        assert torch.equal(bare(input_ids=x).logits.float(), reference(input_ids=x).logits.float())


# ---- transformers.Trainer -------------------------------------------------------------------------------


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, offset=0):
        self.rows = torch.cat([tokens(offset + i, 1) for i in range(n)])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def trainer(out, model, **kwargs):
    args = TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=3e-3,
                             bf16=True, use_cpu=True, save_steps=3, logging_steps=1, report_to="none", seed=0,
                             disable_tqdm=True, per_device_eval_batch_size=4, **kwargs)
    return Trainer(model=model, args=args, train_dataset=Tokens(48), eval_dataset=Tokens(8, offset=1000))


def fresh():
    torch.manual_seed(0)
    return prepare_model(llama(), RECIPE)


def losses(t):
    return [e["loss"] for e in t.state.log_history if "loss" in e]


def run_and_resume(tmp_path, **kwargs):
    """Train 6 steps (checkpoint at 3), then resume from the checkpoint in a new model and Trainer."""
    first = trainer(tmp_path, fresh(), **kwargs)
    first.train()
    second = trainer(tmp_path, fresh(), **kwargs)
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    return first, second


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb) and any(".fp8_meta." in k for k in sa)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_trainer_trains_in_fp8_evaluates_outside_and_resumes_bit_identically(tmp_path):
    first, second = run_and_resume(tmp_path)
    model = first.model
    assert all(s.update_count == 6 for s in states(model))  # six FP8 training steps
    assert losses(second)[-3:] == losses(first)[-3:]
    assert_same_state(model, second.model)

    # Evaluation ran outside FP8: the stock model with the same weights gives the same loss.
    stock = llama()
    stock.load_state_dict(model.state_dict(), strict=False)
    stock.eval()
    batches = [Tokens(8, offset=1000).rows[i:i + 4] for i in (0, 4)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = sum(stock(input_ids=x, labels=x).loss.float().item() for x in batches) / 2
    assert first.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert all(s.update_count == 6 for s in states(model))  # and evaluation moved no FP8 state

    # The checkpoint holds the FP8 state; without it the resumed run differs.
    from safetensors.torch import load_file, save_file

    path = tmp_path / "checkpoint-3" / "model.safetensors"
    saved = load_file(path)
    assert sum(".fp8_meta." in k for k in saved) == 6 * 7 * 2 + 6  # 7 Linears per layer, 2 layers, lm_head
    save_file({k: v for k, v in saved.items() if ".fp8_meta." not in k}, path, metadata={"format": "pt"})
    third = trainer(tmp_path, fresh())
    third.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert losses(third)[-3:] != losses(first)[-3:]


def test_trainer_with_gradient_checkpointing(tmp_path):
    """FP8 recompute (activation checkpointing) must give the losses and state of the run without it."""
    plain = trainer(tmp_path / "plain", fresh())
    plain.train()
    checkpointed = trainer(tmp_path / "gc", fresh(), activation_checkpointing=True,  # was gradient_checkpointing
                           activation_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()
    assert checkpointed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    assert losses(checkpointed) == losses(plain)
    assert_same_state(plain.model, checkpointed.model)


def test_example_script(tmp_path):
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[1] / "examples" / "hf_trainer.py"
    result = subprocess.run([sys.executable, str(script), "--steps", "4", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if not line.startswith("{")]
    assert lines[0].startswith("trained 4 steps in FP8: training loss ") and lines[0].endswith(
        "4 delayed-scaling updates")
    assert lines[1].startswith("evaluation (bf16, outside FP8): loss ")
    assert lines[2] == (f"resumed from {tmp_path / 'out'}/checkpoint-2: final weights and FP8 state (84 fp8_meta "
                        "tensors) bit-identical to the uninterrupted run")
