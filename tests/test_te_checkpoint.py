"""Transformer Engine checkpoints: parameter names equal TE's, and TE's pickled `_extra_state` (every layout fp8kit
reads) loads through the restricted reader, which refuses any other code."""

import io
import os
import pickle
import sys

import pytest
import torch
import torch.serialization
from te_layout import (
    MODULE,
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    fake_te_recipe_module,
    format_pickled_by_name,
    pickled_state,
    te_layout,
    te_state,
)

import fp8kit.pytorch as te
from fp8kit.pytorch.te_checkpoint import TEObject, read_extra_state
from fp8kit.recipe import DelayedScaling as Fp8kitDelayed

RECIPE = Fp8kitDelayed(amax_history_len=4)


def trained(module, steps=3, seed=0, width=16):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        with te.autocast(recipe=RECIPE):
            out = module(torch.randn(8, width, generator=gen) * 3)
        out.square().mean().backward()
    return module


def run(module, steps=2, seed=7, width=16):
    """Outputs and weight gradients of `steps` more FP8 steps."""
    gen = torch.Generator().manual_seed(seed)
    results = []
    for _ in range(steps):
        module.zero_grad()
        with te.autocast(recipe=RECIPE):
            out = module(torch.randn(8, width, generator=gen) * 3)
        out.square().mean().backward()
        results += [out.detach(), module.weight.grad.clone()]
    return results


def te_param_keys(weights, biases, layer_norm=None):
    """TE's state_dict keys: the norm's parameters first (LayerNormLinear), then every split weight, then every
    split bias (module/linear.py registers them in that order), then `_extra_state`."""
    return (layer_norm or []) + weights + biases + ["_extra_state"]


# ---- parameter names ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("split, weights, biases", [
    (None, ["weight"], ["bias"]),
    (("query_", "key_", "value_"), ["query_weight", "key_weight", "value_weight"],
     ["query_bias", "key_bias", "value_bias"]),
    ({"gate": 16, "up_": 32}, ["gate_weight", "up_weight"], ["gate_bias", "up_bias"]),
])
def test_linear_parameter_names_equal_te(split, weights, biases):
    ours = trained(te.Linear(16, 48, parameters_split=split))
    sd = ours.state_dict()
    assert [k for k in sd if not k.startswith("fp8_meta.")] + ["_extra_state"] == te_param_keys(weights, biases)
    fresh = te.Linear(16, 48, parameters_split=split)
    assert not fresh.load_state_dict(te_layout(sd), strict=True).unexpected_keys
    for name in weights + biases:
        assert torch.equal(getattr(fresh, name), getattr(ours, name)), name
    no_bias = te.Linear(16, 48, bias=False, parameters_split=split)
    assert list(no_bias.state_dict()) == weights  # TE keeps a bias-less split's biases as plain attributes


@pytest.mark.parametrize("normalization, layer_norm", [("LayerNorm", ["layer_norm_weight", "layer_norm_bias"]),
                                                       ("RMSNorm", ["layer_norm_weight"])])
def test_layernorm_linear_parameter_names_equal_te(normalization, layer_norm):
    torch.manual_seed(0)
    ours = te.LayerNormLinear(16, 32, normalization=normalization)
    with torch.no_grad():
        ours.layer_norm_weight.uniform_(0.5, 1.5)
    trained(ours)
    sd = ours.state_dict()
    assert [k for k in sd if not k.startswith("fp8_meta.")] + ["_extra_state"] == \
        te_param_keys(["weight"], ["bias"], layer_norm)
    fresh = te.LayerNormLinear(16, 32, normalization=normalization)
    fresh.load_state_dict(te_layout(sd), strict=True)
    assert torch.equal(fresh.layer_norm_weight, ours.layer_norm_weight)
    assert all(torch.equal(a, b) for a, b in zip(run(fresh), run(ours)))  # same parameters and FP8 state


# ---- the FP8 state ---------------------------------------------------------------------------------------------

def test_te_extra_state_loads_and_continues_like_fp8kit_state():
    source = trained(te.Linear(16, 32))
    sd = source.state_dict()
    from_te, from_ours = te.Linear(16, 32), te.Linear(16, 32)
    result = from_te.load_state_dict(te_layout(sd), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ours = dict(sd, **{"fp8_meta.scaling_fwd.update_count": torch.tensor(0),
                       "fp8_meta.scaling_bwd.update_count": torch.tensor(0)})
    from_ours.load_state_dict(ours)
    for name in ("scaling_fwd", "scaling_bwd"):
        got, want = from_te.fp8_meta[name], source.fp8_meta[name]
        assert torch.equal(got.amax_history, want.amax_history) and torch.equal(got.scale, want.scale)
        assert got.update_count == 0  # TE keeps no update counter
    a, b = run(from_te), run(from_ours)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(from_te.fp8_meta["scaling_bwd"].amax_history, from_ours.fp8_meta["scaling_bwd"].amax_history)


def test_recipe_is_decoded_without_transformer_engine():
    h, s = torch.rand(16, 3), torch.rand(3) + 0.5
    state = te_state(h, s, torch.rand(16, 2), torch.rand(2) + 0.5,
                     recipe=DelayedScaling(margin=1, fp8_format=Format.E4M3, amax_history_len=16,
                                           amax_compute_algo="most_recent"))
    assert MODULE not in sys.modules
    decoded = read_extra_state(pickled_state(state))
    assert isinstance(decoded.recipe, TEObject) and decoded.recipe.te_class == "DelayedScaling"
    fields = decoded.recipe.fields
    assert (fields["margin"], fields["amax_history_len"], fields["amax_compute_algo"]) == (1, 16, "most_recent")
    assert fields["fp8_format"].format_name == "E4M3"
    assert decoded.extra["num_gemms"] == 1 and torch.equal(decoded.scales["scaling_fwd"][0], h)
    with format_pickled_by_name():  # enums written as getattr(Format, "HYBRID")
        by_name = pickled_state(te_state(h, s, torch.rand(16, 2), torch.rand(2) + 0.5))
    assert read_extra_state(by_name).recipe.fields["fp8_format"].format_name == "HYBRID"
    assert "Format.HYBRID" in repr(read_extra_state(by_name).recipe)


def test_tensors_saved_on_a_gpu_load_on_the_cpu(monkeypatch):
    """TE before 2.0 pickled the CUDA tensors themselves: their storages name a CUDA device."""
    source = trained(te.Linear(16, 32))
    sd = source.state_dict()
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    extra = te_layout(sd)["_extra_state"]
    monkeypatch.undo()
    data = extra.numpy().tobytes()
    assert b"cuda:0" in data
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):  # what plain pickle (TE's own reader) does here
            with fake_te_recipe_module():
                pickle.loads(data)
    fresh = te.Linear(16, 32)
    fresh.load_state_dict(te_layout(sd, extra_state=extra))
    assert torch.equal(fresh.fp8_meta["scaling_fwd"].scale, source.fp8_meta["scaling_fwd"].scale)
    assert fresh.fp8_meta["scaling_fwd"].scale.device.type == "cpu"


def test_te1_bytesio_layout_through_a_weights_only_file():
    """TE 0.12 - 1.13: `_extra_state` is an io.BytesIO of torch.save(state), with scale_inv_* and global buffers."""
    source = trained(te.Linear(16, 32))
    sd = source.state_dict()
    fwd, bwd = source.fp8_meta["scaling_fwd"], source.fp8_meta["scaling_bwd"]
    state = {"scale_fwd": fwd.scale, "scale_inv_fwd": 1 / fwd.scale, "amax_history_fwd": fwd.amax_history,
             "scale_bwd": bwd.scale, "scale_inv_bwd": 1 / bwd.scale, "amax_history_bwd": bwd.amax_history,
             "global_fp8_buffer": {"FWD_AMAX_1": [torch.zeros(3)]}, "global_fp8_state": {"FP8_AUTOCAST_COUNTER": 5},
             "extra_fp8_variables": {"num_gemms": 1, "autocast_id_fwd": 4, "first_module": True}}
    inner = io.BytesIO()
    torch.save(state, inner)
    file = io.BytesIO()
    torch.save(te_layout(sd, extra_state=inner), file)
    file.seek(0)
    with torch.serialization.safe_globals([io.BytesIO]):  # the file's own BytesIO, nothing else
        checkpoint = torch.load(file, weights_only=True)
    assert isinstance(checkpoint["_extra_state"], io.BytesIO)
    fresh = te.Linear(16, 32)
    assert not fresh.load_state_dict(checkpoint).unexpected_keys
    assert torch.equal(fresh.fp8_meta["scaling_bwd"].amax_history, bwd.amax_history)
    assert read_extra_state(checkpoint["_extra_state"]).recipe is None


@pytest.mark.parametrize("extra", [
    torch.empty(0, dtype=torch.uint8),  # TE 2.4 on, a module that never ran in FP8 (2.18 on: stateless recipes)
    "pickled None",  # TE 2.0 - 2.3 and 0.6 - 0.11, a module that never ran in FP8
    "current scaling",  # TE 2.0 - 2.17 under Float8CurrentScaling: a recipe, no scales
    None,
])
def test_te_checkpoints_without_delayed_state_load_parameters_only(extra):
    if extra == "pickled None":
        extra = pickled_state(None)
    elif extra == "current scaling":
        extra = pickled_state({"recipe": Float8CurrentScaling(), "extra_fp8_variables": {"num_gemms": 1}})
    plain = te.Linear(16, 32)
    sd = {"weight": plain.weight.detach().clone(), "bias": plain.bias.detach().clone(), "_extra_state": extra}
    fresh = te.Linear(16, 32)
    result = fresh.load_state_dict(sd)
    assert not result.unexpected_keys and not result.missing_keys
    assert fresh.fp8_meta["scaling_fwd"] is None and torch.equal(fresh.weight, plain.weight)


def test_fp8kit_keys_win_over_extra_state():
    a, b = trained(te.Linear(16, 32), seed=1), trained(te.Linear(16, 32), seed=2)
    sd = dict(a.state_dict(), _extra_state=te_layout(b.state_dict())["_extra_state"])
    fresh = te.Linear(16, 32)
    assert not fresh.load_state_dict(sd).unexpected_keys
    assert torch.equal(fresh.fp8_meta["scaling_fwd"].scale, a.fp8_meta["scaling_fwd"].scale)
    assert not torch.equal(fresh.fp8_meta["scaling_fwd"].scale, b.fp8_meta["scaling_fwd"].scale)


def test_nested_prefixes():
    src = torch.nn.Sequential(te.Linear(16, 32), torch.nn.ReLU(), te.LayerNormLinear(32, 16))
    trained(src)
    sd = src.state_dict()
    te_sd = {}
    for i in ("0", "2"):
        child = te_layout({k[2:]: v for k, v in sd.items() if k.startswith(f"{i}.")})
        te_sd.update({f"{i}.{k}": v for k, v in child.items()})
    assert "0._extra_state" in te_sd and "2.layer_norm_weight" in te_sd
    dst = torch.nn.Sequential(te.Linear(16, 32), torch.nn.ReLU(), te.LayerNormLinear(32, 16))
    dst.load_state_dict(te_sd, strict=True)
    assert torch.equal(dst[2].fp8_meta["scaling_bwd"].scale, src[2].fp8_meta["scaling_bwd"].scale)
    assert torch.equal(dst[0].fp8_meta["scaling_fwd"].amax_history, src[0].fp8_meta["scaling_fwd"].amax_history)


def test_te_norm_checkpoints_load_strictly():
    """TE's LayerNorm / RMSNorm (te.ops modules since TE 1.13) save `weight`, `bias` and an `_extra_state`."""
    model = torch.nn.Sequential(te.LayerNorm(16), te.Linear(16, 32), te.RMSNorm(32))
    with torch.no_grad():
        model[0].weight.uniform_()
        model[2].weight.uniform_()
    trained(model)
    sd = model.state_dict()
    te_sd = {k: v for k, v in sd.items() if not k.startswith("1.")}
    te_sd.update({f"1.{k}": v for k, v in te_layout({k[2:]: v for k, v in sd.items() if k.startswith("1.")}).items()})
    te_sd.update({"0._extra_state": torch.empty(0, dtype=torch.uint8),
                  "2._extra_state": torch.empty(0, dtype=torch.uint8)})
    assert sorted(te_sd) == ["0._extra_state", "0.bias", "0.weight", "1._extra_state", "1.bias", "1.weight",
                             "2._extra_state", "2.weight"]
    fresh = torch.nn.Sequential(te.LayerNorm(16), te.Linear(16, 32), te.RMSNorm(32))
    fresh.load_state_dict(te_sd, strict=True)
    assert torch.equal(fresh[0].weight, model[0].weight) and torch.equal(fresh[2].weight, model[2].weight)
    with pytest.raises(RuntimeError, match="Unexpected key.*0._extra_stat"):  # misspelt keys stay unexpected
        fresh.load_state_dict(dict(te_sd, **{"0._extra_stat": torch.empty(0)}), strict=True)


# ---- refusals --------------------------------------------------------------------------------------------------

class _Evil:
    def __reduce__(self):
        return os.system, ("echo pwned > fp8kit_pwned.txt",)


class _EvilStorage:
    """A tensor storage whose torch.save bytes call os.system (plain pickle would run it in torch.load)."""

    def __reduce__(self):
        return torch.storage._load_from_bytes, (pickle.dumps(_Evil()),)


def _saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf


def _bytes(obj):
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch.load on the smuggled storage bytes
@pytest.mark.parametrize("payload, named", [
    (lambda: _bytes({"scale_fwd": _Evil()}), f"{os.system.__module__}.system"),
    (lambda: _bytes(_Evil()), f"{os.system.__module__}.system"),
    (lambda: _bytes({"scale_fwd": _EvilStorage()}), f"{os.system.__module__}.system"),
    (lambda: _bytes({"recipe": DelayedScaling(amax_compute_algo=sorted)}), "builtins.sorted"),
    (lambda: _bytes({"recipe": _Evil}), "test_te_checkpoint._Evil"),
    (lambda: _saved({"scale_fwd": _Evil()}), f"{os.system.__module__}.system"),  # TE 1.x's io.BytesIO
])
def test_arbitrary_code_is_refused_naming_the_class(payload, named, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with fake_te_recipe_module():
        extra = payload()
    sd = dict(te.Linear(16, 32).state_dict(), _extra_state=extra)
    with pytest.raises(RuntimeError, match="_extra_state") as err:
        te.Linear(16, 32).load_state_dict(sd)
    assert named in str(err.value)
    assert not (tmp_path / "fp8kit_pwned.txt").exists()


def test_unreadable_or_mismatched_state_is_an_error_naming_the_key():
    source = trained(te.Linear(16, 32))
    sd = te_layout(source.state_dict())
    with pytest.raises(RuntimeError, match=r"_extra_state.*amax_history_fwd / scale_fwd: amax_history must have "
                                           r"shape \[L >= 1, 6\]"):
        _two_gemm_module().load_state_dict(sd, strict=False)
    old = dict(sd, _extra_state=pickled_state({"scale_fwd": torch.ones(2), "amax_history_fwd": torch.zeros(4, 2),
                                               "scale_bwd": torch.ones(1), "amax_history_bwd": torch.zeros(4, 1)}))
    with pytest.raises(RuntimeError, match="Transformer Engine 0.5 and older"):
        te.Linear(16, 32).load_state_dict(old)
    with pytest.raises(RuntimeError, match="up to 0.2"):
        te.Linear(16, 32).load_state_dict(dict(sd, _extra_state=[torch.ones(3)]))
    with pytest.raises(RuntimeError, match="holds scale_fwd but not amax_history_fwd"):
        te.Linear(16, 32).load_state_dict(dict(sd, _extra_state=pickled_state({"scale_fwd": torch.ones(3)})))
    with pytest.raises(RuntimeError, match="float32"):
        te.Linear(16, 32).load_state_dict(dict(sd, _extra_state=torch.zeros(4)))
    zero_scale = pickled_state(te_state(torch.zeros(4, 3), torch.zeros(3), torch.zeros(4, 2), torch.ones(2)))
    with pytest.raises(RuntimeError, match="scale_fwd: scale holds values that are not finite"):
        te.Linear(16, 32).load_state_dict(dict(sd, _extra_state=zero_scale))
    fresh = te.Linear(16, 32)
    with pytest.raises(RuntimeError):
        fresh.load_state_dict(dict(sd, _extra_state=torch.frombuffer(bytearray(b"\x80\x04garbage"),
                                                                      dtype=torch.uint8)))
    assert fresh.fp8_meta["scaling_fwd"] is None  # nothing of a refused state is loaded
    # a ValueError naming the key, raised before anything of the module (its weights included) loads
    held = trained(te.Linear(16, 32), seed=1)
    before = {k: v.clone() for k, v in held.state_dict().items()}
    with pytest.raises(ValueError, match=r"_extra_state \(Transformer Engine's FP8 state\): .*scale_fwd"):
        held.load_state_dict(dict(sd, _extra_state=zero_scale))
    assert all(torch.equal(v, before[k]) for k, v in held.state_dict().items())


def _two_gemm_module():
    """An fp8kit module with two GEMMs (6 forward slots)."""
    class TwoGemm(te.Linear):
        def __init__(self):
            super().__init__(16, 32)
            self._init_fp8_meta(num_gemms=2)
    return TwoGemm()
