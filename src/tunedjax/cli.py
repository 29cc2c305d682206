"""The ``tunedjax`` command line.

One function per subcommand, ``_cmd_<name>(args) -> int``, registered in
`_build_parser`: ``info``, ``cache show|clear|export|import``, ``native build``
and ``demo``.

Example:
  >>> main(["--version"])  # doctest: +ELLIPSIS
  tunedjax ...
  0
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.metadata
import json
import pathlib
import platform
import sys
from collections.abc import Sequence
from typing import Any

import jax

import tunedjax
from tunedjax import _host_memory
from tunedjax import _native

# Each tuner registers its cache-entry validator when imported; `import
# tunedjax` alone imports nothing (its names are lazy), so `cache import`
# names them here.
from tunedjax import autotune as _autotune
from tunedjax import input_pipeline as _input_pipeline  # noqa: F401
from tunedjax import layout as _layout  # noqa: F401
from tunedjax._errors import TunedJaxError
from tunedjax._jit import XLA_CACHE_SUBDIR
from tunedjax._version import __version__
from tunedjax._tuning import Cache
from tunedjax._tuning import CacheEntry
from tunedjax._tuning import describe_problem
from tunedjax._tuning import device_fingerprint
from tunedjax._tuning import import_file

# The op families register their validators (and their native sources, which
# `tunedjax info` lists) when their packages load, on the first lookup.
_autotune.op_families()

# Distributions whose versions a bug report needs; "not installed" if absent.
PACKAGES = (
    "jax", "jaxlib", "flax", "optax", "grain", "orbax-checkpoint", "numpy",
)
# Accelerator plugins, listed only where installed.
OPTIONAL_PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "libtpu")


def _version(distribution: str) -> str | None:
  """The installed version of a distribution, or None."""
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def _versions() -> dict[str, str]:
  """Versions of tunedjax, its dependencies and Python."""
  versions = {"tunedjax": __version__}
  for name in PACKAGES:
    versions[name] = _version(name) or "not installed"
  for name in OPTIONAL_PACKAGES:
    if (found := _version(name)) is not None:
      versions[name] = found
  versions["python"] = platform.python_version()
  return versions


def _cache_stats(directory: pathlib.Path) -> tuple[int, int]:
  """The number of files under ``directory`` and their total size in bytes."""
  files, size = 0, 0
  for path in directory.rglob("*"):
    try:
      if path.is_file():
        files, size = files + 1, size + path.stat().st_size
    except OSError:  # Removed while we looked: skip it.
      continue
  return files, size


def info_dict(backend: str | None = None) -> dict[str, Any]:
  """Everything ``tunedjax info`` shows, as one JSON-able dict.

  Args:
    backend: the JAX backend to describe; None for the default one.

  Returns:
    A dict with the keys ``versions``, ``os``, ``fingerprint``,
    ``fingerprint_digest``, ``fingerprint_summary``, ``devices``, ``config``,
    ``cache_dir``, ``cache_exists``, ``cache_files``, ``cache_bytes``, ``native``
    and ``host_memory``.
  """
  fingerprint = device_fingerprint(backend)
  config = tunedjax.get_config()
  cache_dir = pathlib.Path(config.cache.resolved_dir)
  exists = cache_dir.is_dir()
  files, size = _cache_stats(cache_dir) if exists else (0, 0)
  devices = [
      {"id": d.id, "platform": d.platform, "device_kind": d.device_kind,
       "process_index": d.process_index, "name": str(d)}
      for d in jax.devices(backend)
  ]
  return {
      "versions": _versions(),
      "os": platform.platform(),
      "fingerprint": fingerprint.to_dict(),
      "fingerprint_digest": fingerprint.digest,
      "fingerprint_summary": fingerprint.describe(),
      "devices": devices,
      "config": config.to_dict(),
      "cache_dir": str(cache_dir),
      "cache_exists": exists,
      "cache_files": files,
      "cache_bytes": size,
      "native": _native.status(),
      "host_memory": _host_memory_info(),
  }


def _host_memory_info() -> dict[str, Any]:
  """This process's host-memory status, and every decision recorded for this machine."""
  path, decisions = _host_memory.recorded_decisions()
  return {**_host_memory.host_memory_status().to_dict(),
          "minor_page_faults": _host_memory.minor_page_faults(),
          "decisions_file": str(path), "decisions": decisions}


def _decision_line(record: dict[str, Any]) -> str:
  verdict = "pays" if record["pays"] else "does not pay"
  return (f"{verdict}: {record['program']} faulted {record['faults_per_call']:,.0f} pages, "
          f"{record['system_ms_per_call']:.1f} ms in the kernel per call of "
          f"{record['call_ms']:.1f} ms (measured {record['measured_at']})")


def _format_host_memory(memory: dict[str, Any]) -> list[str]:
  settings = ", ".join(f"{k}={v}" for k, v in memory["settings"].items())
  decisions = memory["decisions"]
  lines = ["", "Host memory (malloc)"] + _table({
      "mode": f"{memory['mode']} (${_host_memory.ENV_VAR})",
      "applied": f"yes: {settings}" if memory["applied"] else "no",
      "why": memory["reason"],
      "page faults": f"{memory['minor_page_faults']} minor, in this process so far",
      "decisions": (f"{len(decisions)} on this machine, in {memory['decisions_file']}"
                    + (":" if decisions else " (tunedjax.jit records them as it measures)")),
  })
  return lines + [f"    {r['workload']}: {_decision_line(r)}" for r in decisions]


def _human_size(n: int) -> str:
  """Formats a byte count: 512 B, 1.5 KiB, 3.0 MiB."""
  value, unit = float(n), "B"
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if value < 1024 or unit == "TiB":
      break
    value /= 1024
  return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def _table(rows: dict[str, Any]) -> list[str]:
  """Aligned ``key  value`` lines, indented by two spaces."""
  width = max(map(len, rows), default=0)
  return [f"  {k:<{width}}  {v}" for k, v in rows.items()]


def format_info(info: dict[str, Any]) -> str:
  """Renders `info_dict` output as readable text for users and bug reports."""
  fp = {k: ", ".join(v) if isinstance(v, list) else v
        for k, v in info["fingerprint"].items()}
  fp = {k: "(none)" if v in (None, "") else v for k, v in fp.items()}
  devices = {f"[{d['id']}]": f"{d['name']}  {d['device_kind']}"
             f"  (process {d['process_index']})" for d in info["devices"]}
  config = json.dumps(info["config"], indent=2, sort_keys=True)
  cache = {"directory": info["cache_dir"],
           "exists": "yes" if info["cache_exists"] else "no"}
  if info["cache_exists"]:
    cache["files"] = info["cache_files"]
    cache["size"] = _human_size(info["cache_bytes"])
  lines = [f"tunedjax {info['versions']['tunedjax']}", "", "Versions"]
  lines += _table({**info["versions"], "os": info["os"]})
  lines += ["", f"Device fingerprint {info['fingerprint_digest']}",
            f"  {info['fingerprint_summary']}"]
  lines += _table(fp)
  lines += ["", f"Devices ({len(info['devices'])})"] + _table(devices)
  lines += ["", "Configuration"] + ["  " + line for line in config.splitlines()]
  lines += ["", "Tuning cache"] + _table(cache)
  native = info["native"]
  lines += ["", "Native CPU kernels"] + _table({
      "enabled": "yes" if native["enabled"] else f"no (${_native.ENV_VAR})",
      "compiler": native["compiler"] or "(none found)",
      "built": ", ".join(native["built"]) or "(none yet: `tunedjax native build`, or on "
                                            "first use)",
      "sources": ", ".join(native["sources"]),
  })
  lines += _format_host_memory(info["host_memory"])
  return "\n".join(lines)


def _cmd_info(args: argparse.Namespace) -> int:
  """``tunedjax info [--json] [--backend NAME]``."""
  info = info_dict(args.backend)
  if args.json:
    print(json.dumps(info, indent=2))
  else:
    print(format_info(info))
  return 0


def _cache(args: argparse.Namespace) -> Cache:
  return Cache(args.dir) if args.dir else Cache()


def _entry_line(entry: CacheEntry) -> str:
  key = json.dumps(entry.key, sort_keys=True, separators=(",", ":"))
  if len(key) > 100:
    key = key[:97] + "..."
  value = entry.value
  decision = next((f"{k}={value[k]}" for k in ("winner", "target", "best", "choice")
                   if k in value), json.dumps(value)[:40])
  when = datetime.datetime.fromtimestamp(entry.created).strftime("%Y-%m-%d %H:%M")
  return f"  {entry.namespace:<10}  {when}  {decision:<24}  {key}"


def _cmd_cache_show(args: argparse.Namespace) -> int:
  """``tunedjax cache show [--json] [--namespace NS] [--dir DIR]``."""
  cache = _cache(args)
  entries = cache.entries(args.namespace)
  xla_dir, xla_files, xla_bytes = _xla_cache(cache)
  if args.json:
    print(json.dumps({"path": str(cache.path), "fingerprint": cache.fingerprint.to_dict(),
                      "entries": [e._asdict() for e in entries],
                      "xla_cache": {"path": str(xla_dir), "files": xla_files,
                                    "bytes": xla_bytes}}, indent=2))
    return 0
  counts = collections.Counter(e.namespace for e in entries)
  summary = ", ".join(f"{n} {ns}" for ns, n in sorted(counts.items())) or "empty"
  print(f"Tuning cache {cache.path}")
  print(f"  device {cache.fingerprint.digest}: {cache.fingerprint.describe()}")
  print(f"  {len(entries)} entries ({summary})")
  for entry in entries:
    print(_entry_line(entry))
  others = sorted(p.name for p in cache.dir.glob("*.json") if p != cache.path)
  if others:
    print(f"Other devices' files in {cache.dir}: {', '.join(others)}")
  print(f"Compilation cache {xla_dir} (level O2): "
        + (f"{xla_files} files, {_human_size(xla_bytes)}" if xla_files else "empty"))
  return 0


def _xla_cache(cache: Cache) -> tuple[pathlib.Path, int, int]:
  """JAX's persistent compilation cache that level O2 keeps beside the tuning cache."""
  directory = cache.dir / XLA_CACHE_SUBDIR
  files = [p for p in directory.rglob("*") if p.is_file()] if directory.is_dir() else []
  return directory, len(files), sum(p.stat().st_size for p in files)


def _cmd_cache_clear(args: argparse.Namespace) -> int:
  """``tunedjax cache clear [--all] [--dir DIR]``."""
  cache = _cache(args)
  if args.all:
    removed = [p for p in cache.dir.glob("*.json*") if p.is_file()]
    xla_dir = cache.dir / XLA_CACHE_SUBDIR
    if xla_dir.is_dir():
      removed += [p for p in xla_dir.rglob("*") if p.is_file()]
    for path in removed:
      path.unlink(missing_ok=True)
    print(f"Removed {len(removed)} files from {cache.dir}.")
  else:
    print(f"Removed {cache.clear()} entries from {cache.path}.")
  return 0


def _cmd_cache_export(args: argparse.Namespace) -> int:
  """``tunedjax cache export FILE [--dir DIR]``."""
  cache = _cache(args)
  count = cache.export(args.file)
  print(f"Exported {count} entries of device {cache.fingerprint.digest} to {args.file}.")
  return 0


def _cmd_cache_import(args: argparse.Namespace) -> int:
  """``tunedjax cache import FILE [--dir DIR]``: validated, merged, per device.

  The tuners imported above registered their entry validators (the op
  families', layout's, the loader's), so each imported entry is checked before it is taken.
  """
  cache, count, problems = import_file(args.file, args.dir)
  for problem in problems:
    print(f"skipped {problem}", file=sys.stderr)
  where = "this device" if cache.fingerprint == device_fingerprint() else (
      f"device {cache.fingerprint.digest} ({cache.fingerprint.describe()}), not this one")
  print(f"Imported {count} entries into {cache.path} for {where}; "
        f"skipped {len(problems)}.")
  return 0


def _add_cache_commands(commands: Any) -> None:
  cache = commands.add_parser(
      "cache", help="show, clear, export or import the tuning cache",
      description="The persistent tuning cache: one JSON file per device "
      "fingerprint in $TUNEDJAX_CACHE_DIR (default ~/.cache/tunedjax).")
  actions = cache.add_subparsers(dest="action", metavar="ACTION", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--dir", default=None,
                      help="cache folder (default: the configured one)")
  show = actions.add_parser("show", parents=[common], help="list this device's entries")
  show.add_argument("--json", action="store_true", help="print one JSON object")
  show.add_argument("--namespace", default=None,
                    help="only this tuner's entries: conv, layout, dataloader")
  show.set_defaults(run=_cmd_cache_show)
  clear = actions.add_parser("clear", parents=[common], help="delete this device's entries")
  clear.add_argument("--all", action="store_true",
                     help="delete every device's file, files moved aside and the "
                          "compilation cache of level O2")
  clear.set_defaults(run=_cmd_cache_clear)
  export = actions.add_parser("export", parents=[common],
                              help="write this device's entries to FILE")
  export.add_argument("file")
  export.set_defaults(run=_cmd_cache_export)
  import_ = actions.add_parser("import", parents=[common],
                               help="validate and merge the entries of FILE")
  import_.add_argument("file")
  import_.set_defaults(run=_cmd_cache_import)


def _cmd_native_build(args: argparse.Namespace) -> int:  # pylint: disable=unused-argument
  """``tunedjax native build``: every native source for this machine, side by side.

  Exits 1 when native kernels are off, no compiler was found or a source
  failed to build (the compiler's message is printed); 0 otherwise.
  """
  try:
    report = _native.build_all()
  except _native.NativeBuildError as err:
    print(f"tunedjax native build: {err}", file=sys.stderr)
    return 1
  for built in report:
    if built.error:
      print(f"{built.source:<12} failed: {built.error}", file=sys.stderr)
    elif built.seconds:
      print(f"{built.source:<12} built in {built.seconds:.1f} s: {built.path}")
    else:
      print(f"{built.source:<12} already built: {built.path}")
  return 1 if any(built.error for built in report) else 0


def _add_native_commands(commands: Any) -> None:
  native = commands.add_parser(
      "native", help="build the native CPU kernels ahead of the first run",
      description="The native CPU kernels (C++ XLA FFI handlers) are built once per "
      "machine, compiler and jaxlib, into $TUNEDJAX_NATIVE_DIR (default "
      f"{_native.DEFAULT_DIR}). `native build` builds them now, as part of an "
      "install, so that the first training run does not pay for it.")
  actions = native.add_subparsers(dest="action", metavar="ACTION", required=True)
  build = actions.add_parser("build", help="build every native source not built yet")
  build.set_defaults(run=_cmd_native_build)


def _build_parser() -> argparse.ArgumentParser:
  """The argument parser: one subparser per subcommand."""
  parser = argparse.ArgumentParser(
      prog="tunedjax",
      description="Make JAX/Flax training fast without expert tuning.",
  )
  parser.add_argument("--version", action="version",
                      version=f"tunedjax {__version__}")
  commands = parser.add_subparsers(dest="command", metavar="COMMAND")
  info = commands.add_parser(
      "info", help="show versions, device fingerprint, config and cache",
      description="Show versions, the device fingerprint, the devices, the "
      "active configuration and the tuning cache; paste it into bug reports.",
  )
  info.add_argument("--json", action="store_true",
                    help="print one JSON object, for scripts")
  info.add_argument("--backend", default=None,
                    help="JAX backend to describe (default: JAX's default)")
  info.set_defaults(run=_cmd_info)
  _add_cache_commands(commands)
  _add_native_commands(commands)
  _add_demo_command(commands)
  return parser


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
  return value


def _add_demo_command(commands: Any) -> None:
  demo = commands.add_parser(
      "demo", help="train a small CNN twice: default, then with set_config(None)",
      description="Train a small ResNet-style CNN (depthwise and 1x1 stages) on "
      "generated PNG images twice, the baseline (jax.jit, float32, grain's default "
      "loader) and the one switch (Trainer(autotune=True), i.e. set_config(None)); "
      "print the two side by side and write report.json and demo.png. Run it twice: "
      "the second run reads every choice from the tuning cache.")
  demo.add_argument("--quick", action="store_true",
                    help="small sizes: well under a minute (what the tests run)")
  demo.add_argument("--data", metavar="DIR", default=None,
                    help="train on your images instead: DIR holds one subfolder per class")
  demo.add_argument("--epochs", type=_positive_int, default=None,
                    help="epochs of each run (default 2; 1 with --quick)")
  demo.add_argument("--out", metavar="DIR", default="tunedjax-demo",
                    help="where report.json and demo.png go (default ./tunedjax-demo)")
  demo.add_argument("--no-progress", action="store_true", help="no progress bars")
  demo.set_defaults(run=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
  import dataclasses  # pylint: disable=import-outside-toplevel
  # The demo trains CNNs on the CPU: malloc set up for them before JAX starts (auto mode).
  _host_memory.apply_for_training("tunedjax demo started")
  from tunedjax import demo  # pylint: disable=import-outside-toplevel  # loads flax, grain
  options = demo.QUICK if args.quick else demo.DEFAULT
  changes: dict[str, Any] = {"data_dir": args.data}
  if args.epochs is not None:
    changes["epochs"] = args.epochs
  demo.run_demo(dataclasses.replace(options, **changes), out=args.out,
                progress=not args.no_progress)
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the ``tunedjax`` command line.

  Args:
    argv: the arguments after the program name; None for ``sys.argv[1:]``.

  Returns:
    The exit status: 0 on success, 1 when tunedjax reports an error, 2 on a
    usage error (no or unknown subcommand, bad option).
  """
  parser = _build_parser()
  try:
    args = parser.parse_args(argv)
  except SystemExit as exit_:  # --help, --version and usage errors.
    return exit_.code if isinstance(exit_.code, int) else 0
  if args.command is None:
    parser.print_help(sys.stderr)
    return 2
  try:
    return args.run(args)
  except TunedJaxError as err:
    print(f"tunedjax {args.command}: error: {err}", file=sys.stderr)
    return 1
  except OSError as err:  # a file the command reads or writes: say which and why
    where = f" {err.filename}" if err.filename else ""
    print(f"tunedjax {args.command}: error:{where}: {describe_problem(err.filename or '.', err)}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
  raise SystemExit(main())
