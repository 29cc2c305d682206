"""The parts, workers, budgets and variant names of `benchmarks/gpu.py` (no JAX here:
the driver reads them before any worker starts a backend)."""

from __future__ import annotations

# (a) ResNet-50
JIT_F32 = "jax.jit, float32"
JIT_BF16 = "jax.jit, dtype=bfloat16"
TJ_ALL = "tj.jit, set_config(None)"
TJ_ALL_MP = "tj.jit, set_config(None) + mixed precision"
TJ_MP_LAYOUT = "tj.jit, mixed precision + layout, kernel selection off"
TORCH_F32 = "PyTorch, float32, channels_last"
TORCH_AMP = "PyTorch AMP bfloat16, channels_last"
RESNET_ORDER = (JIT_F32, JIT_BF16, TJ_ALL, TJ_ALL_MP, TJ_MP_LAYOUT, TORCH_F32, TORCH_AMP)

# (b) attention
HAND = "jax.jit, hand-written (einsum, jnp.tril mask, softmax)"
CUDNN = 'jax.nn.dot_product_attention(implementation="cudnn")'
TJ_ATTENTION = "tj.jit over tj.attention(is_causal=True)"
TJ_HAND = "tj.jit over the hand-written attention (kernel selection on)"
TORCH_SDPA = "PyTorch scaled_dot_product_attention(is_causal=True)"
ATTENTION_ORDER = (HAND, CUDNN, TJ_ATTENTION, TJ_HAND, TORCH_SDPA)

# (c) the Trainer LM
OFF, ON = "autotune=False", "autotune=True"

# (d) layout pass
LAYOUT_PLAIN = "NCHW as written, jax.jit"
LAYOUT_PASS = "NCHW, tj.jit with the layout pass"

# Each part's workers, in the order they run, with their time limits on a GPU
# (seconds, from the worker's start: its imports and first calls included).
# They add up to 485 s, which leaves the 9-minute device command about 55 s for
# installing the wheels and starting Python.
PLAN: dict[str, tuple[tuple[str, float], ...]] = {
    "resnet50": (("resnet50.jax", 50), ("resnet50.tj_mp_layout", 45),
                 ("resnet50.tj_all_mp", 50), ("resnet50.tj_all", 50),
                 ("resnet50.torch", 30)),
    "attention": (("attention.jax", 55), ("attention.tj_attention", 35),
                  ("attention.tj_hand_written", 40), ("attention.torch", 15)),
    "lm": (("lm.mixed", 40), ("lm.float32", 30)),
    "conv_buckets": (("conv_buckets", 15),),
    "layout_f16": (("layout_f16", 30),),
}
PARTS = tuple(PLAN)
SMOKE_BUDGET_S = 120.0  # per worker in a --quick run (tiny sizes; a hung worker still ends)
