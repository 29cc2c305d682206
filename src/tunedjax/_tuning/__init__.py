"""The machinery every tuner shares (package-internal; users reach it through `tunedjax.autotune`).

Kernel selection (`tunedjax.autotune`), the layout pass's measure mode
(`tunedjax.layout`), the loader tuner (`tunedjax.input_pipeline`) and the
command line (`tunedjax.cli`) all measure and remember the same way; this
package is the one place that does it, and they import it only through the
names below, never another tuner's private modules.

- **Where results live**: `Cache` (one JSON file per `DeviceFingerprint`,
  locked, atomic), `resolve_cache` (the one meaning of ``cache=``: None the
  default cache, False none), `register_validator` (each namespace checks
  its values before use), `import_file`, and `usable_folder` /
  `warn_unusable`: the one decision on a folder that cannot be used (missing,
  under a file, read-only, full), warned once, the tuner carrying on in memory.
- **What a result depends on**: `device_fingerprint`, `host_cpu`,
  `canonical_platform`, `usable_cores` (the cores this process may run on).
- **How to measure**: `time_interleaved` (rotated rounds, GC off), `median`,
  `random_array`/`random_inputs` (never zeros), `relative_error`,
  `max_abs_difference` (slice by slice: no array-sized temporaries).
- **Who is tuning**: `TuningSession` (phase, step counter, statistics, and
  an in-process memo over the cache: `lookup`/`store`), `current_session`,
  `default_session`, `using_session`.
- **Where a first call's time went**: `FirstCall` (seconds per stage of a
  new signature's first call in `tunedjax.jit`; `FIRST_CALL_STAGES`, their
  order) and `first_call_stage`, the context-local stage clock a tuner times
  its work into (``tune:compile``, ``tune:time``; `_anatomy` says how the
  rest is measured).

Example:
  >>> from tunedjax import _tuning
  >>> s = _tuning.TuningSession()
  >>> s.store(None, "demo", {"n": 1}, {"winner": "xla"})
  >>> s.lookup(None, "demo", {"n": 1})
  {'winner': 'xla'}
"""

from tunedjax._tuning._anatomy import ORDER as FIRST_CALL_STAGES
from tunedjax._tuning._anatomy import FirstCall as FirstCall
from tunedjax._tuning._anatomy import first_call_stage as first_call_stage
from tunedjax._tuning._cache import Cache as Cache
from tunedjax._tuning._cache import CacheEntry as CacheEntry
from tunedjax._tuning._cache import CacheLike as CacheLike
from tunedjax._tuning._cache import default_cache as default_cache
from tunedjax._tuning._cache import describe_problem as describe_problem
from tunedjax._tuning._cache import import_file as import_file
from tunedjax._tuning._cache import register_validator as register_validator
from tunedjax._tuning._cache import resolve_cache as resolve_cache
from tunedjax._tuning._cache import usable_folder as usable_folder
from tunedjax._tuning._cache import warn_unusable as warn_unusable
from tunedjax._tuning._fingerprint import CpuInfo as CpuInfo
from tunedjax._tuning._fingerprint import DeviceFingerprint as DeviceFingerprint
from tunedjax._tuning._fingerprint import device_fingerprint as device_fingerprint
from tunedjax._tuning._fingerprint import host_cpu as host_cpu
from tunedjax._tuning._inputs import max_abs_difference as max_abs_difference
from tunedjax._tuning._inputs import random_array as random_array
from tunedjax._tuning._inputs import random_inputs as random_inputs
from tunedjax._tuning._inputs import relative_error as relative_error
from tunedjax._tuning._platform import PLATFORMS as PLATFORMS
from tunedjax._tuning._platform import canonical_platform as canonical_platform
from tunedjax._tuning._platform import usable_cores as usable_cores
from tunedjax._tuning._xla_cache import persist_xla as persist_xla
from tunedjax._tuning._session import APPLY as APPLY
from tunedjax._tuning._session import OBSERVE as OBSERVE
from tunedjax._tuning._session import TUNE as TUNE
from tunedjax._tuning._session import Stats as Stats
from tunedjax._tuning._session import StepStats as StepStats
from tunedjax._tuning._session import TuningSession as TuningSession
from tunedjax._tuning._session import current_session as current_session
from tunedjax._tuning._session import default_session as default_session
from tunedjax._tuning._session import phase_of as phase_of
from tunedjax._tuning._session import using_session as using_session
from tunedjax._tuning._timing import median as median
from tunedjax._tuning._timing import time_interleaved as time_interleaved
