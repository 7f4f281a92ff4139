"""An update's time limit (distill.train_time_limit_s): it stops taking steps once the limit has passed,
and in a data-parallel Ray Train job every worker stops at the same step. Without a limit a job ran as
long as its steps took, and a worker that stopped alone would leave the others in the all-reduce."""

from __future__ import annotations

import copy
import json
import os
import socket
import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from osd_serve.distill import trainer as trainer_mod
from osd_serve.distill.trainer import DistillTrainer, TrainConfig, any_rank
from tests.conftest import llama
from tests.test_trainer_precision import V, _records


class _Clock:
    """time.monotonic for the trainer: ``step`` seconds pass at each reading."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _trainer(limit: float, agree=None, grad_hook=None, seed: int = 0) -> tuple[DistillTrainer, list]:
    target = llama(V, seed=0)
    cfg = TrainConfig(mode="full", lr=1e-3, batch_size=2, time_limit_s=limit)
    return DistillTrainer(copy.deepcopy(target), cfg, vocab=V, agree=agree, grad_hook=grad_hook), _records(target, seed=seed)


def test_an_update_stops_taking_steps_at_its_time_limit(monkeypatch):
    monkeypatch.setattr(trainer_mod, "time", SimpleNamespace(monotonic=_Clock(1.0)))  # the start reads 1, each step's check 1 more
    tr, recs = _trainer(2.5)
    losses = tr.train(recs, steps=10)
    assert len(losses) == 2 and tr.time_limited  # 1 and 2 s into it: a step each; 3 s: over
    tr.cfg.time_limit_s = 0.0  # none: every step, and the flag is the last update's
    assert len(tr.train(recs, steps=10)) == 10 and not tr.time_limited


def test_the_stop_is_what_the_workers_agree_not_this_ones_clock(monkeypatch):
    """agree() gets this worker's "late" at every step and its answer decides: another worker being late
    stops this one too, at the same step."""
    monkeypatch.setattr(trainer_mod, "time", SimpleNamespace(monotonic=_Clock(0.0)))  # this worker is never late
    asked = []

    def agree(late: bool) -> bool:
        asked.append(late)
        return len(asked) == 4  # another worker is late at the fourth check

    tr, recs = _trainer(5.0, agree=agree)
    assert len(tr.train(recs, steps=10)) == 3 and tr.time_limited
    assert asked == [False] * 4
    asked.clear()
    tr.cfg.time_limit_s = 0.0
    tr.train(recs, steps=2)
    assert asked == []  # no limit, no collective: the workers all skip it alike
    with pytest.raises(ValueError, match="time_limit_s"):
        TrainConfig(time_limit_s=float("nan"))


def _worker(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks, each training its own shard with gradients all-reduced, as a Ray Train
    worker does; rank 0's clock runs out after 3 steps, rank 1's never."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        trainer_mod.time = SimpleNamespace(monotonic=_Clock(1.0 if rank == 0 else 0.0))  # this process's own module

        def all_reduce(params):
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= 2

        tr, recs = _trainer(3.5, agree=any_rank, grad_hook=all_reduce, seed=rank)
        losses = tr.train(recs, steps=10)
        state = tr.serving_state()
        total = torch.stack([t.float().sum() for t in state.values()]).sum()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"steps": len(losses), "limited": tr.time_limited, "weights": total.item()}, f)
    finally:
        dist.destroy_process_group()


def test_two_data_parallel_workers_stop_at_the_same_step(tmp_path):
    """Through a real gloo group: a worker that decided alone left the other in the gradient all-reduce
    (a hang until the collective timed out, a failed job after it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_worker, args=(port, str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=2):  # a rank that raised raises here
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two workers did not finish: one waits in a collective the other left")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [g["steps"] for g in got] == [3, 3] and all(g["limited"] for g in got), got
    assert got[0]["weights"] == pytest.approx(got[1]["weights"], rel=1e-6)  # one model: the same steps all-reduced


def test_a_local_update_stopped_at_its_limit_is_guarded_and_says_so(tok, tmp_path, monkeypatch, caplog):
    """The colocated backend's updates (a thread beside the engine) have the same limit: the steps taken
    are guarded and may publish, and the result and the log say the update was cut."""
    from osd_serve.config import EngineConfig, SamplingParams
    from osd_serve.distill.guard import GuardConfig
    from osd_serve.distill.online import OnlineDistiller
    from osd_serve.distill.replay import BufferConfig, ReplayBuffer
    from osd_serve.distill.versions import VersionStore
    from osd_serve.engine import SpecEngine
    from tests.conftest import perturbed

    target = llama(len(tok), seed=0)
    eng = SpecEngine(target, perturbed(target, 0.2), tok, EngineConfig(max_batch_size=8))
    trainer = DistillTrainer(eng.draft, TrainConfig(mode="full", lr=3e-3, steps_per_update=16, time_limit_s=4.5))
    dist = OnlineDistiller(eng, trainer, ReplayBuffer(BufferConfig(trigger_records=10_000)), VersionStore(tmp_path),
                           GuardConfig(tolerance=1.0))
    prompts = [[5 + i, 9, 11 + i, 7] for i in range(12)]
    eng.generate(prompts, SamplingParams(max_tokens=12, num_speculative_tokens=3))  # recorded, not yet due
    monkeypatch.setattr(trainer_mod, "time", SimpleNamespace(monotonic=_Clock(1.0)))
    with caplog.at_level("WARNING", logger="osd_serve.distill.online"):
        res = dist.update("default")
    assert res.time_limited and len(res.losses) == 4 and res.published, res
    assert "stopped at its time limit (4.5 s) after 4 steps" in caplog.text


def test_an_older_detached_controller_gets_no_time_limit_it_cannot_take(monkeypatch):
    """connect() reconfigures a detached controller that may be an older osd-serve's: the limit in its
    train_cfg reached its TrainConfig (no time_limit_s) in every Train worker, a TypeError per job, with
    no warning; as its own keyword the older controller refuses it and is configured without it."""
    import deployments.distiller as dist
    from deployments.config import parse_config

    configured = []

    def configure(*a, train_time_limit_s=None, **kw):  # an older controller has no such keyword
        if train_time_limit_s is not None:
            raise TypeError("configure() got an unexpected keyword argument 'train_time_limit_s'")
        configured.append((a, kw))

    handle = SimpleNamespace(configure=SimpleNamespace(remote=configure))
    actor = SimpleNamespace(options=lambda **opts: SimpleNamespace(remote=lambda *a, **kw: handle))
    monkeypatch.setattr(dist, "ReplayBufferActor", actor)
    monkeypatch.setattr(dist, "DistillController", actor)
    monkeypatch.setattr(dist, "ray", SimpleNamespace(get=lambda x: x))
    dist.connect(parse_config({"target": "org/t", "draft": "org/d", "distill": {"backend": "ray_train", "train_time_limit_s": 45}}), app="a")
    (args, kw), = [c for c in configured if "pair" in c[1]]
    assert "time_limit_s" not in args[2]
    assert dist.train_loop_per_worker is not None  # its Train workers look the loop up here, by reference
