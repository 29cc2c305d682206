"""Verdicts of the whole-program check, kept in the tuning cache (namespace ``"verdict"``).

When `_verify.Verifier` finds that a bucket's kernel, faster alone, makes
the whole program slower, the verdict is cached so that no later run tries
it again there: kernel selection gives that bucket its family's default
(reason ``"loses in context"``). The program's verified decisions are kept
too, so a later run making the same decisions skips the check.

**What a verdict is keyed by.** A kernel that loses in one program may win
in another (what it loses to is the code around it), so a verdict holds for
one *program context*: the function's qualified name, the structure of its
arguments (the pytree definition: for a Trainer, the model's parameter
names) and their shapes and dtypes, and the platform, hashed into
`context_key`. The cache file is per device already. Inside a context, the
verdict names the bucket (a hash of its full key, which holds the spec and
the candidates' source hashes: a changed kernel is a new bucket) and the
kernel that lost: a bucket re-tuned to another winner is not vetoed.

An entry is ``{"lost": {bucket id: {"kernel", "label", "how"}}, "kept":
{bucket id: kernel}, "outcome": str}``; ``how`` is ``"alone"`` (found by
bisection), ``"group"`` or ``"program"`` (lost with others, not isolated).
Entries are validated on load like every cache value: a corrupt one is a
warning and reads as no verdict.

Example:
  >>> import tempfile
  >>> from tunedjax import _tuning
  >>> cache, session = _tuning.Cache(tempfile.mkdtemp()), _tuning.TuningSession()
  >>> ctx = context_key("step", "PyTreeDef((*, *))", "f32[8,4], f32[4]", "cpu")
  >>> store(session, cache, ctx, lost={"conv:ab12": {"kernel": "im2col",
  ...       "label": "conv 8x4", "how": "alone"}}, kept={}, outcome="found losers")
  >>> loses(session, cache, ctx, "conv:ab12", "im2col"), loses(session, cache, ctx,
  ...                                                          "conv:ab12", "fft")
  (True, False)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from tunedjax import _tuning

NAMESPACE = "verdict"
HOWS = ("alone", "group", "program")


def context_key(name: str, structure: str, signature: str, platform: str) -> dict[str, str]:
  """The cache key of one program context (see the module doc).

  Example:
    >>> sorted(context_key("f", "PyTreeDef(*)", "f32[2]", "cpu"))
    ['context', 'program']
  """
  digest = hashlib.sha256("\n".join((name, structure, signature, platform)).encode())
  return {"program": str(name), "context": digest.hexdigest()[:24]}


def bucket_id(family: str, key: Mapping[str, Any]) -> str:
  """A short, stable id of a bucket's full key: ``"<family>:<hash>"``.

  Example:
    >>> bucket_id("conv", {"op": "conv", "lhs_shape": [1, 2]})
    'conv:7937b248c64efb2a'
  """
  text = json.dumps(key, sort_keys=True, default=str)
  return f"{family}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _validate(value: Any) -> None:
  """Raises ValueError on anything but a well-formed verdict entry."""
  if not isinstance(value, dict) or set(value) != {"lost", "kept", "outcome"}:
    raise ValueError("a verdict entry must be {'lost', 'kept', 'outcome'}")
  lost, kept = value["lost"], value["kept"]
  if not isinstance(lost, dict) or not isinstance(kept, dict):
    raise ValueError("'lost' and 'kept' must be objects")
  for bucket, v in lost.items():
    if (not isinstance(v, dict) or set(v) != {"kernel", "label", "how"}
        or not all(isinstance(v[k], str) for k in v) or v["how"] not in HOWS):
      raise ValueError(f"bad 'lost' entry for {bucket!r}: {v!r}")
  if not all(isinstance(k, str) for k in kept.values()):
    raise ValueError("'kept' must map bucket ids to kernel names")
  if not isinstance(value["outcome"], str):
    raise ValueError("'outcome' must be a string")


_tuning.register_validator(NAMESPACE, _validate)


def load(session: _tuning.TuningSession, cache: Any,
         context: Mapping[str, str] | None) -> dict[str, Any] | None:
  """The verdict entry of `context` (None: none, or no context)."""
  if context is None:
    return None
  return session.lookup(cache, NAMESPACE, context)


def loses(session: _tuning.TuningSession, cache: Any, context: Mapping[str, str] | None,
          bucket: str, kernel: str) -> bool:
  """Whether `kernel` was found to lose in context for `bucket` in this program."""
  entry = load(session, cache, context)
  if entry is None:
    return False
  found = entry["lost"].get(bucket)
  return found is not None and found["kernel"] == kernel


def store(session: _tuning.TuningSession, cache: Any, context: Mapping[str, str], *,
          lost: Mapping[str, Mapping[str, str]], kept: Mapping[str, str],
          outcome: str) -> None:
  """Caches what the whole-program check found for `context` (earlier losers kept)."""
  before = load(session, cache, context)
  merged = dict(before["lost"]) if before is not None else {}
  merged.update({k: dict(v) for k, v in lost.items()})
  value = {"lost": merged, "kept": dict(kept), "outcome": str(outcome)}
  _validate(value)
  session.store(cache, NAMESPACE, context, value)
