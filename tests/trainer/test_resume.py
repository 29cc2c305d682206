"""Checkpoints and resume: a killed run continues exactly where its last checkpoint was."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from tests import processes
from tests.trainer import models as m
from tunedjax.trainer import Trainer, TrainerError

ROOT = processes.ROOT
QUIET = {"autotune": False, "progress": False}

_RUN = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import jax
    jax.config.update("jax_num_cpu_devices", 8)  # as the test process (tests/conftest.py)
    from tests.trainer import models as m
    from tunedjax.trainer import Callback, Trainer

    ckpt, kill_at = sys.argv[2], int(sys.argv[3])

    class KillAt(Callback):
      def on_step_end(self, trainer, step, logs):
        if step == kill_at:
          os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no final checkpoint

    trainer = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, autotune=False, progress=False,
                      checkpoint_dir=ckpt, checkpoint_every=5)
    history = trainer.fit(m.regression_data(n=128), batch_size=16, steps=20, resume=True,
                          callbacks=[KillAt()] if kill_at >= 0 else [])
    print(json.dumps({"steps": history.steps, "losses": history.losses}))
""")


def _run(script: pathlib.Path, ckpt: pathlib.Path, kill_at: int) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(script), str(ROOT), str(ckpt), str(kill_at)],
                        capture_output=True, text=True, env=processes.cpu_env(), timeout=300)


@pytest.mark.slow
def test_a_run_killed_mid_training_resumes_bitwise_where_it_stopped(tmp_path):
  straight = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, **QUIET).fit(
      m.regression_data(n=128), batch_size=16, steps=20)  # 8 batches per epoch, shuffled
  script, ckpt = tmp_path / "run.py", tmp_path / "ckpt"
  script.write_text(_RUN)
  killed = _run(script, ckpt, kill_at=12)
  assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL after the step-10 save
  resumed = _run(script, ckpt, kill_at=-1)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  out = processes.last_json(resumed.stdout)
  assert out["steps"] == list(range(20))  # steps 0-9 from the checkpoint's history
  assert out["losses"] == straight.losses  # bitwise, data order included


def test_restore_into_a_new_trainer_continues_an_iterable_at_its_position(tmp_path):
  data = m.batches(m.regression_data(n=128), 16)  # a list: re-iterable, 8 batches
  straight = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, **QUIET).fit(data, steps=12)
  first = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, checkpoint_dir=tmp_path, **QUIET)
  first.fit(data, steps=6)  # saves at the end
  second = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, checkpoint_dir=tmp_path, **QUIET)
  history = second.fit(data, steps=12, resume=True)
  assert history.steps == list(range(12)) and history.losses == straight.losses
  assert [e["epoch"] for e in history.epochs] == [0]  # epoch 0 was closed after resuming
  third = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, checkpoint_dir=tmp_path, **QUIET)
  metadata = third.restore()  # the end-of-fit checkpoint of step 12
  assert third.step == 12 and third.history == history
  assert metadata["data"] == {"kind": "iterable", "epoch": 1, "index": 4}
  for a, b in zip(jax.tree_util.tree_leaves(third.state), jax.tree_util.tree_leaves(second.state)):
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(
        a.dtype, jax.dtypes.prng_key) else a), np.asarray(jax.random.key_data(b) if
        jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key) else b))


def test_resume_without_a_checkpoint_dir_is_an_error_and_an_empty_dir_starts_fresh(tmp_path):
  data = m.regression_data(n=64)
  with pytest.raises(TrainerError, match=r"resume=True\) needs a checkpoint_dir"):
    Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, **QUIET).fit(data, batch_size=16,
                                                                 steps=2, resume=True)
  trainer = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, checkpoint_dir=tmp_path / "new",
                    **QUIET)
  assert trainer.fit(data, batch_size=16, steps=2, resume=True).steps == [0, 1]
  assert trainer.checkpointer.all_steps() == [2]
