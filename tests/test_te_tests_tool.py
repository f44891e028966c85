"""tools/te_tests.py's rewrite rules (imports renamed, cuda -> cpu, nothing else) and its grouping of failures."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parents[1] / "tools" / "te_tests.py"
_SPEC = importlib.util.spec_from_file_location("te_tests_tool", _PATH)
tool = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tool)


@pytest.mark.parametrize("before,after", [
    ("import transformer_engine.pytorch as te", "import fp8kit.pytorch as te"),
    ("from transformer_engine.common import recipe", "from fp8kit import recipe"),
    ("transformer_engine.common.recipe.DelayedScaling(", "fp8kit.recipe.DelayedScaling("),
    ("from transformer_engine.pytorch.module.base import x", "from fp8kit.pytorch.modules.base import x"),
    ("import transformer_engine\n", "import fp8kit\n"),
    ("import transformer_engine_torch as tex", "import transformer_engine_torch as tex"),
    ('torch.randn(3, device="cuda")', 'torch.randn(3, device="cpu")'),
    ("x.to('cuda:1')", 'x.to("cpu")'),
    ("model.cuda()", "model.cpu()"),
    ("torch.cuda.synchronize()", "torch.cpu.synchronize()"),
    ("torch.cuda.manual_seed(1)", "torch.manual_seed(1)"),
    ("torch.cuda.get_rng_state()", "torch.get_rng_state()"),
    ("if torch.cuda.get_device_capability() >= (9, 0):", "if (0, 0) >= (9, 0):"),
    ("sm80 = get_device_compute_capability() >= (8, 0)", "sm80 = (0, 0) >= (8, 0)"),
    ("torch.cuda.CUDAGraph()", "torch.cuda.CUDAGraph()"),  # no CPU equivalent: left, reported as GPU-only
    ("cuda_graph = 'cudagraphs'", "cuda_graph = 'cudagraphs'"),  # only whole "cuda" strings
    ("assert x.is_cuda and x._data.is_cuda", "assert x.is_cpu and x._data.is_cpu"),
    ("x.is_cudagraph_safe", "x.is_cudagraph_safe"),  # whole word only
])
def test_rewrite_rules(before, after):
    assert tool.rewrite(before)[0] == after


def test_rewrite_counts_the_rules_that_fired():
    _, fired = tool.rewrite('import transformer_engine.pytorch as te\nx = y.cuda()\nz = "cuda"\n')
    assert fired["I4"] == 1 and fired["C2"] == 1 and fired["C1"] == 1 and fired["C3"] == 0


def test_cause_masks_numbers_but_not_names():
    a = tool.cause("AssertionError: max diff 0.125 at index 17 in fp8kit.pytorch")
    b = tool.cause("AssertionError: max diff 2.5e-07 at index 3 in fp8kit.pytorch")
    assert a == b == "AssertionError: max diff N at index N in fp8kit.pytorch"


@pytest.mark.parametrize("message,pattern,hit", [
    ("RuntimeError: Tried to instantiate dummy base class CUDAGraph", "GPU_ONLY_PATTERN", True),
    ("AssertionError: Tensor-likes are not close!", "GPU_ONLY_PATTERN", False),
    ("RuntimeError: 0 active drivers ([]). There should only be one.", "GPU_ONLY_PATTERN", True),  # Triton
    ("RuntimeError: 2 active drivers", "GPU_ONLY_PATTERN", False),
    ("quantized_model_init: FP8 weights under MXFP8BlockScaling are not implemented", "BLOCK_REFUSAL_PATTERN", True),
    ("NVFP4BlockScaling(row_scaled_activation=True): row-scaled NVFP4", "BLOCK_REFUSAL_PATTERN", True),
    ("make_graphed_callables: cache_quantized_params=True under DelayedScaling", "BLOCK_REFUSAL_PATTERN", False),
])
def test_out_of_scope_patterns(message, pattern, hit):
    import re

    assert bool(re.search(getattr(tool, pattern), message)) is hit


def test_te_ops_is_out_of_scope():
    assert "fp8kit.pytorch.ops" in tool.INTERNAL_MODULES


def _fake_te(root):
    """A minimal TE tree: a block test in a subfolder importing a helper beside it, and a top-level test file."""
    tests = root / "tests" / "pytorch"
    (tests / "nvfp4").mkdir(parents=True)
    (tests / "nvfp4" / "nvfp4_utils.py").write_text("import transformer_engine.pytorch as te\n")
    (tests / "nvfp4" / "unused_helper.py").write_text("x = 1\n")
    (tests / "nvfp4" / "test_q.py").write_text("from nvfp4_utils import te\nx = 'cuda'\n")
    (tests / "test_a.py").write_text("import transformer_engine.pytorch as te\n")
    return root


@pytest.mark.parametrize("block", [False, True])
def test_prepare_puts_block_recipes_in_scope_only_with_block(tmp_path, block):
    import json

    te_root, work = _fake_te(tmp_path / "te"), tmp_path / "work"
    work.mkdir()
    fired = tool.prepare(te_root, ["nvfp4/test_q.py", "test_a.py"], work, block=block)
    config = json.loads((work / "te_harness.json").read_text())
    assert config["block_in_scope"] is block
    # the subfolder file keeps its folder, comes with the helper it imports (rewritten), not with the unused one
    assert (work / "nvfp4" / "test_q.py").read_text() == 'from nvfp4_utils import te\nx = "cpu"\n'
    assert (work / "nvfp4" / "nvfp4_utils.py").read_text() == "import fp8kit.pytorch as te\n"
    assert not (work / "nvfp4" / "unused_helper.py").exists()
    assert fired["nvfp4/test_q.py"]["C1"] == 1


def test_block_option_defaults_off():
    parser_args = []

    def fake_prepare(te_root, files, work, block=False):
        parser_args.append(block)
        raise SystemExit(0)

    original = tool.prepare
    tool.prepare = fake_prepare
    try:
        for argv, expected in ([], False), (["--block"], True):
            with pytest.raises(SystemExit):
                tool.main(["--out", "/nonexistent-te-tests-out", "--files", "x.py", *argv])
            assert parser_args[-1] is expected
    finally:
        tool.prepare = original


def test_sibling_imports_follow_plain_imports_transitively(tmp_path):
    (tmp_path / "a.py").write_text("import b\nfrom os import path\n")
    (tmp_path / "b.py").write_text("from c import x\n")
    (tmp_path / "c.py").write_text("x = 1\n")
    (tmp_path / "d.py").write_text("")
    assert sorted(p.name for p in tool.sibling_imports(tmp_path / "a.py")) == ["b.py", "c.py"]


def test_a_timeout_wrapped_by_a_library_is_a_timeout(tmp_path):
    # torch.compile reraises the per-case alarm that fires while it compiles as its own error (BackendCompilerFailed
    # with the CaseTimeout as cause, InternalTorchDynamoError with its text): still a timeout, not a failure
    te_root, work = _fake_te(tmp_path / "te"), tmp_path / "work"
    work.mkdir()
    tool.prepare(te_root, ["test_a.py"], work)
    spec = importlib.util.spec_from_file_location("te_plugin_copy", work / "conftest.py")
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    alarm = plugin.CaseTimeout("case exceeded the per-case timeout")
    try:
        raise RuntimeError("backend='aot_eager' raised:") from alarm
    except RuntimeError as err:
        chained = err
    assert plugin._is_timeout(alarm) and plugin._is_timeout(chained)
    assert plugin._is_timeout(RuntimeError("CaseTimeout: case exceeded the per-case timeout"))
    assert not plugin._is_timeout(RuntimeError("backend='aot_eager' raised: ValueError"))
    assert not plugin._is_timeout(AssertionError("assert 1 == 2"))
