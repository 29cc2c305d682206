"""Which glibc malloc settings remove a tuned CPU step's page faults, and what each costs a tiny call.

tunedjax's host-memory settings (`tunedjax._host_memory`) are one arena
(``M_ARENA_MAX=1``), no separate mappings (``M_MMAP_MAX=0``) and a high trim
threshold. This script compares them with cheaper variants, each set through
glibc's ``MALLOC_*`` environment variables (or ``GLIBC_TUNABLES``) before
Python starts, and with the ways of acting in a process that has already
started JAX (what a workload's first process can do once its measurement
says the settings pay; `IN_PROCESS`): ``mallopt`` after the warm-up, JAX's
synchronous CPU dispatch, one arena only while JAX's backend starts, and
XLA's ``xla_multiheap_size_constraint_per_heap`` (through ``XLA_FLAGS``),
which splits a program's temporaries into blocks a thread arena can hold.
Every variant runs in processes of its own:

- **step**: the MobileNet-style train step of `vs_pytorch.py` under `tj.jit`
  with kernel selection (tuned once into a shared cache first): ms per step,
  minor page faults and system CPU ms per step (`getrusage`);
- **dispatch**: `jit_overhead.py`'s steady state: 200 calls of its small MLP
  step under plain `jax.jit`, dispatched without waiting, then one wait; a
  run is the median of 5 such batches: us per call.

The two measurements run in separate processes (a step's heap must not shape
the dispatch loop's). Each round asks every worker of a kind for one timed
run, in a rotated order (`harness.workers`); medians over rounds, and ratios
(median of per-round ratios) against the unset baseline, which is run twice
(A/A). Two sections, one set of workers each: ``malloc_settings`` (`VARIANTS`)
and ``malloc_in_process`` (tunedjax's settings and `IN_PROCESS`).

Run: ``.venv/bin/python benchmarks/run.py malloc_settings [--quick] [--write]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import harness
from harness import workers

_KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
VARIANTS = {
    "unset (glibc's defaults)": {},
    "A/A: unset again": {},
    "arena 1 + no mmap + trim (tunedjax's)": {"MALLOC_ARENA_MAX": "1", **_KEEP},
    "arena 2 + no mmap + trim": {"MALLOC_ARENA_MAX": "2", **_KEEP},
    "arena 4 + no mmap + trim": {"MALLOC_ARENA_MAX": "4", **_KEEP},
    "arena 8 + no mmap + trim": {"MALLOC_ARENA_MAX": "8", **_KEEP},
    "no mmap + trim": dict(_KEEP),
    "no mmap + trim + top pad 256 MiB": {**_KEEP, "MALLOC_TOP_PAD_": str(256 * 2**20)},
    "mmap threshold 32 MiB + trim": {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
                                     "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)},
    "arena 1 only": {"MALLOC_ARENA_MAX": "1"},
    "transparent huge pages (glibc.malloc.hugetlb=1)": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
    "tunedjax's + tcache 1024": {"MALLOC_ARENA_MAX": "1", **_KEEP,
                                 "GLIBC_TUNABLES": "glibc.malloc.tcache_count=1024"},
}
_SPLIT = {"XLA_FLAGS": "--xla_multiheap_size_constraint_per_heap=50331648"}
# name: (environment, what the worker does in-process). "mid": M_MMAP_MAX=0, the trim
# threshold and a 64 MiB top pad with mallopt after the first warm-up run (JAX's threads
# long started); "sync": jax_cpu_enable_async_dispatch off before the backend starts;
# "arena1": M_ARENA_MAX=1 with mallopt before JAX starts; "restore": M_ARENA_MAX back to
# glibc's default limit once the backend ran a first program (a thread that drew its arena
# keeps it; glibc also keeps the limit it first read: see the report).
IN_PROCESS = {
    "in-process: no mmap + trim + top pad 64 MiB": ({}, ("mid",)),
    "in-process: XLA heaps of 48 MiB, nothing else": (_SPLIT, ()),
    "in-process: XLA heaps of 48 MiB + no mmap + trim + top pad (tunedjax's first process)": (
        _SPLIT, ("mid",)),
    "in-process: synchronous dispatch + no mmap + trim + top pad": ({}, ("sync", "mid")),
    "in-process: one arena while JAX's backend starts, then restored + no mmap + trim": (
        {}, ("arena1", "restore", "mid")),
}
TUNEDJAX = "arena 1 + no mmap + trim (tunedjax's)"
BASE, CONTROL = "unset (glibc's defaults)", "A/A: unset again"
SECTIONS = ("malloc_settings", "malloc_in_process")


def _act(actions: tuple[str, ...], when: str) -> None:
  """Does what `actions` asks at `when` ("start": before JAX; "backend": after its first
  program; "mid": after the first warm-up run)."""
  import ctypes  # pylint: disable=import-outside-toplevel
  libc = ctypes.CDLL(None)
  if when == "start" and "arena1" in actions:
    libc.mallopt(-8, 1)  # M_ARENA_MAX
  if when == "start" and "sync" in actions:
    import jax  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  if when == "backend" and "restore" in actions:  # glibc's default limit (0 is refused)
    libc.mallopt(-8, 8 * (os.cpu_count() or 1))
  if when == "mid" and "mid" in actions:
    for param, value in ((-4, 0), (-1, 2**31 - 1), (-2, 64 * 2**20)):  # MMAP_MAX, TRIM, TOP_PAD
      libc.mallopt(param, value)


def _rss_mib() -> float:
  with open("/proc/self/status", encoding="utf-8") as f:
    return float(f.read().split("VmRSS:")[1].split()[0]) / 1024


def worker(kind: str, cache_dir: str, quick: bool, actions: list[str]) -> None:
  """Builds the step (or the MLP), then answers each "run" line with one timing."""
  import resource  # pylint: disable=import-outside-toplevel
  sys.modules["torch"] = None  # vs_pytorch's JAX side only
  actions = tuple(actions)
  _act(actions, "start")
  import jax  # pylint: disable=import-outside-toplevel
  if kind == "step":
    import vs_pytorch  # pylint: disable=import-outside-toplevel
    import tunedjax as tj  # pylint: disable=import-outside-toplevel
    step, args = vs_pytorch.net_problem("mobilenet", quick)[:2]
    config = {"kernel": {"enable": True}, "cache": {"dir": cache_dir}}
    fn, calls, batches = tj.jit(step), 5, 1

    def run():
      out = None
      with tj.config_context(config):  # tj.jit reads the config at each call
        for _ in range(calls):
          out = jax.block_until_ready(fn(*args))
      return out
  else:
    import jit_overhead  # pylint: disable=import-outside-toplevel
    step, args = workers.mlp_problem()
    fn, calls, batches = jax.jit(step), jit_overhead.CALLS_PER_RUN, 5

    def run():
      out = None
      for _ in range(calls):
        out = fn(*args)
      return jax.block_until_ready(out)
  run()
  _act(actions, "backend")
  _act(actions, "mid")
  for _ in range(3):
    run()

  def timed():
    before = resource.getrusage(resource.RUSAGE_SELF)
    walls = []
    for _ in range(batches):  # the median batch: one load spike does not move a run
      start = time.perf_counter()
      run()
      walls.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    n = calls * batches
    return {"s": statistics.median(walls) / calls,
            "faults": (after.ru_minflt - before.ru_minflt) / n,
            "sys_s": (after.ru_stime - before.ru_stime) / n, "rss_mib": _rss_mib()}

  workers.serve(timed)


def _spawn(kind: str, cache_dir: str, extra: dict[str, str], quick: bool = False,
           actions: tuple[str, ...] = ()):
  env = workers.user_env(**extra, TUNEDJAX_HOST_MEMORY="default", TUNEDJAX_CACHE_DIR=cache_dir)
  if "XLA_FLAGS" not in extra:
    env.pop("XLA_FLAGS", None)
  return workers.spawn(workers.command(__file__, kind=kind, cache_dir=cache_dir, quick=quick,
                                       actions=list(actions)), env)


def _runs(kind: str, variants: dict[str, dict[str, str]], rounds: int, cache_dir: str,
          quick: bool) -> dict[str, list[dict]]:
  """One worker per variant (started one at a time), timed in rotated rounds."""
  procs = {}
  for name, env in variants.items():
    procs[name] = _spawn(kind, cache_dir, env, quick, IN_PROCESS.get(name, ({}, ()))[1])
    procs[name].reply()
  return workers.run_rounds(procs, rounds)


def measure(quick: bool = False, *, rounds: int = 7, sections: tuple[str, ...] = SECTIONS,
            only: tuple[str, ...] | None = None) -> harness.Result:
  """Each section's variants (`only`: some of `VARIANTS`, beside the baseline), the
  dispatch loop's workers, then the step's; `quick`: one small set of both kinds."""
  rounds = 2 if quick else rounds
  base = {n: VARIANTS[n] for n in (BASE, CONTROL, TUNEDJAX)}
  sets = {"malloc_settings": {n: e for n, e in VARIANTS.items()
                              if not only or n in (BASE, CONTROL) or n in only},
          "malloc_in_process": {**base, **{n: e for n, (e, _) in IN_PROCESS.items()}}}
  if quick:
    sets = {"malloc_in_process": {**base, **{n: IN_PROCESS[n][0] for n in list(IN_PROCESS)[2:4]}}}
  cache_dir = tempfile.mkdtemp(prefix="tunedjax-malloc-settings-")
  tuner = _spawn("step", cache_dir, {}, quick)  # tunes once; the workers read the cache
  tuner.reply()
  tuner.close()
  runs = {}
  for section, variants in sets.items():
    if quick or section in sections:
      runs[section] = {kind: _runs(kind, variants, rounds, cache_dir, quick)
                       for kind in ("dispatch", "step")}
  return harness.Result("malloc_settings", params={"quick": quick, "rounds": rounds},
                        figures={"runs": runs})


def _ratio(runs, name):
  return statistics.median(a["s"] / b["s"] for a, b in zip(runs[name], runs[BASE]))


def _section(result: harness.Result, section: str) -> str:
  step, dispatch = (result.figures["runs"][section][k] for k in ("step", "dispatch"))
  in_process, rounds = section == "malloc_in_process", result.params["rounds"]
  how = ("each variant set through glibc's environment variables before Python starts"
         if not in_process else
         "the in-process variants act in a process that has started JAX (`IN_PROCESS`: "
         "mallopt after the first warm-up run, the XLA flag through `XLA_FLAGS`, JAX's dispatch "
         "before its backend starts), the others through glibc's environment variables")
  lines = [
      ("### Which malloc settings remove the faults, and what each costs a tiny call"
       if not in_process else
       "### Acting in a process that already runs: what removes the faults, at what cost"),
      "",
      f"`benchmarks/run.py malloc_settings{' --quick' if result.params['quick'] else ''}`: "
      f"{how}; the MobileNet-style `tj.jit` step (kernel "
      "selection, 5 steps a run) and the dispatch loop (`jax.jit` MLP, 200 calls not waiting, "
      f"the median of 5 such batches a run) each in processes of their own; {rounds} rotated "
      "rounds; ratio = median of per-round ratios to the unset baseline. "
      f"{result.load_line()} {result.machine}",
      "",
      "| malloc settings | step ms | step ratio | page faults per step | system ms per step "
      "| resident MiB (step) | dispatch us per call | dispatch ratio |",
      "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name in step:
    s, d = step[name], dispatch[name]
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    lines.append(
        f"| {name} | {1e3 * med(s, 's'):.1f} | {_ratio(step, name):.2f} | "
        f"{med(s, 'faults'):,.0f} | {1e3 * med(s, 'sys_s'):.1f} | {med(s, 'rss_mib'):.0f} | "
        f"{1e6 * med(d, 's'):.1f} | {_ratio(dispatch, name):.2f} |")
  return "\n".join(lines)


def render(result: harness.Result) -> dict[str, str]:
  """A section per set of workers measured."""
  return {section: _section(result, section) for section in result.figures["runs"]}


if __name__ == "__main__":
  workers.run_worker(worker)
