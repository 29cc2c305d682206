"""The Trainer in a 2-process `jax.distributed` job on this CPU: it trains and checkpoints."""

from __future__ import annotations

import pathlib
import textwrap

import numpy as np
import pytest

from tests import processes

ROOT = pathlib.Path(__file__).resolve().parents[2]

_WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[4])
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, pid, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=pid)
    import numpy as np
    from tests.trainer import models as m
    from tunedjax.trainer import Trainer

    data = m.regression_data(n=128)
    mine = {k: v[pid::2] for k, v in data.items()}  # each host feeds its half of each batch
    trainer = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, autotune=False, progress=False,
                      checkpoint_dir=ckpt, checkpoint_every=4)
    history = trainer.fit(m.batches(mine, 8), steps=6)
    print(json.dumps({"losses": history.losses, "devices": jax.device_count(),
                      "shards": trainer.placement.shards, "step": trainer.step,
                      "saved": trainer.checkpointer.all_steps()}))
    jax.distributed.shutdown()
""")


@pytest.mark.slow
def test_two_processes_train_data_parallel_and_checkpoint(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  ckpt = tmp_path / "ckpt"
  results = processes.run_distributed(script, [[str(ckpt), str(ROOT)]] * 2)
  first, second = results
  assert first["devices"] == 2 and first["shards"] == 2 and first["step"] == 6
  assert first["losses"] == second["losses"]  # one global loss, seen by both
  assert len(first["losses"]) == 6 and np.isfinite(first["losses"]).all()
  assert first["saved"] == second["saved"] and 4 in first["saved"] and 6 in first["saved"]
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == first["saved"]
