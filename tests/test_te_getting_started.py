"""Transformer Engine's "Getting Started" PyTorch guide, ported as examples/te_getting_started.py: it runs end to end
(every benchmark, the summary CSV), and the layers it builds compute what their plain-PyTorch counterparts compute."""

import contextlib
import io
import os
import pathlib
import sys

import pytest
import torch

import fp8kit.pytorch as te

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"
SCRIPT = EXAMPLES / "te_getting_started.py"
LABELS = ["Baseline PyTorch", "TE Unfused", "TE Unfused + TE Attention", "TE Unfused + TE Attention + FP8",
          "TE Fused + TE Attention + FP8", "TE TransformerLayer + FP8"]

pytestmark = pytest.mark.skipif(not hasattr(te, "LayerNormMLP"), reason="the guide's fused layer needs te.LayerNormMLP")


@pytest.fixture(scope="module")
def guide(tmp_path_factory):
    """Run the guide once in this process (one thread; its CSV goes to a temporary directory); returns its
    namespace and printed output."""
    out_dir = tmp_path_factory.mktemp("getting_started")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))
    ns, printed, cwd = {"__name__": "te_getting_started"}, io.StringIO(), os.getcwd()
    try:
        os.chdir(out_dir)
        with contextlib.redirect_stdout(printed):
            exec(compile(SCRIPT.read_text(), str(SCRIPT), "exec"), ns)
    finally:
        os.chdir(cwd)
        sys.path.remove(str(EXAMPLES))
        torch.set_num_threads(threads)
    return ns, printed.getvalue(), out_dir


def test_runs_every_benchmark_and_writes_the_summary(guide):
    ns, printed, out_dir = guide
    assert printed.count("Mean time:") == 6
    rows = (out_dir / "getting_started_pytorch_summary.csv").read_text().splitlines()
    assert rows[0] == "Implementation,Time (ms),Speedup"
    assert [r.split(",")[0] for r in rows[1:]] == LABELS
    assert all(float(r.split(",")[1]) > 0 for r in rows[1:])
    layer = ns["te_transformer_layer"]  # trained under FP8 by the benchmark: its delayed-scaling state moved
    assert float(layer.self_attention.layernorm_qkv.fp8_meta["scaling_fwd"].scale[0]) != 1.0


def _share(dst, src):
    dst.load_state_dict({k: v for k, v in src.state_dict().items() if "fp8_meta" not in k}, strict=False)


def test_the_guides_layers_agree(guide):
    ns = guide[0]
    torch.manual_seed(0)
    args = (64, 256, 4)
    x = torch.randn(32, 2, 64)
    causal = torch.triu(torch.ones(32, 32, dtype=torch.bool), 1)  # the utils' attention takes True = masked
    base = ns["PyTorchTransformerLayer"](*args).eval()
    unfused = ns["TEUnfusedTransformerLayer"](*args).eval()
    unfused.load_state_dict(base.state_dict())
    assert torch.equal(unfused(x), base(x))  # te.Linear / te.LayerNorm outside autocast: torch's numbers exactly
    attn = ns["TEUnfusedAttnTransformerLayer"](*args).eval()
    attn.load_state_dict(base.state_dict())
    torch.testing.assert_close(attn(x), base(x, attention_mask=causal), rtol=1e-5, atol=1e-5)
    fused = ns["TEFusedTransformerLayer"](*args).eval()
    p = base.state_dict()
    fused.load_state_dict({
        "ln_qkv.layer_norm_weight": p["ln1.weight"], "ln_qkv.layer_norm_bias": p["ln1.bias"],
        "ln_qkv.weight": p["qkv_projection.weight"], "ln_qkv.bias": p["qkv_projection.bias"],
        "projection.weight": p["projection.weight"], "projection.bias": p["projection.bias"],
        "ln_mlp.layer_norm_weight": p["ln2.weight"], "ln_mlp.layer_norm_bias": p["ln2.bias"],
        "ln_mlp.fc1_weight": p["mlp.linear1.weight"], "ln_mlp.fc1_bias": p["mlp.linear1.bias"],
        "ln_mlp.fc2_weight": p["mlp.linear2.weight"], "ln_mlp.fc2_bias": p["mlp.linear2.bias"]})
    want = attn(x)
    torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-5)
    # te.TransformerLayer as the guide builds it, with the same weights: the QKV rows of the fused projection
    # (laid out [s, b, heads, (q k v) per head] by the guide's view/split) become TE's query/key/value weights
    layer = te.TransformerLayer(*args, self_attn_mask_type="causal", layernorm_epsilon=1e-5, bias=True,
                                hidden_dropout=0.0, attention_dropout=0.0).eval()
    w, b = p["qkv_projection.weight"].view(4, 3, 16, 64), p["qkv_projection.bias"].view(4, 3, 16)
    qkv = {n: (w[:, i].reshape(64, 64), b[:, i].reshape(64)) for i, n in enumerate(("query", "key", "value"))}
    layer.load_state_dict({
        "self_attention.layernorm_qkv.layer_norm_weight": p["ln1.weight"],
        "self_attention.layernorm_qkv.layer_norm_bias": p["ln1.bias"],
        **{f"self_attention.layernorm_qkv.{n}_weight": qkv[n][0] for n in qkv},
        **{f"self_attention.layernorm_qkv.{n}_bias": qkv[n][1] for n in qkv},
        "self_attention.proj.weight": p["projection.weight"], "self_attention.proj.bias": p["projection.bias"],
        **{k.replace("ln_mlp.", "layernorm_mlp."): v for k, v in fused.state_dict().items() if "ln_mlp." in k}})
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    with te.autocast(recipe=ns["recipe"]):
        fp8 = layer(x)
    error = ((fp8 - want).norm() / want.norm()).item()
    assert 0 < error < 0.05  # FP8 projections: close to the high-precision layer, not equal
