"""The PyTorch rows of `benchmarks/gpu.py`: ResNet-50 (part a) and SDPA (part b).

Each in a worker of its own (``resnet50.torch``, ``attention.torch``), so that
PyTorch and JAX never share the GPU's memory. Without torch (or torchvision)
the worker prints why and records a ``skip``: the other rows are unchanged.
"""

from __future__ import annotations

from typing import Any

from _gpu_measure import (Deadline, Sizes, first_call, guarded, out_of_time, steady_state,
                          timing_fields)
from _gpu_names import TORCH_AMP, TORCH_F32, TORCH_SDPA
from harness.workers import emit, say


def _import(*names: str) -> dict[str, Any] | None:
  """The modules, or None after saying why the PyTorch rows are skipped."""
  import importlib  # pylint: disable=import-outside-toplevel
  try:
    return {n: importlib.import_module(n) for n in names}
  except Exception as e:  # pylint: disable=broad-except  # ImportError or a broken install
    reason = f"PyTorch rows skipped: cannot import {', '.join(names)} ({type(e).__name__}: {e})"
    say("  " + reason)
    emit("skip", reason=reason)
    return None


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


def _resnet_loop(m: dict[str, Any], sizes: Sizes, device: str, amp: bool) -> _Loop:
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


def _setup(m: dict[str, Any]) -> str:
  torch = m["torch"]
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.backends.cudnn.benchmark = True
  if device == "cpu":  # a check run: OpenMP threads spinning beside XLA's only slow it down
    torch.set_num_threads(1)
  emit("env", torch=torch.__version__, torch_device=(
      torch.cuda.get_device_name(0) if device == "cuda" else "cpu"))
  say(f"  torch {torch.__version__} on {device}, cudnn.benchmark on")
  return device


def worker_resnet(sizes: Sizes, deadline: Deadline) -> None:
  """torchvision's ResNet-50, channels_last, SGD with momentum: float32 and AMP bfloat16."""
  m = _import("torch", "torchvision")
  if m is None:
    return
  device = _setup(m)
  loops, firsts = {}, {}
  for name, amp in ((TORCH_F32, False), (TORCH_AMP, True)):
    loop = guarded(name, lambda a=amp: _resnet_loop(m, sizes, device, a))
    first = loop and guarded(name, lambda n=name, l=loop: first_call(n, l))
    if first is not None:
      loops[name], firsts[name] = loop, first
      emit("row", variant=name, first_call_s=first, first_loss=float(loop.out.detach()))
  if not loops:
    return
  measured = steady_state(loops, next(iter(loops)), deadline, sizes)
  for name in loops:
    fields = {"first_call_s": firsts[name]}
    if measured is not None:
      fields.update(timing_fields(*measured, name))
      fields["images_per_s"] = sizes.batch / (fields["ms"] / 1e3)
    emit("row", variant=name, **fields)
    say(f"  {name}: {fields}")


def _sdpa_loop(m: dict[str, Any], sizes: Sizes, device: str, tokens: int) -> _Loop:
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
  m = _import("torch")
  if m is None:
    return
  device = _setup(m)
  for tokens in sizes.attn_tokens:
    if out_of_time(f"{TORCH_SDPA}, {tokens} tokens", deadline, 3):
      continue
    fields = {"tokens": tokens}
    loop = guarded(TORCH_SDPA, lambda t=tokens: _sdpa_loop(m, sizes, device, t), **fields)
    first = loop and guarded(TORCH_SDPA, lambda l=loop: first_call(f"{TORCH_SDPA}, {tokens}", l),
                             **fields)
    if first is None:
      continue
    measured = steady_state({TORCH_SDPA: loop}, TORCH_SDPA, deadline, sizes)
    fields.update(first_call_s=first, value=float(loop.out.detach()))
    if measured is not None:
      fields.update(timing_fields(*measured, TORCH_SDPA))
    emit("row", variant=TORCH_SDPA, **fields)
    say(f"  {TORCH_SDPA}: {fields}")
