"""A small causal Transformer language model (Flax nnx), the attention workload.

Pre-norm blocks of causal self-attention (``nnx.MultiHeadAttention``, whose
attention function the `Trainer` swaps for `tunedjax.attention`) and a GELU
MLP, learned position embeddings, tied input/output embeddings. The issue's
configuration is 4 layers, width 256, 8 heads, 2,048 tokens; tests use a tiny one.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from flax import nnx


class Block(nnx.Module):
  """LayerNorm, causal self-attention, residual; LayerNorm, MLP, residual."""

  def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs, dropout: float = 0.0):
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=width,
                                            dropout_rate=dropout, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attention(self.norm1(x), is_causal=True)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class TransformerLM(nnx.Module):
  """A causal Transformer language model: token ids ``[batch, tokens]`` to logits.

  Args:
    vocab: vocabulary size.
    tokens: the longest sequence (size of the position embedding).
    width: model width.
    layers: Transformer blocks.
    heads: attention heads (``width`` must be a multiple).
    dropout: attention dropout rate (0: none; while training, a call with
      dropout keeps Flax's attention function).
    seed: initialisation seed.

  Example:
    >>> import numpy as np
    >>> lm = TransformerLM(vocab=16, tokens=8, width=16, layers=1, heads=2)
    >>> lm(np.zeros((2, 8), np.int32)).shape
    (2, 8, 16)
  """

  def __init__(self, *, vocab: int = 256, tokens: int = 2048, width: int = 256,
               layers: int = 4, heads: int = 8, dropout: float = 0.0, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (tokens, width)))
    self.blocks = nnx.List([Block(width, heads, rngs=rngs, dropout=dropout)
                            for _ in range(layers)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    x = self.embed(ids) + self.position[...][:ids.shape[-1]]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x))


def lm_loss(model: TransformerLM, batch: dict[str, Any]) -> jax.Array:
  """Next-token cross-entropy: predict ``ids[:, 1:]`` from ``ids[:, :-1]``."""
  ids = batch["ids"]
  logits = model(ids[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def lm_data(batches: int, batch_size: int, tokens: int, *, vocab: int = 256,
            seed: int = 0) -> dict[str, np.ndarray]:
  """Learnable token streams: ``{"ids": [batches * batch_size, tokens + 1]}``.

  Each row counts upward by a per-row stride modulo `vocab`, from a random start,
  so the next token follows from the previous ones.

  Example:
    >>> lm_data(2, 3, 8, vocab=16)["ids"].shape
    (6, 9)
  """
  rng = np.random.default_rng(seed)
  rows = batches * batch_size
  start = rng.integers(0, vocab, size=(rows, 1))
  stride = rng.integers(1, 4, size=(rows, 1))
  ids = (start + stride * np.arange(tokens + 1)[None, :]) % vocab
  return {"ids": ids.astype(np.int32)}

