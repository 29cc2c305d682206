"""Every benchmark, in one place: the Makefile's `bench` target, the smoke tests
(tests/test_docs.py) and BENCHMARKS.md's sections all read this list.

A `Benchmark` names a module of benchmarks/: `sections`, the BENCHMARKS.md sections it
writes (default its name); `smoke`, where its ``--quick`` run is checked (``"test"``:
`make test`, under a minute; ``"bench-smoke"``: `make bench-smoke`, minutes; ``"own"``: a
test file of its own); `writes`, False for one that only prints its tables; `bench`,
whether `make bench` (``run.py all``) runs it: every one that writes, but `gpu`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Benchmark:
  name: str
  sections: tuple[str, ...] = ()
  smoke: str = "bench-smoke"
  writes: bool = True
  bench: bool = True

  def __post_init__(self):
    if self.smoke not in ("test", "bench-smoke", "own"):
      raise ValueError(f"{self.name}: smoke={self.smoke!r}; one of 'test', 'bench-smoke', 'own'")
    if not self.writes:  # prints its tables only; `make bench` leaves it out
      object.__setattr__(self, "bench", False)
    elif not self.sections:
      object.__setattr__(self, "sections", (self.name,))


BENCHMARKS = (
    Benchmark("rewrite_overhead"),
    Benchmark("kernels"),
    Benchmark("layout", sections=("layout_cpu",)),
    Benchmark("mixed_precision"),
    Benchmark("input_pipeline"),
    Benchmark("jit_overhead"),
    Benchmark("trainer", sections=("trainer", "trainer_autotune")),
    Benchmark("attention", sections=("attention", "attention_hand_written")),
    Benchmark("vs_pytorch", sections=("vs_pytorch", "vs_pytorch_plain_auto")),
    Benchmark("first_process"),
    # The first process's host-memory decision after tuning: faults per step, fresh runs.
    Benchmark("first_process_faults"),
    Benchmark("after_idle"),
    Benchmark("host_memory"),
    Benchmark("malloc_settings", sections=("malloc_settings", "malloc_in_process")),
    Benchmark("import_dispatch"),
    Benchmark("bn_accuracy", smoke="test"),
    Benchmark("kernel_priors"),
    # What tunedjax hands XLA for CUDA and TPU, counted by export (no device needed).
    Benchmark("program_audit"),
    Benchmark("flash_attention"),
    # The layer_norm family alone and in the miniGPT step, against PyTorch.
    Benchmark("layer_norm"),
    # A training step's update error against float64, each family pinned to each kernel.
    Benchmark("step_accuracy", writes=False),
    # The native kernels' per-bucket and whole-step timings: printed, not written.
    Benchmark("bn_native", writes=False),
    Benchmark("depthwise_native", writes=False),
    Benchmark("direct_native", writes=False),
    Benchmark("pointwise_native", writes=False, smoke="test"),
    Benchmark("xla_options", writes=False),
    Benchmark("gpu", sections=("gpu_resnet50", "gpu_attention", "gpu_lm", "gpu_conv_buckets",
                               "gpu_layout_f16"), smoke="own", bench=False),
)
BY_NAME = {b.name: b for b in BENCHMARKS}
# The sections written by hand between markers (the demo's runs).
HAND_WRITTEN = ("demo",)


def written_sections() -> set[str]:
  """Every section a benchmark writes."""
  return {s for b in BENCHMARKS if b.writes for s in b.sections}
