"""The PyTorch rows of `benchmarks/gpu.py`: ResNet-50 (part a) and SDPA (part b).

Each in a worker of its own (``resnet50.torch``, ``attention.torch``), so that
PyTorch and JAX never share the GPU's memory. Without torch (or torchvision)
the worker prints why and records a ``skip``: the other rows are unchanged.
"""

from __future__ import annotations

from typing import Any

from _gpu_measure import Deadline, Sizes, compare
from _gpu_names import TORCH_AMP, TORCH_F32, TORCH_SDPA
from harness.workers import emit, say


def _import(*names: str) -> tuple[dict[str, Any], str] | None:
  """The modules and the device (cudnn.benchmark on), or None after saying why the PyTorch
  rows are skipped."""
  import importlib  # pylint: disable=import-outside-toplevel
  try:
    m = {n: importlib.import_module(n) for n in names}
  except Exception as e:  # pylint: disable=broad-except  # ImportError or a broken install
    reason = f"PyTorch rows skipped: cannot import {', '.join(names)} ({type(e).__name__}: {e})"
    say("  " + reason)
    emit("skip", reason=reason)
    return None
  torch = m["torch"]
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.backends.cudnn.benchmark = True
  if device == "cpu":  # a check run: OpenMP threads spinning beside XLA's only slow it down
    torch.set_num_threads(1)
  emit("env", torch=torch.__version__, torch_device=(
      torch.cuda.get_device_name(0) if device == "cuda" else "cpu"))
  say(f"  torch {torch.__version__} on {device}, cudnn.benchmark on")
  return m, device


class _Loop:
  """A PyTorch train step run `k` times, then synchronised."""

  def __init__(self, torch: Any, device: str, step: Any):
    self.torch, self.device, self.step, self.out = torch, device, step, None

  def run(self, k: int = 1) -> Any:
    for _ in range(k):
      self.out = self.step()
    if self.device == "cuda":
      self.torch.cuda.synchronize()
    return self.out


def _resnet_loop(m: dict[str, Any], device: str, sizes: Sizes, amp: bool) -> _Loop:
  torch, tv = m["torch"], m["torchvision"]
  if sizes.smoke:
    # torchvision's ResNet has four stages: one basic block each (a ResNet-10)
    model = tv.models.resnet.ResNet(tv.models.resnet.BasicBlock, [1, 1, 1, 1])
  else:
    model = tv.models.resnet50()
  model = model.to(device, memory_format=torch.channels_last).train()
  opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                        weight_decay=1e-4)
  gen = torch.Generator().manual_seed(0)
  x = torch.randn(sizes.batch, 3, sizes.image, sizes.image, generator=gen)
  x = x.to(device).contiguous(memory_format=torch.channels_last)
  y = torch.randint(0, 1000, (sizes.batch,), generator=gen).to(device)

  def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=amp):
      loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss

  return _Loop(torch, device, step)


def worker_resnet(sizes: Sizes, deadline: Deadline) -> None:
  """torchvision's ResNet-50, channels_last, SGD with momentum: float32 and AMP bfloat16."""
  got = _import("torch", "torchvision")
  if got is not None:
    builds = {TORCH_F32: lambda: _resnet_loop(*got, sizes, False),
              TORCH_AMP: lambda: _resnet_loop(*got, sizes, True)}
    compare(builds, TORCH_F32, deadline, sizes, rate=("images_per_s", sizes.batch),
            first=lambda name, loop: {"first_loss": float(loop.out.detach())})


def _sdpa_loop(m: dict[str, Any], device: str, sizes: Sizes, tokens: int) -> _Loop:
  torch = m["torch"]
  f = torch.nn.functional
  gen = torch.Generator().manual_seed(0)
  shape = (sizes.attn_batch, sizes.attn_heads, tokens, sizes.attn_head_dim)
  q, k, v, g = (torch.randn(*shape, generator=gen).to(device, torch.bfloat16) for _ in range(4))
  for t in (q, k, v):
    t.requires_grad_(True)

  def step():
    for t in (q, k, v):
      t.grad = None
    out = f.scaled_dot_product_attention(q, k, v, is_causal=True)
    loss = (out.float() * g.float()).sum()
    loss.backward()
    return loss

  return _Loop(torch, device, step)


def worker_attention(sizes: Sizes, deadline: Deadline) -> None:
  """PyTorch's SDPA, causal, bfloat16, forward and backward, at each length."""
  got = _import("torch")
  for tokens in sizes.attn_tokens if got is not None else ():
    compare({TORCH_SDPA: lambda t=tokens: _sdpa_loop(*got, sizes, t)}, TORCH_SDPA, deadline,
            sizes, last=lambda n, loop: {"value": float(loop.out.detach())}, tokens=tokens)
