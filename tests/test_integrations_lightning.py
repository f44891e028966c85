"""fp8kit.integrations.lightning: the Trainer and Fabric plugins train exactly as a hand-written FP8 loop, and a
checkpoint resumes bit-identically when the module converts its own layers."""

import copy
import warnings

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format

L = pytest.importorskip("lightning")  # declared in the test extra; skips only where it cannot install
from fp8kit.integrations.lightning import FabricFP8Precision, FP8Precision  # noqa: E402

RECIPE = DelayedScaling(amax_history_len=4)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def data(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)) for _ in range(n)]


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out.float(), y)


class Module(L.LightningModule):
    def __init__(self, convert_here=False):
        super().__init__()
        self.net = net()
        self.convert_here = convert_here

    def configure_model(self):
        if self.convert_here and not isinstance(self.net[0], te.Linear):
            te.convert_model(self.net)

    def training_step(self, batch, _):
        x, y = batch
        return loss_fn(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module, plugin, epochs, ckpt_path=None, save=None):
    trainer = L.Trainer(max_epochs=epochs, plugins=[plugin], accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about dataloader workers and the like
        trainer.fit(module, torch.utils.data.DataLoader(data(), batch_size=None), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    return trainer


def manual(steps, recipe, dtype=torch.bfloat16):
    model = te.convert_model(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        x, y = data()[i % 4]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype), te.autocast(enabled=recipe is not None, recipe=recipe):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    return model


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("recipe", [RECIPE, Float8CurrentScaling()], ids=["delayed", "current"])
def test_trainer_plugin_trains_as_a_hand_written_fp8_loop(recipe):
    module = Module()
    plugin = FP8Precision(recipe=recipe, fallback_compute_dtype=torch.bfloat16)
    trainer = fit(module, plugin, epochs=2)
    assert trainer.precision == "fp8kit" and type(module.net[0]) is te.Linear
    expected = manual(8, recipe)
    assert_same(module.net, expected)
    bf16 = manual(8, None)  # and FP8 is not a no-op: the same loop in bf16 only ends elsewhere
    assert not torch.equal(bf16[0].weight, module.net[0].weight)
    assert torch.allclose(bf16[0].weight, module.net[0].weight, atol=0.02)
    if recipe is RECIPE:
        assert module.net[0].fp8_meta["scaling_fwd"].update_count == 8


def test_fabric_plugin_trains_as_a_hand_written_fp8_loop():
    fabric = L.Fabric(accelerator="cpu", devices=1,
                      plugins=[FabricFP8Precision(recipe={"amax_history_len": 4, "fp8_format": "HYBRID"},
                                                  fallback_compute_dtype=torch.bfloat16)])
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for i in range(3):
        x, y = data()[i]
        optimizer.zero_grad()
        fabric.backward(loss_fn(model(x), y))
        optimizer.step()
    assert_same(model.module, manual(3, RECIPE))


def test_resume_when_the_module_converts_itself(tmp_path):
    full = Module(convert_here=True)
    fit(full, FP8Precision(recipe=RECIPE, fallback_compute_dtype=torch.bfloat16), epochs=2)
    half = Module(convert_here=True)
    fit(half, FP8Precision(recipe=RECIPE, fallback_compute_dtype=torch.bfloat16), epochs=1,
        save=tmp_path / "epoch1.ckpt")
    resumed = Module(convert_here=True)
    fit(resumed, FP8Precision(recipe=RECIPE, fallback_compute_dtype=torch.bfloat16), epochs=2,
        ckpt_path=tmp_path / "epoch1.ckpt")
    assert_same(resumed.net, full.net)
    assert resumed.net[0].fp8_meta["scaling_fwd"].update_count == 8
    # Converted by the plugin only: Lightning restores the checkpoint into torch.nn.Linear layers first, and says so.
    with pytest.raises(RuntimeError, match="Unexpected key.*fp8_meta"):
        fit(Module(), FP8Precision(recipe=RECIPE), epochs=2, ckpt_path=tmp_path / "epoch1.ckpt")


def test_plugin_arguments():
    plugin = FP8Precision(recipe={"margin": 1, "fp8_format": "E4M3"})
    assert plugin.recipe == DelayedScaling(margin=1, fp8_format=Format.E4M3)
    assert FP8Precision().recipe == DelayedScaling() and FP8Precision().fallback_compute_dtype == torch.float32
    with pytest.raises(ValueError, match="fp8_format'] must be one of E4M3, E5M2, HYBRID, got 'FP4'"):
        FP8Precision(recipe={"fp8_format": "FP4"})
    with pytest.raises(TypeError, match="recipe must be"):
        FP8Precision(recipe="delayed")
    with pytest.raises(TypeError, match="weights_dtype must be a floating torch.dtype"):
        FP8Precision(weights_dtype=torch.int8)
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda', got 'tpu'"):
        FP8Precision(device_type="tpu")
    module = te.convert_model(copy.deepcopy(net()))
    assert FP8Precision(replace_layers=True).convert_module(module) is module  # already converted: left alone
    kept = FP8Precision(replace_layers=False).convert_module(net())
    assert type(kept[0]) is torch.nn.Linear
    bf16 = FP8Precision(weights_dtype=torch.bfloat16).convert_module(net())
    assert type(bf16[0]) is te.Linear and bf16[0].weight.dtype == torch.bfloat16
