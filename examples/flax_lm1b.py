"""flax's lm1b language model (examples/lm1b/models.py in the flax repository: a decoder-only transformer) trained in
high precision and in FP8, where the only change is the `nn` namespace the model is built from: `fp8_linen()` is
flax.linen with `Dense` and `DenseGeneral` replaced by fp8kit's (`te_flax.Dense` is DenseGeneral under flax's name,
so parameter paths stay "Dense_0", ...) and the attention projections of `MultiHeadDotProductAttention` given
fp8kit's FP8 dot_general (`make_dot_general_cls`).

The train step is lm1b's (`jax.value_and_grad(loss_fn, has_aux=True)(state.params)` and `state.apply_gradients`),
with the TrainState holding the whole variables dict and the optimizer wrapped by `te.wrap_optimizer`, so that the
FP8 state is updated and never reaches AdamW. (flax's own `TrainState.apply_gradients` special-cases the
"_overwrite_with_gradient" collection of the FP8 dot_general and then drops "fp8_metas", so the TrainState below
hands the whole dict to the optimizer.) The data are synthetic (no download): sequences of a random order-2
Markov chain over 31 tokens whose entropy rate (the best achievable loss) is printed.

    python examples/flax_lm1b.py --steps 400 --seed 0
"""

import argparse
import functools
import math
import time
import types
from typing import Any, Callable, Optional

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state

import fp8kit.jax as te
import fp8kit.jax.flax as te_flax
from fp8kit.recipe import DelayedScaling, Format


@struct.dataclass
class TransformerConfig:
    """lm1b's hyperparameters (smaller defaults for a CPU)."""

    vocab_size: int = 32
    emb_dim: int = 128
    num_heads: int = 4
    num_layers: int = 2
    qkv_dim: int = 128
    mlp_dim: int = 256
    max_len: int = 128
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    dtype: Any = jnp.float32
    kernel_init: Callable = flax.linen.initializers.xavier_uniform()
    bias_init: Callable = flax.linen.initializers.normal(stddev=1e-6)


def sinusoidal_table(max_len: int, features: int) -> jnp.ndarray:
    """lm1b's fixed position embedding: sines in the first half of the features, cosines in the second."""
    position = np.arange(max_len)[:, None]
    rate = np.exp(np.arange(features // 2) * -(np.log(10000.0) / (features // 2 - 1)))
    table = np.zeros((max_len, features), np.float32)
    table[:, : features // 2] = np.sin(position * rate)
    table[:, features // 2: 2 * (features // 2)] = np.cos(position * rate)
    return jnp.asarray(table[None])


def build_lm(nn) -> type:
    """lm1b's TransformerLM written against the namespace `nn` (flax.linen, or `fp8_linen()`)."""

    def partitioned(init, names):
        return nn.with_logical_partitioning(init, names)

    class MlpBlock(nn.Module):
        config: TransformerConfig

        @nn.compact
        def __call__(self, inputs):
            cfg = self.config
            x = nn.Dense(cfg.mlp_dim, dtype=cfg.dtype, kernel_init=partitioned(cfg.kernel_init, ("embed", "mlp")),
                         bias_init=partitioned(cfg.bias_init, ("mlp",)))(inputs)
            x = nn.Dropout(rate=cfg.dropout_rate)(nn.relu(x), deterministic=cfg.deterministic)
            out = nn.Dense(inputs.shape[-1], dtype=cfg.dtype,
                           kernel_init=partitioned(cfg.kernel_init, ("mlp", "embed")),
                           bias_init=partitioned(cfg.bias_init, ("embed",)))(x)
            return nn.Dropout(rate=cfg.dropout_rate)(out, deterministic=cfg.deterministic)

    class DecoderBlock(nn.Module):
        config: TransformerConfig

        @nn.compact
        def __call__(self, inputs, mask):
            cfg = self.config
            x = nn.LayerNorm(dtype=cfg.dtype)(inputs)
            x = nn.MultiHeadDotProductAttention(
                num_heads=cfg.num_heads, dtype=cfg.dtype, qkv_features=cfg.qkv_dim,
                kernel_init=partitioned(cfg.kernel_init, ("embed", "kv")), use_bias=False, broadcast_dropout=False,
                dropout_rate=cfg.attention_dropout_rate, deterministic=cfg.deterministic)(x, mask=mask)
            x = inputs + nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
            return x + MlpBlock(cfg)(nn.LayerNorm(dtype=cfg.dtype)(x))

    class TransformerLM(nn.Module):
        config: TransformerConfig

        @nn.compact
        def __call__(self, inputs):
            cfg = self.config
            mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0, dtype=cfg.dtype),
                                    nn.make_causal_mask(inputs, dtype=cfg.dtype))
            shifted = jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1]
            y = nn.Embed(cfg.vocab_size, cfg.emb_dim,
                         embedding_init=partitioned(nn.initializers.normal(1.0), ("vocab", "embed")))(shifted)
            y = y + sinusoidal_table(cfg.max_len, cfg.emb_dim)[:, : inputs.shape[1]]
            y = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=cfg.deterministic).astype(cfg.dtype)
            for i in range(cfg.num_layers):
                y = DecoderBlock(cfg, name=f"encoderdecoderblock_{i}")(y, mask)
            y = nn.LayerNorm(dtype=cfg.dtype, name="encoderdecoder_norm")(y)
            return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, kernel_init=partitioned(cfg.kernel_init,
                                                                                      ("embed", "vocab")),
                            bias_init=partitioned(cfg.bias_init, ("vocab",)), name="logitdense")(y)

    return TransformerLM


def fp8_linen(recipe: Optional[DelayedScaling] = None) -> types.SimpleNamespace:
    """flax.linen with fp8kit's FP8 dense layers: Dense and DenseGeneral are fp8kit's (FP8 inside an enabled
    te.autocast), MultiHeadDotProductAttention projects q, k, v and the output with fp8kit's FP8
    dot_general under `recipe`."""
    namespace = types.SimpleNamespace(**{k: getattr(flax.linen, k) for k in dir(flax.linen) if not k.startswith("_")})
    namespace.Dense, namespace.DenseGeneral = te_flax.Dense, te_flax.DenseGeneral
    dot_general = te_flax.make_dot_general_cls(recipe or DelayedScaling())
    namespace.MultiHeadDotProductAttention = functools.partial(
        flax.linen.MultiHeadDotProductAttention, qkv_dot_general_cls=dot_general, out_dot_general_cls=dot_general)
    return namespace


class TrainState(train_state.TrainState):
    """flax's TrainState whose `create` and `apply_gradients` give the whole variables dict to the (wrapped)
    optimizer."""

    @classmethod
    def create(cls, *, apply_fn, params, tx, **kwargs):
        return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=tx.init(params), **kwargs)

    def apply_gradients(self, *, grads, **kwargs):
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates),
                            opt_state=opt_state, **kwargs)


def markov_data(seed: int, batches: int, batch: int, length: int, vocab: int = 32):
    """Token batches [batch, length] of an order-2 Markov chain over tokens 1..vocab-1 (0 is padding) where each
    pair of previous tokens has three successors with probabilities 0.6, 0.3, 0.1; also returns the entropy rate
    in nats (the loss a perfect model reaches)."""
    rng = np.random.default_rng(1234)  # the language is fixed; `seed` picks the sequences
    successors = rng.integers(1, vocab, size=(vocab, vocab, 3))
    probs = np.array([0.6, 0.3, 0.1])
    draw = np.random.default_rng(seed)
    out = np.zeros((batches, batch, length), np.int32)
    out[..., :2] = draw.integers(1, vocab, size=(batches, batch, 2))
    choices = draw.choice(3, size=(batches, batch, length), p=probs)
    for t in range(2, length):
        out[..., t] = successors[out[..., t - 2], out[..., t - 1], choices[..., t]]
    return out, float(-(probs * np.log(probs)).sum())


def cross_entropy(logits, targets):
    """Mean cross-entropy over non-padding tokens (lm1b's weights: targets > 0)."""
    weights = (targets > 0).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    loss = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(loss * weights) / jnp.sum(weights)


def train(nn, steps: int, fp8: bool, recipe: Optional[DelayedScaling] = None, config: TransformerConfig = None,
          batch: int = 16, length: int = 64, seed: int = 0, log_every: int = 0):
    """Train lm1b's model built from `nn` with AdamW; returns (train losses, eval loss, entropy rate, variables)."""
    config = config or TransformerConfig()
    recipe = recipe or DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
    model, eval_model = build_lm(nn)(config), build_lm(nn)(config.replace(deterministic=True))
    data, entropy = markov_data(seed, steps, batch, length, config.vocab_size)
    held_out, _ = markov_data(seed + 1, 4, batch, length, config.vocab_size)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(steps // 10, 1), max(steps, 2))
    with te.autocast(enabled=fp8, recipe=recipe):
        variables = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.asarray(data[0]))
        state = TrainState.create(apply_fn=model.apply, params=variables,
                                              tx=te.wrap_optimizer(optax.adamw(schedule, weight_decay=0.01)))

        @jax.jit
        def train_step(state, inputs, dropout_rng):
            def loss_fn(params):  # lm1b's, with the whole variables dict as the TrainState's params
                logits = state.apply_fn(params, inputs, rngs={"dropout": dropout_rng})
                return cross_entropy(logits, inputs), logits

            (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            return state.apply_gradients(grads=grads), loss

        eval_loss_fn = jax.jit(lambda params, inputs: cross_entropy(eval_model.apply(params, inputs), inputs))
        losses, start = [], time.perf_counter()
        for step in range(steps):
            state, loss = train_step(state, jnp.asarray(data[step]), jax.random.PRNGKey(step))
            losses.append(float(loss))
            if log_every and (step + 1) % log_every == 0:
                print(f"  {'fp8' if fp8 else 'high precision'} step {step + 1}: train loss {losses[-1]:.4f} "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)
        eval_loss = float(np.mean([eval_loss_fn(state.params, jnp.asarray(b)) for b in held_out]))
    return losses, eval_loss, entropy, state.params


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0, help="picks the training sequences (the language is fixed)")
    args = parser.parse_args()
    results = {}
    for name, nn, fp8 in (("high precision", flax.linen, False), ("fp8 (delayed scaling)", fp8_linen(), True)):
        print(f"{name}:", flush=True)
        losses, eval_loss, entropy, _ = train(nn, args.steps, fp8, seed=args.seed, log_every=max(args.steps // 5, 1))
        tail = float(np.mean(losses[-max(args.steps // 10, 1):]))
        results[name] = (tail, eval_loss)
        print(f"  final train loss (mean of the last 10%) {tail:.4f}, eval loss {eval_loss:.4f}")
    hp, f8 = results["high precision"], results["fp8 (delayed scaling)"]
    print(f"entropy rate of the data (best possible loss): {entropy:.4f}")
    print(f"eval loss: high precision {hp[1]:.4f}, fp8 {f8[1]:.4f}, difference {f8[1] - hp[1]:+.4f} "
          f"({100 * (f8[1] - hp[1]) / hp[1]:+.2f}%)")
    assert math.isfinite(f8[1])


if __name__ == "__main__":
    main()
