"""A signal stops training after the current step with a complete checkpoint, exit code 75, and
the rerun of the same command ends bitwise equal to an uninterrupted run.

The interrupted runs are real ``latentforge`` processes (subprocesses on one rank, forked gloo
ranks on two); ``interrupt_hooks.py`` makes each process send itself the signals at an exact
point (inside a step's forward pass, before the first step, in the middle of a checkpoint
write), so that what is tested is the command's own handling of a kernel-delivered signal, not
a race. The references are uninterrupted runs of the same configuration: in this process for
one rank (as in test_trainer.py), forked ranks for two.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import latentforge
from latentforge import checkpoint as ckpt
from latentforge.config import from_dict
from latentforge.errors import ConfigError, UserError
from latentforge.interrupt import EXIT_INTERRUPTED, InterruptConfig, StopOnSignal
from latentforge.train.run import RunConfig, train
from latentforge.train.trainer import TrainConfig
from latent_fixtures import latent_data  # noqa: F401  (session fixture)
from test_trainer import STEPS, assert_same_run, checkpoint_steps, metrics, run_config

HOOKS = str(Path(__file__).with_name("interrupt_hooks.py"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(latentforge.__file__).parents[1])}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(latent_data, tmp_path_factory, one_thread):  # noqa: F811
    """The recipe file and the uninterrupted one-rank reference run (checkpoints every 4 steps)."""
    root = tmp_path_factory.mktemp("interrupt")
    cfg = run_config(latent_data)
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"train": cfg["train"], "loader": cfg["data"]}))
    straight = root / "straight"
    summary = train(from_dict(RunConfig, cfg), straight, progress=False)
    assert summary["finished"] and summary["interrupted"] is None
    return {"recipe": recipe, "straight": straight, "cfg": cfg}


def latentforge_train(spec: str, run_dir: Path, recipe: Path, *extra: str) -> subprocess.CompletedProcess:
    """``latentforge train RUN --recipe R --quiet`` in a subprocess, with the signals of ``spec``."""
    cmd = [sys.executable, HOOKS, spec, "train", str(run_dir), "--recipe", str(recipe), "--quiet", *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)


def assert_stopped_at(p: subprocess.CompletedProcess, run_dir: Path, step: int, signal_name: str) -> None:
    """Exit code 75, the one line naming the step saved, and that step's checkpoint complete."""
    assert p.returncode == EXIT_INTERRUPTED, p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith(f"train: interrupted by {signal_name}: saved step {step} -> {run_dir}; "
                           "rerun the same command to resume"), p.stdout + p.stderr[-3000:]
    latest = ckpt.find_latest(run_dir)
    assert ckpt.load_checkpoint(latest).step == step  # complete: every file's sha256 checked
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, step + 1))
    assert not [d for d in (run_dir / ckpt.CHECKPOINTS).iterdir() if "." in d.name]  # no leftovers


# Slow (the longest default test: several CLI runs); the default set keeps signals at fixed points
# here and SIGKILL at seeded random points (tests/test_trainer.py::test_sigkill_at_random_points_resumes_bitwise).
@pytest.mark.slow
def test_signals_at_random_steps_then_reruns_are_bitwise_exact(setup, tmp_path):
    """SIGTERM in the middle of a random step, then SIGUSR1 (the default extra signal, SLURM's
    warning) in a later random step of the rerun: each run finishes its step, saves it and exits
    75; the third run finishes, equal bit for bit to the uninterrupted run (every logged record,
    final model and EMA). The reruns print where they resumed, although --quiet."""
    rng = random.Random(16)
    first = rng.randint(1, STEPS - 2)
    second = rng.randint(first + 1, STEPS - 1)
    run_dir = tmp_path / "run"

    p = latentforge_train(f"step={first}:SIGTERM", run_dir, setup["recipe"])
    assert_stopped_at(p, run_dir, first, "SIGTERM")
    assert "SIGTERM received" in p.stderr

    p = latentforge_train(f"step={second}:SIGUSR1", run_dir, setup["recipe"])
    assert f"resuming from {run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_dir_name(first)}" in p.stdout
    assert_stopped_at(p, run_dir, second, "SIGUSR1")

    p = latentforge_train("", run_dir, setup["recipe"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1].startswith(f"train: finished at step {STEPS}")
    assert_same_run(setup["straight"], run_dir)


@pytest.mark.slow  # the default suite keeps under 15 minutes; this test took 12-49 s on a quiet machine
def test_sigterm_before_the_first_step(setup, tmp_path):
    """A signal during set-up stops before any step: exit 75, nothing saved, no metrics."""
    run_dir = tmp_path / "run"
    p = latentforge_train("start:SIGTERM", run_dir, setup["recipe"])
    assert p.returncode == EXIT_INTERRUPTED, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1].startswith("train: interrupted by SIGTERM: nothing to save at step 0")
    assert ckpt.find_latest(run_dir) is None and not (run_dir / "metrics.jsonl").exists()
    # (the rerun starts from step 0 like any first run: not run again here, the tests are slow enough)


def test_sigterm_during_a_checkpoint_write(setup, tmp_path):
    """SIGTERM right after model.safetensors of the periodic step-4 checkpoint is written (before
    its other files and its marker): the write is not broken off, the checkpoint is complete, and
    the run stops there without writing it twice."""
    run_dir = tmp_path / "run"
    p = latentforge_train("save=1:SIGTERM", run_dir, setup["recipe"])
    assert_stopped_at(p, run_dir, STEPS // 2, "SIGTERM")
    assert checkpoint_steps(run_dir) == [STEPS // 2]
    assert "replacing existing checkpoint" not in p.stderr

    p = latentforge_train("", run_dir, setup["recipe"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_run(setup["straight"], run_dir)


@pytest.mark.slow  # the default suite keeps under 15 minutes; this test took 12-49 s on a quiet machine
def test_two_signals_in_a_row_and_one_more_during_the_save(setup, tmp_path):
    """Two SIGINTs (Ctrl-C twice) in step 3, then a SIGTERM in the middle of the stop checkpoint:
    no KeyboardInterrupt, the step-3 checkpoint is complete, and the rerun is exact."""
    run_dir = tmp_path / "run"
    p = latentforge_train("step=3:SIGINT,SIGINT;save=1:SIGTERM", run_dir, setup["recipe"])
    assert_stopped_at(p, run_dir, 3, "SIGINT")
    assert "SIGINT received again: already stopping" in p.stderr
    assert "SIGTERM received again: the checkpoint is being written" in p.stderr
    assert "Traceback" not in p.stderr

    p = latentforge_train("", run_dir, setup["recipe"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_run(setup["straight"], run_dir)


@pytest.mark.slow  # the default suite keeps under 15 minutes; this test took 12-49 s on a quiet machine
def test_save_on_signal_off_leaves_the_signal_its_default_action(setup, tmp_path):
    """train.interrupt.save_on_signal=false: SIGTERM ends the process at once, nothing is saved."""
    run_dir = tmp_path / "run"
    p = latentforge_train("step=3:SIGTERM", run_dir, setup["recipe"], "train.interrupt.save_on_signal=false")
    assert p.returncode == -signal.SIGTERM
    assert ckpt.find_latest(run_dir) is None


# ------------------------------------------------------------------------------------- 2 ranks


def _rank_main(rank: int, world_size: int, port: int, spec: str, args: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import interrupt_hooks

    from latentforge.cli import main

    interrupt_hooks.install(spec)
    code = main(args)
    if code:
        sys.exit(code)


def run_ranks(spec: str, args: list[str], world_size: int = 2) -> int:
    """``latentforge ARGS`` on forked gloo ranks with the hooks of ``spec``; the exit code."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_rank_main, args=(world_size, port, spec, args), nprocs=world_size, start_method="fork")
    except mp.ProcessExitedException as e:
        return e.exit_code
    return 0


def test_two_ranks_stop_together_when_only_one_got_the_signal(setup, tmp_path):
    """On 2 ranks (DDP, gloo) only rank 1 receives SIGTERM, in a random step: both ranks finish
    that step, write its checkpoint and exit 75; the rerun equals the uninterrupted 2-rank run
    bit for bit."""
    recipe = setup["recipe"]
    args = lambda run: ["train", str(run), "--recipe", str(recipe), "--quiet"]  # noqa: E731
    reference = tmp_path / "reference"
    assert run_ranks("", args(reference)) == 0
    step = random.Random(2).randint(1, STEPS - 1)
    run_dir = tmp_path / "run"
    assert run_ranks(f"rank=1;step={step}:SIGTERM", args(run_dir)) == EXIT_INTERRUPTED
    assert ckpt.load_checkpoint(ckpt.find_latest(run_dir)).step == step
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, step + 1))
    assert run_ranks("", args(run_dir)) == 0
    assert_same_run(reference, run_dir)


# ------------------------------------------------------------------------------------- config


def test_interrupt_config_is_checked():
    with pytest.raises(ConfigError, match="interrupt.extra_signal: 'SIGNOPE' is not a signal"):
        from_dict(TrainConfig, {"interrupt": {"extra_signal": "SIGNOPE"}}).validate()
    with pytest.raises(ConfigError, match="interrupt.extra_signal: 'KILL'"):
        from_dict(TrainConfig, {"interrupt": {"extra_signal": "KILL"}}).validate()
    assert InterruptConfig(extra_signal="USR2").signals() == [signal.SIGINT, signal.SIGTERM, signal.SIGUSR2]
    assert InterruptConfig(extra_signal="").signals() == [signal.SIGINT, signal.SIGTERM]


def test_handlers_are_restored_and_a_stop_file_stops(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    stop_file = tmp_path / "STOP"
    with StopOnSignal(InterruptConfig(), stop_file=stop_file) as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert not stop.requested
        stop_file.touch()
        assert stop.requested and stop.signal_name == "stop file"
    assert signal.getsignal(signal.SIGTERM) == before


# ------------------------------------------------------------------------------ train-vae, encode


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_train_vae_stops_with_a_checkpoint_and_resumes_exactly(latent_data, tmp_path, optimizer):  # noqa: F811
    """train-vae gets SIGTERM in step 3 of 6 (checkpoints every 4): it finishes the step, saves it,
    exits 75; the rerun (which passes the periodic step-4 checkpoint) writes a VAE equal bit for
    bit to an uninterrupted run's, with the same measured scale factor, and removes its checkpoints.
    With Muon (the demo's VAE optimizer) the momentum buffers and the AdamW group's moments are in
    the checkpoint too."""
    import safetensors.torch

    from latentforge.train.vae import VAETrainConfig, train_vae

    vae = {"data": {"datasets": [{"path": str(latent_data["raw16"])}], "num_workers": 0,
                    "cache_dir": str(latent_data["cache"])},
           "steps": 6, "batch_size": 8, "warmup_steps": 2, "scale_samples": 16, "log_every": 1,
           "checkpoint_every_steps": 4, "optimizer": optimizer,
           "model": {"block_out_channels": [8, 16], "norm_num_groups": 4, "sample_size": 16}}
    reference = train_vae(from_dict(VAETrainConfig, vae), tmp_path / "reference", progress=False)
    recipe = tmp_path / "vae.yaml"
    recipe.write_text(yaml.safe_dump({"vae": vae}))
    out = tmp_path / "vae"
    cmd = [sys.executable, HOOKS, "vae_step=3:SIGTERM", "train-vae", "--out", str(out), "--recipe", str(recipe),
           "--quiet"]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == EXIT_INTERRUPTED, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1].startswith("train-vae: interrupted by SIGTERM: saved step 3")
    assert ckpt.load_checkpoint(ckpt.find_latest(out)).step == 3 and not (out / "config.json").exists()

    cmd[2] = ""
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from" in p.stdout and f"{out}/checkpoints/step-00000003" in p.stdout
    a = safetensors.torch.load_file(tmp_path / "reference" / "diffusion_pytorch_model.safetensors")
    b = safetensors.torch.load_file(out / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed = yaml.safe_load((out / "metrics.json").read_text())
    assert resumed["scaling_factor"] == reference["scaling_factor"] and resumed["steps"] == 6
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in reference["history"]]
    assert not (out / ckpt.CHECKPOINTS).exists()


def test_encode_stops_between_batches_and_the_rerun_completes_it_exactly(latent_data, tmp_path):  # noqa: F811
    """encode (4 raw shards of 16 images, batches of 8) gets SIGTERM in its 3rd batch, the first of
    shard 2: it stops before the next batch with exit 75, shard 1 finished and shard 2 not kept;
    the rerun encodes the rest, and every latent shard equals an uninterrupted encode's."""
    import pyarrow.parquet as pq

    from latentforge.data.encode import EncodeConfig, encode_dataset
    from latentforge.data.schema import INDEX, read_index

    raw = latent_data["raw16"]
    reference = tmp_path / "reference"
    encode_dataset(str(raw), str(reference), EncodeConfig(vae=str(latent_data["vae"]),
                   text_encoder=str(latent_data["bert"]), max_length=8, batch_size=8, device="cpu"), progress=False)
    out = tmp_path / "latents"
    cmd = [sys.executable, HOOKS, "encode_batch=3:SIGTERM", "encode", str(raw), "--vae", str(latent_data["vae"]),
           "--text-encoder", str(latent_data["bert"]), "--out", str(out), "--batch-size", "8", "--quiet",
           "encode.max_length=8", "encode.device=cpu"]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == EXIT_INTERRUPTED, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1].startswith("encode: interrupted by SIGTERM: the finished shards are kept")
    assert "encode: SIGTERM received: stopping after the current batch: the finished shards are kept" in p.stderr
    assert "checkpoint" not in p.stderr  # encode keeps finished shards; it writes no checkpoint
    shards = [s.name for s in read_index(str(raw)).shards]
    assert sorted(f.name for f in out.glob("*.parquet")) == [shards[0]]
    assert sorted(f.name for f in (out / ".progress").glob("shard-*.json")) == [shards[0] + ".json"]
    assert not (out / INDEX).exists()

    cmd[2] = ""
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for name in shards:
        assert pq.read_table(out / name).equals(pq.read_table(reference / name)), name


def test_planned_checkpoint_size_matches_a_real_checkpoint(setup):
    """plan --memory's checkpoint estimate (model + EMA + AdamW moments, 16 bytes/parameter) against
    the files of the reference run's last checkpoint (fp32 tiny U-Net, EMA, AdamW): within 10%.
    The rest is a fixed cost per tensor (safetensors headers, AdamW's pickled step counters), the
    RNG states and meta.json: measured 5.4% of this 250k-parameter model, nothing at real sizes."""
    from latentforge.plan.memory import checkpoint_bytes
    from latentforge.train.memory import MemoryConfig

    latest = ckpt.find_latest(setup["straight"])
    c = ckpt.load_checkpoint(latest)
    parameters = sum(t.numel() for t in c.tensors["model"].values())
    on_disk = sum(f.stat().st_size for f in latest.iterdir() if f.name != ckpt.MARKER)
    planned = checkpoint_bytes(MemoryConfig(ema="same", optimizer="adamw", parallel="ddp"), parameters)
    assert planned == 16 * parameters
    assert 0 < (on_disk - planned) / on_disk < 0.10, (on_disk, planned)


# ------------------------------------------------------------------------------ demo


def test_demo_interrupted_in_training_says_so_and_exits_75(tmp_path):
    """SIGTERM during the demo's U-Net training: the checkpoint is saved, the demo names the
    signal (not a time limit) and exits 75, the requeue code of every long command."""
    from golden import TINY

    out = tmp_path / "demo"
    cmd = [sys.executable, HOOKS, "step=5:SIGTERM", "demo", "--out", str(out), "--quiet", *TINY,
           "vae.steps=20", "train.eval.every_steps=0", "train.val.every_steps=0"]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == EXIT_INTERRUPTED, p.stderr[-3000:]
    assert ("demo: interrupted by SIGTERM at step 5 of the training; rerun the same command to go on"
            in p.stdout.splitlines()), p.stdout[-2000:]
    assert "train.max_seconds" not in p.stdout + p.stderr
    assert checkpoint_steps(out / "run") == [5] and not (out / "results.json").exists()


def test_the_demo_stopped_in_its_vae_or_encode_stage_exits_75_and_the_rerun_goes_on_from_there(tmp_path):
    """SIGTERM in the demo's VAE training: its checkpoint is kept and the demo exits 75 with one line
    (it used to read the missing metrics, a traceback, and the rerun started the VAE over). The rerun
    resumes that checkpoint; SIGTERM while encoding stops the demo there too (it used to go on to the
    judge and fail in training on a dataset without an index). A rerun whose VAE settings differ from
    the finished VAE's is refused in one line (it used to reuse that VAE under the new recipe)."""
    from golden import TINY

    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--quiet", *TINY, "vae.steps=20", "encode.batch_size=16",
            "train.eval.every_steps=0", "train.val.every_steps=0"]
    p = subprocess.run([sys.executable, HOOKS, "vae_step=5:SIGTERM", *args], env=ENV, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == EXIT_INTERRUPTED, p.stderr[-3000:]
    assert p.stdout.splitlines()[-1] == ("demo: interrupted by SIGTERM at step 5 of the VAE's training; "
                                         "rerun the same command to go on"), p.stdout[-2000:]
    assert ckpt.load_checkpoint(ckpt.find_latest(out / "vae")).step == 5 and not (out / "latents").exists()

    p = subprocess.run([sys.executable, HOOKS, "encode_batch=1:SIGTERM", *args], env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == EXIT_INTERRUPTED, p.stderr[-3000:]
    assert f"resuming from {out}/vae/checkpoints/step-00000005" in p.stdout.splitlines()
    assert p.stdout.splitlines()[-1] == "demo: interrupted by SIGTERM while encoding; rerun the same command to go on"
    assert (out / "vae" / "metrics.json").is_file() and not (out / "vae" / ckpt.CHECKPOINTS).exists()
    assert not (out / "judge").exists() and not (out / "latents" / "index.json").exists()

    p = subprocess.run([sys.executable, HOOKS, "", *args, "vae.lr=1e-3"], env=ENV, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip() == (f"latentforge: error: {out}/vae: holds a VAE trained with another lr "
                                "(train_vae_config.yaml); use another --out or delete it")


def test_one_demo_at_a_time_in_a_directory_and_a_killed_one_leaves_no_lock(tmp_path, capsys):
    """Two demos (or a demo and a rescore) in one directory would write the same files: the second stops
    with one line naming the process that holds the directory. The lock is a flock, so a process killed
    with SIGKILL leaves none behind."""
    from latentforge.cli import main
    from latentforge.storage import directory_lock

    out = tmp_path / "demo"
    with directory_lock(out, "latentforge demo"):
        assert main(["demo", "--out", str(out), "--quiet", "synth.num=10"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"latentforge: error: {out}: another latentforge demo is working in this directory (process {os.getpid()}); "
            "wait for it to end, or use another directory")
        for name in ("recipe.yaml", "export/model_index.json", "export/latentforge_export.json",
                     "synth/labels.jsonl"):  # a finished demo, as rescore sees it
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_text("name: tiny-cpu\n" if name == "recipe.yaml" else "")
        assert main(["demo", "--out", str(out), "--rescore", "2"]) == 2
        assert "another latentforge demo is working in this directory" in capsys.readouterr().err
    assert not list(out.glob("synth/*.png"))  # the refused demo wrote nothing

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom latentforge.storage import directory_lock\n"
                               f"with directory_lock({str(out)!r}, 'x'):\n    print('held', flush=True)\n    time.sleep(60)"],
                              env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"another x is working .*\(process {holder.pid}\)"):
            with directory_lock(out, "x"):
                pass
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with directory_lock(out, "x"):  # SIGKILL released it
        pass


def test_one_training_at_a_time_in_a_run_directory(setup, tmp_path, capsys, caplog, monkeypatch):
    """A second ``train`` (or a requeued job while the first still runs) in a run directory stops in one line
    before it writes there; the lock file alone does not make the directory a foreign one; on a filesystem
    without flock the command goes on, with a warning."""
    from latentforge.cli import main
    from latentforge.storage import directory_lock, refuse_foreign_dir

    run = tmp_path / "run"
    with directory_lock(run, "latentforge train"):
        assert main(["train", str(run), "--recipe", str(setup["recipe"]), "--quiet"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"latentforge: error: {run}: another latentforge train is working in this directory (process {os.getpid()}); "
            "wait for it to end, or use another directory")
    assert [p.name for p in run.iterdir()] == [".latentforge.lock"]
    refuse_foreign_dir(run, ("train_config.yaml", "checkpoints"), "training run")  # not refused

    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with caplog.at_level("WARNING", logger="latentforge.storage"), directory_lock(run, "latentforge train"):
        pass
    assert "cannot lock it (Function not implemented): going on without the check" in caplog.text


def test_each_stage_command_stops_in_a_directory_a_demo_holds(latent_data, setup, tmp_path, capsys):  # noqa: F811
    """The demo holds the directories of its ingest, VAE, encode and training stages (OUT/raw, OUT/vae,
    OUT/latents, OUT/run) as well as OUT: `latentforge ingest`, `train-vae`, `encode` or `train` into one of
    them meanwhile stops in one line naming the demo and its process, after its checks and before it
    writes there. A refused setting is still named first and leaves no directory behind."""
    from PIL import Image

    from latentforge.cli import main
    from latentforge.storage import LOCK_FILE, directory_lock

    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        Image.new("RGB", (32, 32), (40 * i, 10, 200)).save(src / f"{i}.png")
        (src / f"{i}.txt").write_text(f"a shape number {i}")
    vae_recipe = tmp_path / "vae.yaml"
    vae_recipe.write_text(yaml.safe_dump({"vae": {
        "steps": 2, "batch_size": 8, "data": {"num_workers": 0, "cache_dir": str(latent_data["cache"])},
        "model": {"block_out_channels": [8, 16], "norm_num_groups": 4, "sample_size": 16}}}))
    commands = {
        "raw": ["ingest", str(src), "--out", "{d}", "--quiet", "ingest.filters.min_side=16",
                "ingest.image.resolution=32"],
        "vae": ["train-vae", str(latent_data["raw16"]), "--out", "{d}", "--recipe", str(vae_recipe), "--quiet"],
        "latents": ["encode", str(latent_data["raw16"]), "--vae", str(latent_data["vae"]), "--text-encoder",
                    str(latent_data["bert"]), "--out", "{d}", "--quiet", "encode.max_length=8", "encode.device=cpu"],
        "run": ["train", "{d}", "--recipe", str(setup["recipe"]), "--quiet"],
    }
    for name, cmd in commands.items():
        d = tmp_path / "demo" / name
        with directory_lock(d, "latentforge demo"):
            assert main([c.format(d=d) for c in cmd]) == 2, name
            assert capsys.readouterr().err.strip() == (
                f"latentforge: error: {d}: another latentforge demo is working in this directory "
                f"(process {os.getpid()}); wait for it to end, or use another directory"), name
        assert [p.name for p in d.iterdir()] == [LOCK_FILE], name  # nothing written beside the demo
        assert main([c.format(d=d) for c in cmd]) == 0, name  # the lock file alone is no foreign content

    # A refused setting is named before the lock is asked for: the new directory is not even created.
    d = tmp_path / "refused-vae"
    assert main(["train-vae", str(latent_data["raw16"]), "--out", str(d), "--recipe", str(vae_recipe), "--quiet",
                 "vae.model.sample_size=32"]) == 2
    assert "sample_size: 32 != the dataset's resolution 16" in capsys.readouterr().err and not d.exists()
