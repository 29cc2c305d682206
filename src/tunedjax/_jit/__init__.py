"""`tunedjax.jit`: `jax.jit` with the tuners' passes, at levels O0/O1/O2.

On each new input signature, inside `jax.jit`'s own trace, the function is
traced to a jaxpr and the passes the config enables run in order (mixed
precision if ``mixed_precision.enable``, layout if ``layout.enable``, kernel
selection if ``kernel.enable``), then a cleanup pass folds the casts and
transposes they leave next to each other, and the result is evaluated with
jit's tracers. So jit's cache, static arguments, donation, pytrees, `grad` and
`vmap` around it and sharded inputs behave as with `jax.jit`.

The compiled function is looked up by what the passes depend on: the level,
the config, the kernel-selection phase and the active kernel hints. A change
of any of them (a `config_context`, a step that leaves the tuning window)
takes effect on the next call.

Levels (after MindSpore's ``jit_level``):

- ``O0``: plain `jax.jit`, nothing rewritten (for debugging);
- ``O1``: the passes the config enables (the default, ``Config.level``);
- ``O2``: O1, plus JAX's persistent compilation cache in ``<cache dir>/xla``
  beside the tuning cache, so that a restarted job compiles less. It is the
  level at which the Trainer runs several steps in one compiled loop.

The parts, one job each:

- `_options`: `JitOptions`, the checked and frozen options;
- `_key`: `ProgramKey`, what a compiled program depends on, by name;
- `_table`: `ProgramTable`, the compiled programs per key, the per-call fast
  path and the programs keys share after a trace;
- `_trace`: `Builder`, the trace with the passes inside `jax.jit`'s;
- `_check`: `WholeProgramCheck`, the tuned program against the untuned one;
- `_reports`: `ReportBook` and the reports (`JitReport`, `SignatureReport`);
- `_jitted`: `Jitted`, the facade, and `jit`.
"""

import jax  # noqa: F401  (tests reach JAX's config through this module)

from tunedjax._jit._jitted import Jitted
from tunedjax._jit._jitted import jit
from tunedjax._jit._reports import JitReport
from tunedjax._jit._reports import MemoryFigures
from tunedjax._jit._reports import PassReport
from tunedjax._jit._reports import SignatureReport
from tunedjax._jit._trace import PASS_NAMES
from tunedjax._jit._trace import XLA_CACHE_SUBDIR
from tunedjax._jit._trace import enable_compilation_cache

__all__ = ["Jitted", "JitReport", "MemoryFigures", "PASS_NAMES", "PassReport",
           "SignatureReport", "XLA_CACHE_SUBDIR", "enable_compilation_cache", "jit"]
