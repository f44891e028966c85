"""Hugging Face transformers models (random init, no download): GPT-2's Conv1D converted natively, checkpoints
that load into the stock classes, save_pretrained -> from_pretrained resume, FP8 close to bf16."""

import os
import pathlib
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.pytorch_utils import Conv1D as HFConv1D  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.integrations.hf_conv1d import Conv1D  # noqa: E402
from fp8kit.integrations.transformers import from_pretrained, load_pretrained  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

ROOT = pathlib.Path(__file__).parents[1]
DELAYED = DelayedScaling(amax_history_len=4)
RECIPES = [Float8CurrentScaling(), DELAYED]
hf_logging.set_verbosity_error()


def gpt2(width=32, layers=2):
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=width, n_layer=layers, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def llama(width=32, layers=2):
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=width, intermediate_size=2 * width,
                                        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0))


BUILD = {"gpt2": gpt2, "llama": llama}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread is faster, and far faster when other processes compete for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def text():
    """Byte-level tokens (7-bit ASCII) of a standard library file."""
    with open(os.__file__, encoding="utf-8", errors="replace") as f:
        data = f.read(60_000).encode("ascii", "replace")
    return torch.tensor(list(data), dtype=torch.int64)


def batch(text, step, size=4, length=32):
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, text.numel() - length, (size,), generator=g)
    return text[starts[:, None] + torch.arange(length)]


def step_loss(model, x, recipe):
    with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
        return model(input_ids=x, labels=x).loss


# ---- GPT-2's Conv1D ------------------------------------------------------------------------------------------


def test_gpt2_conv1d_layers_are_converted_in_place(text):
    torch.manual_seed(0)
    model = gpt2()
    stock = gpt2()
    stock.load_state_dict(model.state_dict())
    before = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    te.convert_model(model)
    conv = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(conv) == 4 * 2 and not any(type(m) is HFConv1D for m in model.modules())
    layer = model.transformer.h[0].attn.c_attn
    assert isinstance(layer, HFConv1D) and not isinstance(layer, torch.nn.Linear)
    assert {n: p for n, p in model.named_parameters()}.items() == before.items()  # same names, same objects
    assert layer.weight.shape == (32, 96) and (layer.nx, layer.nf) == (32, 96)
    assert list(model.state_dict()) == keys  # no FP8 state until a delayed-scaling step
    x = batch(text, 0)
    for autocast in (False, True):  # outside FP8: the stock model's numbers, bit for bit
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ours, theirs = model(input_ids=x, labels=x), stock(input_ids=x, labels=x)
        assert torch.equal(ours.logits, theirs.logits)
        ours.loss.backward()
        theirs.loss.backward()
        for (name, p), q in zip(model.named_parameters(), stock.parameters()):
            assert torch.equal(p.grad, q.grad), name
        model.zero_grad()
        stock.zero_grad()


@pytest.mark.parametrize("recipe", RECIPES, ids=["current", "delayed"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv1d_in_fp8_equals_linear_with_the_transposed_weight(recipe, bias):
    """Conv1D stores W [in, out]; fp8kit's Linear holding W.T [out, in] (tested against the float64 oracle in
    test_linear.py) must give the same outputs, gradients and delayed-scaling state, bit for bit."""
    torch.manual_seed(1)
    hf = HFConv1D(48, 32)
    if not bias:
        hf.bias = None
    conv = Conv1D.from_hf(hf)
    assert conv.weight is hf.weight
    linear = te.Linear(32, 48, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(hf.weight.t())
        if bias:
            linear.bias.copy_(hf.bias)
    for step in range(3):
        x = torch.randn(2, 8, 32) * (step + 1)
        dy = torch.randn(2, 8, 48)
        outs = []
        for layer in (conv, linear):
            xi = x.clone().requires_grad_()
            with te.autocast(recipe=recipe):
                y = layer(xi)
            y.backward(dy)
            outs.append((y, xi.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert not torch.equal(outs[0][0], x @ hf.weight + (hf.bias if bias else 0))  # it ran in FP8
        assert torch.equal(conv.weight.grad, linear.weight.grad.t())
        if bias:
            assert torch.equal(conv.bias.grad, linear.bias.grad)
    if recipe is DELAYED:
        for name in ("scaling_fwd", "scaling_bwd"):
            ours, theirs = conv.fp8_meta[name], linear.fp8_meta[name]
            assert torch.equal(ours.amax_history, theirs.amax_history) and torch.equal(ours.scale, theirs.scale)
            assert not torch.equal(ours.scale, torch.ones_like(ours.scale[:1]).expand_as(ours.scale))
        assert set(conv.state_dict()) == set(linear.state_dict())


def test_conv1d_construction_and_stats():
    torch.manual_seed(0)
    layer = Conv1D(256, 128, dtype=torch.bfloat16)
    assert layer.weight.shape == (128, 256) and layer.weight.dtype == torch.bfloat16
    assert abs(layer.weight.float().std().item() - 0.02) < 0.002 and not layer.bias.any()
    assert repr(layer) == "Conv1D(nf=256, nx=128, fp8kit)"
    for bad in ({"nf": 0, "nx": 4}, {"nf": 4, "nx": 2.5}):
        with pytest.raises(ValueError, match=f"{next(k for k, v in bad.items() if v in (0, 2.5))} must be"):
            Conv1D(**bad)
    with pytest.raises(TypeError, match="expected a transformers Conv1D"):
        Conv1D.from_hf(torch.nn.Linear(4, 4))
    model = torch.nn.Sequential(Conv1D(32, 16))
    assert te.enable_stats(model) == 1
    with te.autocast(recipe=Float8CurrentScaling()):
        model(torch.randn(4, 16))
    rows = te.stats(model)
    assert {(r["module"], r["role"]) for r in rows} == {("0", "input"), ("0", "weight")}


def test_a_bad_fp8_entry_loads_nothing_of_a_conv1d():
    """The FP8 entries are checked before the Conv1D's own parameters load (all or nothing, as for Linear)."""
    torch.manual_seed(0)
    layer = Conv1D(32, 16)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        layer(torch.randn(4, 16)).sum().backward()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    bad = {k: v + 1 for k, v in before.items()}
    bad["fp8_meta.scaling_fwd.update_count"] = torch.tensor(1e30, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"fp8_meta.scaling_fwd.update_count: must be an integer"):
        layer.load_state_dict(bad)
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


def test_fp8_checkpoint_loads_into_the_stock_class_and_back(text):
    torch.manual_seed(0)
    model = te.convert_model(gpt2())
    step_loss(model, batch(text, 0), DELAYED).backward()
    state = model.state_dict()
    fp8_keys = {k for k in state if ".fp8_meta." in k}
    assert len(fp8_keys) == (8 + 1) * 6 and "transformer.h.1.mlp.c_proj.fp8_meta.scaling_bwd.scale" in fp8_keys
    stock = gpt2()
    result = stock.load_state_dict(state, strict=False)
    assert set(result.unexpected_keys) == fp8_keys and result.missing_keys == []
    for name, p in stock.named_parameters():
        assert torch.equal(p, state[name]), name
    back = te.convert_model(gpt2())
    back.load_state_dict(stock.state_dict())  # a stock checkpoint loads strictly into a converted model
    assert back.transformer.h[0].attn.c_attn.fp8_meta["scaling_fwd"] is None
    back.load_state_dict(state)  # and an FP8 one restores the state
    assert torch.equal(back.transformer.h[1].mlp.c_fc.fp8_meta["scaling_fwd"].scale,
                       state["transformer.h.1.mlp.c_fc.fp8_meta.scaling_fwd.scale"])


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gpt2_gradient_checkpointing_is_bit_identical(text, use_reentrant):
    """The Conv1D layers under Hugging Face's activation checkpointing: the recompute repeats the FP8 forward, so
    losses, gradients and FP8 state equal those of the same steps without it (SPEC 8b)."""
    import warnings

    runs = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = te.convert_model(gpt2(), module_filter=lambda m, fqn: fqn != "lm_head")
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.train()
        seen = []
        for step in range(2):
            loss = step_loss(model, batch(text, step), DELAYED)
            loss.backward()
            seen += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
        runs.append((seen, model.state_dict()))
    assert model.is_gradient_checkpointing
    (a, sa), (b, sb) = runs
    assert all(torch.equal(u, v) for u, v in zip(a, b)) and len(a) == len(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- save_pretrained -> from_pretrained --------------------------------------------------------------------


def run_steps(model, text, steps, lr=0.5):
    """SGD without momentum (no optimizer state to carry over), delayed scaling; the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in steps:
        loss = step_loss(model, batch(text, step), DELAYED)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_save_pretrained_then_from_pretrained_resumes_bit_identically(name, text, tmp_path):
    torch.manual_seed(0)
    model = te.convert_model(BUILD[name](), module_filter=lambda m, fqn: fqn != "lm_head")
    run_steps(model, text, range(3))
    model.save_pretrained(tmp_path)
    expected = run_steps(model, text, range(3, 6))
    final = model.state_dict()

    resumed = from_pretrained(AutoModelForCausalLM, str(tmp_path), module_filter=lambda m, fqn: fqn != "lm_head")
    assert resumed.training and type(resumed) is type(model)
    assert run_steps(resumed, text, range(3, 6)) == expected
    state = resumed.state_dict()
    assert set(state) == set(final)
    for key, value in final.items():
        assert torch.equal(state[key], value), key

    # What the issue reported: from_pretrained on the stock class, then convert_model, drops the FP8 state.
    naive = te.convert_model(AutoModelForCausalLM.from_pretrained(tmp_path), lambda m, fqn: fqn != "lm_head").train()
    assert next(m for m in naive.modules() if hasattr(m, "fp8_meta")).fp8_meta["scaling_fwd"] is None
    assert run_steps(naive, text, range(3, 6)) != expected


def test_load_pretrained_refuses_what_it_cannot_place(text, tmp_path):
    torch.manual_seed(0)
    model = te.convert_model(gpt2())
    run_steps(model, text, range(1))
    model.save_pretrained(tmp_path / "fp8")
    with pytest.raises(ValueError, match="54 tensors .* have no place in GPT2LMHeadModel .*convert the model"):
        load_pretrained(gpt2(), str(tmp_path / "fp8"))  # not converted
    state = {k: v for k, v in model.state_dict().items() if k != "transformer.h.0.mlp.c_fc.bias"}
    os.makedirs(tmp_path / "bin")
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="lacks 1 tensors of GPT2LMHeadModel: transformer.h.0.mlp.c_fc.bias"):
        load_pretrained(te.convert_model(gpt2()), str(tmp_path / "bin"))
    state["transformer.h.0.mlp.c_fc.bias"] = model.transformer.h[0].mlp.c_fc.bias.detach()
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")  # read with weights_only=True
    loaded = load_pretrained(te.convert_model(gpt2()), str(tmp_path / "bin"))
    assert torch.equal(loaded.transformer.h[0].attn.c_attn.fp8_meta["scaling_bwd"].amax_history,
                       model.transformer.h[0].attn.c_attn.fp8_meta["scaling_bwd"].amax_history)
    stock = gpt2()
    stock.save_pretrained(tmp_path / "stock")  # no FP8 state: loads as it is, the layers start fresh
    converted = load_pretrained(te.convert_model(gpt2()), str(tmp_path / "stock"))
    assert converted.transformer.h[0].mlp.c_proj.fp8_meta["scaling_fwd"] is None
    assert torch.equal(converted.transformer.h[1].mlp.c_proj.weight, stock.transformer.h[1].mlp.c_proj.weight)
    assert converted.lm_head.weight is converted.transformer.wte.weight  # tied, saved once
    with pytest.raises(NotADirectoryError, match="save_pretrained directory"):
        load_pretrained(model, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_pretrained(model, str(tmp_path))
    with pytest.raises(TypeError, match="Auto class or PreTrainedModel"):
        from_pretrained(dict, str(tmp_path / "fp8"))


# ---- training ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fp8_trains_as_well_as_bf16(name, text):
    final = {}
    for recipe in (None, Float8CurrentScaling(), DelayedScaling(amax_history_len=16)):
        torch.manual_seed(0)
        model = BUILD[name](width=64)
        if recipe is not None:
            te.convert_model(model, module_filter=lambda m, fqn: fqn != "lm_head")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(40):
            loss = step_loss(model, batch(text, step, size=8), recipe)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        final[type(recipe).__name__] = sum(losses[-5:]) / 5
        assert final[type(recipe).__name__] < losses[0] - 1.0  # it learned
    base = final.pop("NoneType")
    for value in final.values():
        assert value == pytest.approx(base, rel=0.03) and value != base


def test_example_script_runs():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_fp8_vs_bf16.py"), "--steps", "2",
                             "--width", "32", "--layers", "1", "--max-chars", "20000", "--batch", "4", "--block", "32"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [(m, r) for m in ("gpt2", "llama") for r in ("bf16", "current", "delayed")]
    assert all(r[4].endswith("%") for r in rows if r[1] != "bf16")
