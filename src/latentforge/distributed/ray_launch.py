"""``latentforge train --ray``: the same ``train()`` run by Ray Train workers, restarted on failure.

Each Ray Train worker (a ``TorchTrainer`` worker with the gloo or NCCL process group Ray set up)
calls :func:`latentforge.train.run.train` with ``resume="auto"``, exactly as a plain process or
torchrun would; :func:`latentforge.distributed.env.init_world` picks up Ray's process group. The
trainer never imports Ray.

Checkpoints: the run directory is the source of truth. It must be on a filesystem every worker
sees (on one machine it is; on a cluster an NFS/Lustre/EFS mount): rank 0 writes the checkpoints
there and every rank reads them on resume. After each complete checkpoint the ``on_checkpoint``
hook reports it to Ray at once (``ray.train.report``), so that Ray's record is never behind the
run directory. When a worker dies, ``FailureConfig(max_failures=K)`` restarts the whole worker
group, and each worker resumes from the newest complete checkpoint in the run directory.

What is reported depends on ``storage``:

- a local or shared path (default ``RUN_DIR/ray``): a pointer (step and path of the checkpoint,
  a few bytes), since the checkpoint itself is already on shared storage;
- ``s3://bucket/prefix``: the checkpoint directory itself, which Ray uploads (synchronously,
  before training goes on). A restarted worker group whose run directory lacks that checkpoint
  (a new node, a lost disk) has rank 0 download it into ``RUN_DIR/checkpoints`` first.

Interrupts: the driver (the ``latentforge train --ray`` process) handles SIGINT, SIGTERM and
``train.interrupt.extra_signal`` by creating ``RUN_DIR/STOP_REQUEST``; every worker's trainer
looks for it (Ray runs the training loop in a thread, which cannot install signal handlers), the
ranks agree, finish the step, save a checkpoint and return, and the command exits with code 75
as a plain run does. The file is removed when the next run starts.

Connecting to Ray or starting a local instance is ``distributed/ray_cluster.py``'s.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from latentforge import checkpoint as ckpt
from latentforge import storage
from latentforge.distributed.ray_cluster import RayConfig, ray_session
from latentforge.distributed.ray_data import OnlineSource
from latentforge.errors import UserError

log = logging.getLogger(__name__)

POINTER = "latentforge_checkpoint.json"  # the file of a pointer checkpoint reported to Ray
STOP_FILE = "STOP_REQUEST"  # created in the run directory by the driver on a signal
# Test hook, read by the driver and handed to the workers: "RANK:STEP:MARKER" makes rank RANK exit
# abruptly right after reporting checkpoint STEP, once (MARKER is created first, so the restarted
# worker does not exit again).
FAIL_ENV = "LATENTFORGE_RAY_FAIL_AFTER_CHECKPOINT"

def resources_per_worker(cfg: RayConfig, cluster: dict[str, float], actors_per_worker: int = 0) -> dict[str, float]:
    """CPU and GPU of each worker (see the fields' help). ``actors_per_worker``: online encoder
    actors each worker starts; on a local instance they get the same CPU share as a worker."""
    gpus = cfg.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if cluster.get("GPU", 0) > 0 else 0.0
    cpus = cfg.cpus_per_worker
    if cpus is None:
        processes = cfg.num_workers * (1 + actors_per_worker)
        cpus = 1.0 if cfg.address else min(1.0, max(0.05, (cluster.get("CPU", 1) - 0.25) / processes))
    out = {"CPU": cpus}
    if gpus:
        out["GPU"] = gpus
    return out


# ---------------------------------------------------------------------------------------------
# Inside a Ray Train worker


def _report(ray_train: Any, path: Path, step: int, is_main: bool, upload: bool) -> None:
    """Report checkpoint ``step`` to Ray from every rank (``report`` is a barrier): rank 0 hands
    over the checkpoint (uploaded) or a pointer to it, the others only the step."""
    metrics = {"step": step}
    if not is_main:
        ray_train.report(metrics)
        return
    if upload:
        ray_train.report(metrics, checkpoint=ray_train.Checkpoint.from_directory(str(path)))
        return
    with tempfile.TemporaryDirectory(prefix="lf-pointer-") as tmp:
        Path(tmp, POINTER).write_text(json.dumps({"step": step, "path": str(path)}))
        ray_train.report(metrics, checkpoint=ray_train.Checkpoint.from_directory(tmp))


def _maybe_fail(spec: str | None, rank: int, step: int) -> None:
    if not spec:
        return
    fail_rank, fail_step, marker = spec.split(":", 2)
    if int(fail_rank) == rank and int(fail_step) == step and not os.path.exists(marker):
        Path(marker).write_text(f"rank {rank} exited after checkpoint {step}\n")
        os._exit(1)


def _restore_uploaded(ray_train: Any, run_dir: Path) -> None:
    """If Ray's newest checkpoint (uploaded to S3) is newer than the run directory's, download it
    into ``RUN_DIR/checkpoints`` (temp name, then rename: complete or absent)."""
    reported = ray_train.get_checkpoint()
    if reported is None:
        return
    with reported.filesystem.open_input_stream(f"{reported.path}/{ckpt.META}") as f:
        step = int(json.loads(f.read())["step"])
    latest = ckpt.find_latest(run_dir)
    if latest is not None and json.loads((latest / ckpt.META).read_text())["step"] >= step:
        return
    final = run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(step)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    reported.to_directory(str(tmp))
    if final.exists():  # unusable (resume=auto skipped it), but not ours to delete: moved aside
        log.warning("%s is not a usable checkpoint: kept as %s", final, ckpt.keep_aside(final))
    os.rename(tmp, final)
    log.info("restored checkpoint %s from %s", final, reported.path)


def worker_loop(config: dict[str, Any]) -> None:
    """The function every Ray Train worker runs."""
    import ray.train as ray_train
    import torch.distributed as dist

    from latentforge.config import from_dict
    from latentforge.distributed.env import close_world, init_world
    from latentforge.train.run import RunConfig, train

    run_cfg = from_dict(RunConfig, config["run"])
    run_dir = Path(config["run_dir"])
    source = None
    if config.get("online"):
        from latentforge.data.encode import EncodeConfig

        online = config["online"]
        source = OnlineSource(from_dict(EncodeConfig, online["encode"]), online["num_actors"],
                              from_dict(RayConfig, online["ray"]))
    upload = bool(config["upload"])
    world = init_world(run_cfg.train.device)
    try:
        if upload:
            if world.is_main:
                _restore_uploaded(ray_train, run_dir)
            if dist.is_initialized():
                dist.barrier()

        def on_checkpoint(path: Path, step: int) -> None:
            _report(ray_train, path, step, world.is_main, upload)
            _maybe_fail(config.get("fail_after_checkpoint"), world.rank, step)

        summary = train(run_cfg, run_dir, resume="auto", progress=False, world=world, on_checkpoint=on_checkpoint,
                        source=source, stop_file=run_dir / STOP_FILE)
        ray_train.report({k: summary[k] for k in ("step", "finished", "seconds", "skipped_steps")})
    finally:
        close_world()


# ---------------------------------------------------------------------------------------------
# The driver


def train_on_ray(run_cfg: Any, run_dir: str | Path, cfg: RayConfig, quiet: bool = False,
                 online: tuple[Any, int] | None = None) -> dict[str, Any]:
    """Run ``train(run_cfg, run_dir, resume="auto")`` on ``cfg.num_workers`` Ray Train workers.
    ``online``: (EncodeConfig, encoder actors per worker) to train on raw shards encoded online.
    Returns ``{"step", "finished", "seconds"}``, read from the run directory's newest checkpoint."""
    import time

    from latentforge.config import to_dict
    from latentforge.train.run import latent_meta
    from latentforge.train.trainer import phase_batches, phase_num_steps

    cfg.validate()
    if storage.is_s3(str(run_dir)):
        raise UserError(f"{run_dir}: the run directory must be a shared filesystem path; put --storage on S3")
    run_dir = Path(run_dir).expanduser().resolve()  # workers may start in another directory
    # Config errors are found here: in a worker they would be retried max_failures times.
    source = None
    if online is not None:

        source = OnlineSource(online[0], online[1], cfg)
    latent_meta(run_cfg.train, source)
    total_steps = sum(phase_num_steps(run_cfg.train, phase_batches(run_cfg.train, cfg.num_workers)))
    store = cfg.storage or str(run_dir / "ray")
    upload = storage.is_s3(store)
    run_dir.mkdir(parents=True, exist_ok=True)
    stop_file = run_dir / STOP_FILE
    stop_file.unlink(missing_ok=True)  # a request of an earlier run was answered by its checkpoint

    from latentforge.interrupt import StopOnSignal

    started = time.perf_counter()
    stop = StopOnSignal(run_cfg.train.interrupt, what="train --ray", on_signal=stop_file.touch)
    with ray_session(cfg, run_dir, quiet) as ray, stop:
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        per_worker = resources_per_worker(cfg, ray.cluster_resources(), online[1] if online else 0)
        online_config = None
        if online is not None:  # CPU actors beside each worker (a GPU each could starve the workers)
            actors = replace(cfg, cpus_per_worker=cfg.cpus_per_worker or per_worker["CPU"], gpus_per_worker=0.0)
            online_config = {"encode": to_dict(online[0]), "num_actors": online[1], "ray": to_dict(actors)}
        trainer = TorchTrainer(
            worker_loop,
            train_loop_config={"run": to_dict(run_cfg), "run_dir": str(run_dir), "upload": upload,
                               "fail_after_checkpoint": os.environ.get(FAIL_ENV), "online": online_config},
            scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu="GPU" in per_worker,
                                         resources_per_worker=per_worker),
            run_config=RunConfig(
                name="latentforge",
                storage_path=store,
                failure_config=FailureConfig(max_failures=cfg.max_failures),
                # Pointers are tiny; uploaded checkpoints follow the run's own retention.
                checkpoint_config=CheckpointConfig(
                    num_to_keep=run_cfg.train.checkpoint.keep_last if upload else None),
            ),
        )
        try:
            trainer.fit()
        except Exception as e:  # TrainingFailedError: a worker failed more than max_failures times
            text = str(e).strip()
            raise UserError(f"Ray Train failed after {cfg.max_failures} restart(s) "
                            f"({text.splitlines()[-1] if text else type(e).__name__}); the newest complete "
                            f"checkpoint in {run_dir} is kept: rerun to resume") from None
    latest = ckpt.find_latest(run_dir)
    step = json.loads((latest / ckpt.META).read_text())["step"] if latest is not None else 0
    stop_file.unlink(missing_ok=True)
    return {"step": step, "finished": step >= total_steps, "seconds": time.perf_counter() - started,
            "interrupted": stop.signal_name if step < total_steps else None}
