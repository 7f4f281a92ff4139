"""The distillation job the controller (deployments/distiller.py) runs: how many Ray Train workers
the idle capacity holds, and one TorchTrainer run over the buffer's records, gradients all-reduced
across its workers, returning the trained draft state."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from pathlib import Path


COLLECTIVE_FLOOR_S = 300  # the least a collective waits before it fails the job (torch.distributed timeout)


def plan_workers(nodes: list[dict], serve_load: float, max_workers: int = 4, busy_load: float = 0.75,
                 cpus_per_worker: float = 0.5) -> dict | None:
    """How many Ray Train workers to launch now, on what. None: wait.

    nodes: each live node's idle resources (``idle_per_node()``: what serving left idle). A worker
    must fit on one node, so capacity is counted per node: two nodes with half a GPU free each hold
    no GPU worker (summed, they would plan one that can never be placed, and the job would wait for
    it forever). serve_load: the serving replicas' ongoing requests over their capacity, in [0, 1].
    Idle GPUs are always worth using (serving holds the GPUs it needs through its own reservations);
    CPUs only when serving is not busy, since on CPU the trainer and the engine compete for the same cores.
    """
    gpus = sum(math.floor(n.get("GPU", 0.0) + 1e-9) for n in nodes)
    if gpus >= 1:
        return {"num_workers": min(gpus, max_workers), "use_gpu": True}
    if serve_load >= busy_load:
        return None
    cpus = sum(math.floor(n.get("CPU", 0.0) / cpus_per_worker + 1e-9) for n in nodes)
    if cpus >= 1:
        return {"num_workers": min(cpus, max_workers), "use_gpu": False, "cpus_per_worker": cpus_per_worker}
    return None


def idle_per_node() -> list[dict]:
    """Each live node's available resources. Ray has this only as a DeveloperAPI in ray._private.state
    (ray.util.tpu uses it the same way); ray.available_resources() sums over nodes."""
    from ray._private.state import available_resources_per_node

    return list(available_resources_per_node().values())


TRAIN_CONTROLLER = ("ray.train.", "TrainController")  # Ray Train v2's controller actor: module prefix, class


def orphaned_train_reservations(job_id: str | None = None, creator: tuple[str, str] = TRAIN_CONTROLLER) -> list[str]:
    """Placement groups (hex ids) that a Ray Train job reserved and nothing will ever use or free: their
    creator, the job's TrainController, is dead, so its worker group is too. A Train reservation lives
    as long as the Ray job that made the detached distill controller (the `serve run`), not as long as
    the controller: one killed mid-job (OOM, its node, an operator) left its job's reservation holding the
    idle CPUs or GPUs for good, and its restarted self never trained again. Ray Train's own cleaner
    misses it when the kill comes before the workers started, or without the dashboard's state API.
    job_id (hex): only groups that Ray job created (the controller's own: another application's, or
    another tenant's actor of the same name, is not this controller's to free). creator: the creator's
    module prefix and class; Ray Train v1 reserves from the distill controller itself, which a restart
    keeps alive, so its groups are never found. The creator's fields are not in
    ray.util.placement_group_table(): read from the control store's records, as idle_per_node does."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    Group = gcs_pb2.PlacementGroupTableData
    live = {Group.PENDING, Group.PREPARED, Group.CREATED, Group.RESCHEDULING}
    accessor = state._connect_and_get_accessor()
    out = []
    for raw in accessor.get_placement_group_table():
        pg = Group.FromString(raw)
        if pg.is_detached or pg.state not in live or not pg.creator_actor_dead or ray.ActorID(pg.creator_actor_id).is_nil():
            continue  # kept; or removed; or its creator lives; or a driver's or a task's
        if job_id is not None and pg.creator_job_id.hex() != job_id:
            continue
        info = accessor.get_actor_info(ray.ActorID(pg.creator_actor_id))
        actor = gcs_pb2.ActorTableData.FromString(info) if info else None
        fn = actor.function_descriptor.python_function_descriptor if actor else None
        if (actor and actor.state == gcs_pb2.ActorTableData.DEAD and fn.class_name == creator[1]
                and fn.module_name.startswith(creator[0])):
            out.append(pg.placement_group_id.hex())
    return out


def free_orphaned_train_reservations(job_id: str | None = None, creator: tuple[str, str] = TRAIN_CONTROLLER) -> list[str]:
    """Removes orphaned_train_reservations(job_id, creator); returns the ids removed."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    freed = []
    for pg_id in orphaned_train_reservations(job_id, creator):
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
            freed.append(pg_id)
        except Exception:  # noqa: BLE001  removed meanwhile (Ray Train's own cleaner): nothing left to free
            continue
    return freed


def collective_timeout_s(train_cfg: dict) -> int:
    """How long a collective waits before it fails the job: the time limit, never under COLLECTIVE_FLOOR_S
    (the first agree() also waits for the slowest worker's set-up: its draft load and record fetch)."""
    return max(COLLECTIVE_FLOOR_S, math.ceil(train_cfg.get("time_limit_s") or 1800))


def stale_run_age_s(train_cfg: dict) -> float:
    """How old a run folder (ray_train/distill-<start ns>) must be to belong to a job no longer running:
    past its time limit and its workers' set-up (the collective timeout), twice over."""
    return 2 * ((train_cfg.get("time_limit_s") or 1800) + collective_timeout_s(train_cfg))


def remove_stale_runs(storage: str | os.PathLike, older_than_s: float) -> list[str]:
    """Removes run folders (a full draft's checkpoint each) started over older_than_s ago, which a job
    killed with its controller left: run_train_job removes its own when it returns. By age, not all at a
    restart: another cluster's controller sharing versions_dir (a zero-downtime upgrade) may be running
    one. Returns the names removed."""
    removed = []
    for run in Path(storage).glob("distill-*"):
        try:
            started = int(run.name.removeprefix("distill-")) / 1e9
        except ValueError:
            continue
        if time.time() - started > older_than_s:
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run.name)
    return removed


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: its share of the records, gradients all-reduced across workers."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from osd_serve.distill.trainer import DistillTrainer, TrainConfig, any_rank

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device() if config["use_gpu"] else torch.device("cpu")
    draft = AutoModelForCausalLM.from_pretrained(config["draft_path"]).to(device)
    draft.load_state_dict(load_file(config["state_path"]), strict=False)
    records = ray.get(config["record_refs"][rank::world])  # its share only: each fetch copies a record to this node

    def all_reduce(params):
        if world > 1:
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world

    trainer = DistillTrainer(draft, TrainConfig(**config["train"]), grad_hook=all_reduce,
                             agree=lambda late: any_rank(late, device))
    losses = trainer.train(records, steps=config["steps"])
    metrics = {"steps": len(losses), "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
               "time_limited": trainer.time_limited}
    if rank == 0:
        state = {n: t.cpu() for n, t in trainer.serving_state().items()}
        del trainer  # the student and its optimizer: the guard's candidate takes their memory
        if config.get("guard") is not None:
            try:
                held = ray.get(config["held_refs"])
                metrics["verdict"] = guard_candidate(draft, state, held, config["guard"], metrics["steps"])
            except Exception as e:  # noqa: BLE001  (out of memory): refused and said, not a failed job retrained every back-off
                metrics["verdict"] = {"publish": False, "reason": f"the guard failed: {e!r}", "candidate": {}, "serving": {},
                                      "device": str(device)}
        with tempfile.TemporaryDirectory() as d:
            save_file(state, os.path.join(d, "draft.safetensors"))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
    else:
        ray.train.report(metrics)


def guard_candidate(serving, state: dict, held: list, guard: dict, steps: int) -> dict:
    """The publish guard (osd_serve/distill/guard.py), run by rank 0 on the job's device: the candidate
    against ``serving`` (the draft the job started from, which the trainer never changes: it trains a copy).
    Here, not in the controller, which loaded the draft twice and scored both on the CPU serving uses.
    held: the guard samples (ReplayRecords). Returns the verdict as data (guard.Verdict's fields and the
    device), for the job's metrics."""
    import copy

    from osd_serve.distill.guard import GuardConfig, check

    candidate = copy.deepcopy(serving)
    candidate.load_state_dict(state, strict=False)
    vocab = serving.get_output_embeddings().weight.shape[0]
    verdict = check(candidate, serving, held, vocab, GuardConfig(**guard), candidate_state=state,
                    steps_taken=steps)
    return {"publish": verdict.publish, "reason": verdict.reason, "candidate": verdict.candidate,
            "serving": verdict.serving, "device": str(next(serving.parameters()).device)}


def _fail_fast(failure_config):
    try:
        return failure_config(controller_failure_limit=0)
    except TypeError:  # Ray Train v1 (RAY_TRAIN_V2_ENABLED=0) has no such limit, and does not retry by default
        return failure_config()


def run_train_job(plan: dict, record_refs: list, draft_path: str, state_path: str, train_cfg: dict, steps: int,
                  storage: str, held_refs: list | None = None, guard: dict | None = None) -> tuple[dict, dict]:
    """One Ray Train TorchTrainer run; returns the trained serving state (names of the draft) and rank
    0's metrics (steps taken, first and last loss). guard: GuardConfig's fields, and held_refs the guard
    samples it scores on: rank 0 guards the candidate (guard_candidate), its verdict in metrics["verdict"]."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from safetensors.torch import load_file

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"record_refs": record_refs, "draft_path": draft_path, "state_path": state_path,
                           "train": train_cfg, "steps": steps, "use_gpu": plan["use_gpu"],
                           "held_refs": held_refs, "guard": guard},
        # A collective that waits this long (a worker hung, or gone without Ray noticing) fails the job:
        # torch's default is 30 minutes, in which the controller trains nothing else. A floor: a short
        # limit failed every job of a healthy multi-worker group.
        torch_config=TorchConfig(timeout_s=collective_timeout_s(train_cfg)),
        scaling_config=ScalingConfig(num_workers=plan["num_workers"], use_gpu=plan["use_gpu"],
                                     resources_per_worker=None if plan["use_gpu"] else {"CPU": plan["cpus_per_worker"]}),
        # controller_failure_limit=0: Ray Train's default (-1) retried a worker group that could not start
        # (the planned idle capacity taken by serving meanwhile) forever, and fit() never returned. Failed
        # here, the job is re-planned after the controller's back-off.
        run_config=RunConfig(storage_path=storage, name=(name := f"distill-{time.time_ns()}"),
                             failure_config=_fail_fast(FailureConfig)),
    )
    try:
        result = trainer.fit()
        with result.checkpoint.as_directory() as d:
            return load_file(str(Path(d) / "draft.safetensors")), dict(result.metrics or {})
    finally:  # the state is returned (and published through the store) or the job failed: a full draft per run otherwise
        shutil.rmtree(Path(storage) / name, ignore_errors=True)
