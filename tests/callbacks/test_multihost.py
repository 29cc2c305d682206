"""Callbacks in a 2-process `jax.distributed` job on this CPU: one writer (process 0) for
the logs; both processes stop early alike and save the best checkpoint together."""

from __future__ import annotations

import csv
import json
import pathlib
import textwrap

import pytest

from tests import processes

ROOT = pathlib.Path(__file__).resolve().parents[2]

_WORKER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[4])
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=pid)
    from tests.callbacks import support as s
    from tunedjax import callbacks

    data = s.ScoredEpochs([3.0, 1.0, 2.0, 2.0, 0.5], batch_size=16)
    data._batches = [{k: v[pid::2] for k, v in b.items()} for b in data._batches]  # my half
    cbs = [callbacks.TensorBoard(os.path.join(out, "tb")),
           callbacks.CSVLogger(os.path.join(out, "csv")),
           callbacks.JSONLinesLogger(os.path.join(out, "log.jsonl")),
           callbacks.EarlyStopping("score", patience=1),
           callbacks.BestCheckpoint(os.path.join(out, "best"), monitor="score")]
    trainer = s.scored_trainer()
    history = trainer.fit(data, epochs=5, callbacks=cbs)
    cbs[-1].close()
    print(json.dumps({"process": jax.process_index(), "losses": history.losses,
                      "epochs": len(history.epochs), "step": trainer.step,
                      "best_step": cbs[-1].best_step, "stopped": cbs[3].stopped_epoch}))
    jax.distributed.shutdown()
""")


@pytest.mark.slow
def test_two_processes_write_one_set_of_logs_and_agree_on_stopping(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  out = tmp_path / "out"
  first, second = processes.run_distributed(script, [[str(out), str(ROOT)]] * 2)
  assert (first["process"], second["process"]) == (0, 1)
  assert first["losses"] == second["losses"] and first["stopped"] == second["stopped"] == 2
  assert first["step"] == 9 and first["epochs"] == 3 and first["best_step"] == 6
  events = [p for p in (out / "tb").iterdir() if p.name.startswith("events.out.tfevents")]
  assert len(events) == 1  # process 1 wrote none
  with open(out / "csv" / "steps.csv", newline="", encoding="utf-8") as f:
    steps = [int(r["step"]) for r in csv.DictReader(f)]
  assert steps == list(range(9))  # each step once
  with open(out / "log.jsonl", encoding="utf-8") as f:
    assert [json.loads(line)["kind"] for line in f].count("epoch") == 3
  assert sorted(p.name for p in (out / "best").iterdir() if p.name.isdigit()) == ["6"]
