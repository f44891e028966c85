"""`fp8kit demo` at a tiny size: what it writes, same init and data order across recipes, FP8 close to bf16,
the delayed-scaling trace against the SPEC's scale rule, interruption, the corpus."""

import json
import math
import os

import numpy as np
import pytest
import torch

import fp8kit.demo.run as demo_run
from fp8kit.cli import main
from fp8kit.demo import GPT, GPTConfig, TrainConfig, load_corpus, plots, run_demo
from fp8kit.demo.data import Batches, decode, default_sources, encode
from fp8kit.demo.train import precision

TINY = GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_chars=40_000)


def tiny_config(**overrides):
    kw = dict(model=TINY, steps=8, batch_size=4, lr=3e-3, warmup=2, eval_interval=4, eval_batches=2, seed=0)
    kw.update(overrides)
    return TrainConfig(**kw)


@pytest.fixture(scope="module")
def demo(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("demo")
    results = run_demo(tiny_config(), ["bf16", "current", "delayed"], str(out), corpus=corpus, progress=False,
                       stream=open(os.devnull, "w"))
    return out, results


def test_results_json(demo):
    out, results = demo
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["complete"] is True
    assert [r["recipe"] for r in on_disk["runs"]] == ["bf16", "current", "delayed"]
    for run in on_disk["runs"]:
        for key in ("final_train_loss", "final_val_loss", "tokens_per_s"):
            assert math.isfinite(run[key]) and run[key] > 0
        assert len(run["curves"]["train_loss"]) == 8
        assert run["curves"]["val_step"] == [4, 8]
        # Untrained, a 128-symbol model is at ln(128) = 4.85; eight steps must already do better.
        assert run["final_val_loss"] < run["curves"]["train_loss"][0] < math.log(128) + 0.1
    assert on_disk["runs"][0]["stats"] == []
    assert {r["role"] for r in on_disk["runs"][1]["stats"]} == {"input", "weight", "grad_output"}
    assert (out / "stats_current.csv").exists() and (out / "stats_delayed.csv").exists()


def test_figures(demo):
    out, _ = demo
    pytest.importorskip("matplotlib")
    for name in ("loss.png", "delayed_scaling.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_difference_from_bf16(demo):
    """The third panel: each FP8 run's smoothed training loss relative to bf16's (computed here independently
    with NumPy), validation points, and the final validation difference of the results table in the legend."""
    _, results = demo
    runs = results["runs"]
    diffs = plots.bf16_differences(runs)
    assert [d["recipe"] for d in diffs] == ["current", "delayed"]

    def ema(values, beta=0.9):
        avg, out = 0.0, []
        for i, v in enumerate(values):
            avg = beta * avg + (1 - beta) * v
            out.append(avg / (1 - beta ** (i + 1)))
        return np.array(out)

    base = ema(runs[0]["curves"]["train_loss"])
    table = demo_run.results_table(runs).splitlines()
    for d, run in zip(diffs, runs[1:]):
        assert d["step"] == run["curves"]["step"]
        np.testing.assert_allclose(d["train_pct"], 100 * (ema(run["curves"]["train_loss"]) / base - 1), rtol=1e-12)
        assert d["val_step"] == [4, 8] and d["val_pct"][-1] == pytest.approx(d["final_pct"])
        row = next(line for line in table if line.startswith(run["recipe"]))
        assert f"{d['final_pct']:+.2f}%" == row.split()[3]  # the "vs bf16" column
    assert plots.bf16_differences(runs[1:]) == []  # no bf16 run, no panel
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = plots.loss_figure(runs)
    try:
        assert len(fig.axes) == 3
        labels = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
        assert labels == ["bf16"] + [f"{d['recipe']} train (final val {d['final_pct']:+.2f}%)" for d in diffs]
    finally:
        plt.close(fig)
    fig = plots.loss_figure(runs[1:])
    assert len(fig.axes) == 2
    plt.close(fig)


def test_same_init_and_data_order(demo, corpus):
    """The first training loss of each run is the loss of the seed's initial weights on the seed's first batch,
    computed here independently; FP8 changes it only by its rounding."""
    _, results = demo
    torch.manual_seed(0)
    model = GPT(TINY)
    x, y = Batches(corpus.train, 4, TINY.block_size, seed=0).get(0)
    with torch.no_grad(), precision("cpu", None):
        _, loss = model(x, y)
    first = [r["curves"]["train_loss"][0] for r in results["runs"]]
    assert first[0] == loss.item()
    assert first[1] == pytest.approx(first[0], rel=2e-3) and first[2] == pytest.approx(first[0], rel=2e-3)
    assert first[1] != first[0]  # the FP8 runs really ran in FP8


def test_fp8_tracks_bf16(demo):
    _, results = demo
    base = results["runs"][0]["final_val_loss"]
    for run in results["runs"][1:]:
        assert run["final_val_loss"] == pytest.approx(base, rel=0.03)


def test_delayed_trace_follows_the_scale_rule(demo):
    """Scale after step k = 448 / max(amax of steps k-L+1..k) (E4M3, margin 0, history L = 16), float32."""
    _, results = demo
    trace = results["runs"][2]["delayed_trace"]
    assert trace["module"] == "blocks.0.mlp.fc" and trace["history_len"] == 16
    for role, fp8_max in (("input", 448.0), ("weight", 448.0), ("grad_output", 57344.0)):
        amaxes = np.array(trace[f"amax_{role}"], dtype=np.float32)
        assert np.all(amaxes > 0)
        for k, scale in enumerate(trace[f"scale_{role}"]):
            window = amaxes[max(0, k - 15): k + 1]
            assert scale == np.float32(fp8_max) / window.max(), (role, k)


def test_block_recipes_and_the_nvfp4_ablations(corpus, tmp_path):
    """The block-scaled runs train close to bf16, record statistics in their element format, get a "vs bf16"
    column and show in the figure's difference panel; each NVFP4 ablation really changes the numbers."""
    names = ["bf16", "mxfp8", "block", "nvfp4", "nvfp4-nosr", "nvfp4-norht", "nvfp4-no2d"]
    results = run_demo(tiny_config(steps=4, eval_interval=2), names, str(tmp_path), corpus=corpus, progress=False,
                       stream=open(os.devnull, "w"))
    runs = {r["recipe"]: r for r in results["runs"]}
    assert list(runs) == names
    base = runs["bf16"]["final_val_loss"]
    formats = {"mxfp8": "e4m3", "block": "e4m3"}
    for name in names[1:]:
        assert runs[name]["final_val_loss"] == pytest.approx(base, rel=0.03)
        rows = runs[name]["stats"]
        assert {r["role"] for r in rows} == {"input", "weight", "grad_output"}
        assert {r["fp8_dtype"] for r in rows} == {formats.get(name, "e2m1")}
        assert (tmp_path / f"stats_{name}.csv").exists()
    losses = {name: tuple(runs[name]["curves"]["train_loss"]) for name in names}
    nvfp4s = [n for n in names if n.startswith("nvfp4")]
    assert len({losses[n] for n in nvfp4s}) == len(nvfp4s)  # each ablation changes the numbers
    assert all(losses[n] != losses["bf16"] for n in names[1:])
    # (mxfp8 and block may agree bit for bit here: both scales are powers of 2, which change no rounding unless a
    # value falls to the subnormals or saturates; docs/demo.md)
    table = demo_run.results_table(results["runs"]).splitlines()
    for name in names[1:]:
        row = next(line for line in table if line.split()[0] == name)
        assert row.split()[3] == f"{runs[name]['final_val_loss'] / base - 1:+.2%}"
    assert [d["recipe"] for d in plots.bf16_differences(results["runs"])] == names[1:]


def test_same_seed_same_run_other_seed_other_run(corpus, tmp_path):
    runs = [run_demo(tiny_config(steps=3, eval_interval=3, seed=s), ["bf16"], str(tmp_path / str(i)),
                     corpus=corpus, progress=False, stream=open(os.devnull, "w"))["runs"][0]
            for i, s in enumerate((0, 0, 1))]
    assert runs[0]["curves"]["train_loss"] == runs[1]["curves"]["train_loss"]
    assert runs[0]["curves"]["train_loss"] != runs[2]["curves"]["train_loss"]


def test_interrupt_keeps_finished_runs(corpus, tmp_path, monkeypatch):
    real = demo_run.train_one

    def train_one(name, *args, **kwargs):
        if name == "current":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(demo_run, "train_one", train_one)
    with pytest.raises(KeyboardInterrupt):
        run_demo(tiny_config(steps=2, eval_interval=2), ["bf16", "current", "delayed"], str(tmp_path), corpus=corpus,
                 progress=False, stream=open(os.devnull, "w"))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["complete"] is False and [r["recipe"] for r in saved["runs"]] == ["bf16"]


def test_cli_demo_end_to_end(tmp_path, capsys, monkeypatch):
    code = main(["demo", "--steps", "2", "--eval-interval", "1", "--recipes", "delayed,bf16", "--n-layer", "1",
                 "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--batch-size", "2", "--max-chars", "5000",
                 "--out", str(tmp_path), "--no-progress", "--no-stats"])
    assert code == 0
    out = capsys.readouterr().out
    assert "recipe" in out and "tokens/s" in out and "vs bf16" in out
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["recipe"] for r in runs] == ["delayed", "bf16"] and runs[0]["stats"] == []
    # Ctrl-C during a run: status 130 and a message; the finished runs stay on disk.
    monkeypatch.setattr(demo_run, "train_one", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["demo", "--steps", "1", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8",
                 "--batch-size", "2", "--max-chars", "5000", "--out", str(tmp_path / "x"), "--no-progress"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_without_matplotlib_the_figures_are_skipped(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "_pyplot", lambda: None)
    messages = []
    stream = type("S", (), {"write": lambda self, s: messages.append(s), "flush": lambda self: None})()
    run_demo(tiny_config(steps=1, eval_interval=1), ["delayed"], str(tmp_path), corpus=corpus, progress=False,
             stream=stream)
    assert "matplotlib is not installed" in "".join(messages)
    assert not (tmp_path / "loss.png").exists() and (tmp_path / "results.json").exists()


def test_corpus_is_the_sorted_standard_library(corpus):
    directory, files = default_sources()
    assert directory == os.path.dirname(os.__file__)
    assert files == sorted(files) and all(f.endswith(".py") for f in files)
    with open(files[0], encoding="utf-8", errors="replace") as f:
        head = f.read(1000)
    assert decode(corpus.train[:1000]) == head.encode("ascii", "replace").decode("ascii")
    assert corpus.chars == 40_000 and corpus.train.numel() + corpus.val.numel() == 40_000
    assert load_corpus(max_chars=40_000).sha256 == corpus.sha256
    assert int(corpus.train.max()) < 128


def test_corpus_fallback_is_fp8kits_own_source(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "__file__", str(tmp_path / "os.py"))  # a Python without library sources
    directory, files = default_sources()
    assert directory.endswith("fp8kit") and any(f.endswith(os.path.join("fp8kit", "recipe", "base.py")) for f in files)
    assert load_corpus(max_chars=10_000).chars == 10_000


def test_batches_are_shifted_windows_fixed_by_step(corpus):
    b = Batches(corpus.train, 3, 10, seed=5)
    x, y = b.get(4)
    assert x.shape == y.shape == (3, 10)
    assert torch.equal(x[:, 1:], y[:, :-1])
    b.get(0)
    assert torch.equal(b.get(4)[0], x)  # independent of what was drawn before
    assert decode(encode("h\u00e9llo")) == "h?llo"


def test_progress_off_a_terminal_prints_plain_quarter_lines():
    import io

    from fp8kit.demo.progress import Progress

    stream = io.StringIO()
    bar = Progress(20, "delayed", stream=stream)
    for i in range(1, 21):
        bar.update(i, f"loss {i}")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["5/20", "10/20", "15/20", "20/20"]
    assert lines[-1].startswith("delayed  20/20 (100%)  loss 20  0:0") and lines[-1].endswith(" elapsed")
    assert not any("#" in line or "left" in line or "\r" in line for line in lines)  # no bar, no estimate
    quiet = io.StringIO()
    Progress(5, "x", stream=quiet, enabled=False).update(5)
    assert quiet.getvalue() == ""


def test_progress_off_a_terminal_prints_once_a_minute_on_long_runs(monkeypatch):
    import io

    from fp8kit.demo import progress

    clock = iter([0.0, 30.0, 61.0, 62.0, 130.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    bar = progress.Progress(1000, "bf16", stream=stream)
    for done in (1, 2, 3, 4):  # at 30 s, 61 s, 62 s, 130 s: none is a quarter
        bar.update(done)
    assert [line.split()[1] for line in stream.getvalue().splitlines()] == ["2/1000", "4/1000"]
    assert stream.getvalue().splitlines()[-1].endswith("2:10 elapsed")


def test_progress_on_a_terminal_redraws_one_line(monkeypatch):
    import io

    from fp8kit.demo import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    clock = iter([0.0, 10.0, 20.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    stream = Terminal()
    bar = progress.Progress(4, "current", stream=stream, width=4)
    bar.update(1, "loss 3.000")
    bar.update(4, "loss 2.000")
    bar.close()
    assert stream.getvalue() == ("\rcurrent  [#...] 1/4  loss 3.000  0:10, ~0:30 left\x1b[K"
                                 "\rcurrent  [####] 4/4  loss 2.000  0:20\x1b[K\n")
