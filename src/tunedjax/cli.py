"""The ``tunedjax`` command line.

One function per subcommand, ``_cmd_<name>(args) -> int``, registered in
`_build_parser`. Today there is ``info``; ``demo``, ``cache show|clear|export|
import`` and ``bench`` join it later.

Example:
  >>> main(["--version"])  # doctest: +ELLIPSIS
  tunedjax ...
  0
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import platform
import sys
from collections.abc import Sequence
from typing import Any

import jax

import tunedjax
from tunedjax._errors import TunedJaxError
from tunedjax._version import __version__
from tunedjax.autotune import device_fingerprint

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
    ``cache_dir``, ``cache_exists``, ``cache_files`` and ``cache_bytes``.
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
  }


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
  return "\n".join(lines)


def _cmd_info(args: argparse.Namespace) -> int:
  """``tunedjax info [--json] [--backend NAME]``."""
  info = info_dict(args.backend)
  if args.json:
    print(json.dumps(info, indent=2))
  else:
    print(format_info(info))
  return 0


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
  return parser


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


if __name__ == "__main__":
  raise SystemExit(main())
