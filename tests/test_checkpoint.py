"""Checkpoints: atomic writes, completeness, retention, safe loading, RNG capture, exact resume."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import random
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from latentforge import checkpoint as ckpt
from latentforge.checkpoint import (
    clean_state_dict_keys,
    find_latest,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from latentforge.errors import UserError
from latentforge.train.ema import EMA, EMAConfig
from latentforge.train.optim import OptimConfig, build_lr_scheduler, build_optimizer, clip_grad_norm
from latentforge.train.rng import (
    generator_state,
    make_generator,
    rng_state,
    set_generator_state,
    set_rng_state,
)


def _save(run: Path, step: int, keep_last: int = 0, keep_every: int = 0, value: float | None = None) -> Path:
    value = float(step) if value is None else value
    return save_checkpoint(
        run, step,
        tensors={"model": {"w": torch.full((3, 2), value)}},
        state={"step_tensor": torch.tensor(step)},
        meta={"phase_index": 0},
        keep_last=keep_last, keep_every=keep_every,
    )


def _steps(run: Path) -> list[int]:
    return sorted(s for s, _ in ckpt._complete_checkpoints(run / "checkpoints", warn=False))


def test_round_trip_layout_and_shared_tensors(tmp_path):
    weight = torch.randn(4, 3)
    model_sd = {
        "embed.weight": weight,
        "head.weight": weight,  # tied: same storage, safetensors would refuse it as is
        "head.bias": torch.randn(4).to(torch.bfloat16),
        "half": weight[:2],  # a view overlapping the tied storage
        "steps": torch.tensor([3, 4], dtype=torch.int64),
    }
    ema_sd = {"embed.weight": torch.randn(4, 3)}
    state = {"optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.99)}]},
             "cursor": [1, 2], "name": "x", "none": None, "dtype": torch.float16}
    path = save_checkpoint(tmp_path, 1200, {"model": model_sd, "ema": ema_sd}, state,
                           {"phase_index": 1, "data_cursor": {"position": 77}}, keep_last=3)
    assert path == tmp_path / "checkpoints" / "step-00001200"
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "ema.safetensors", "meta.json", "model.safetensors", "state.pt"]
    marker = json.loads((path / "COMPLETE").read_text())
    assert marker["files"]["state.pt"]["sha256"] == hashlib.sha256((path / "state.pt").read_bytes()).hexdigest()

    loaded = load_checkpoint(path)
    assert loaded.step == 1200
    assert loaded.meta["phase_index"] == 1 and loaded.meta["data_cursor"] == {"position": 77}
    assert loaded.meta["versions"]["torch"] == torch.__version__
    assert sorted(loaded.tensors["model"]) == sorted(model_sd)  # keys exactly (safetensors sorts them)
    for key, t in model_sd.items():
        assert torch.equal(loaded.tensors["model"][key], t) and loaded.tensors["model"][key].dtype == t.dtype
    assert torch.equal(loaded.tensors["ema"]["embed.weight"], ema_sd["embed.weight"])
    assert loaded.state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert torch.equal(loaded.state["optimizer"]["state"][0]["exp_avg"], torch.ones(2))
    assert loaded.state["cursor"] == [1, 2] and loaded.state["dtype"] == torch.float16


def test_step_is_read_from_meta_not_from_the_name(tmp_path):
    _save(tmp_path, 5)
    newest = _save(tmp_path, 10)
    renamed = newest.with_name("step-00000001")
    os.rename(newest, renamed)
    assert find_latest(tmp_path) == renamed
    assert load_checkpoint(renamed).step == 10


def test_exception_midway_leaves_previous_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001"]
    assert find_latest(tmp_path).name == "step-00000001"


CRASHING_WRITER = textwrap.dedent("""
    import os, sys, torch
    from latentforge.checkpoint import save_checkpoint

    def crash_midway(obj, f, *args, **kwargs):
        f.write(b"half of a state file")
        f.flush()
        os._exit(3)  # a kill: no exception handler, no cleanup

    torch.save = crash_midway
    save_checkpoint(sys.argv[1], 2, {"model": {"w": torch.zeros(2)}}, {}, {}, keep_last=0)
""")


def test_crashed_writer_is_ignored_then_cleaned(tmp_path, caplog):
    _save(tmp_path, 1)
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_WRITER, str(tmp_path)], stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate()
    assert proc.returncode == 3, stderr
    root = tmp_path / "checkpoints"
    leftover = root / f"step-00000002.tmp-{proc.pid}"
    assert leftover.is_dir() and (leftover / "model.safetensors").is_file()
    with caplog.at_level(logging.WARNING, logger="latentforge.checkpoint"):
        assert find_latest(tmp_path) == root / "step-00000001"
    assert f"step-00000002.tmp-{proc.pid}: a checkpoint being written, or left by a crashed writer" in caplog.text
    # A dead writer's directory that even got its marker must not count either.
    complete_but_unrenamed = root / f"step-00000009.tmp-{proc.pid}"
    (root / "step-00000001").rename(complete_but_unrenamed)
    with caplog.at_level(logging.WARNING, logger="latentforge.checkpoint"):
        assert find_latest(tmp_path) is None
    complete_but_unrenamed.rename(root / "step-00000001")

    live = root / f"step-00000004.tmp-{os.getppid()}"  # a live process (pytest's parent): left alone
    live.mkdir()
    _save(tmp_path, 3)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000003", live.name]


def test_incomplete_checkpoints_are_skipped_with_a_warning(tmp_path, caplog):
    good = _save(tmp_path, 1)
    no_marker = _save(tmp_path, 2)
    truncated = _save(tmp_path, 3)
    (no_marker / "COMPLETE").unlink()
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(10)
    with caplog.at_level(logging.WARNING, logger="latentforge.checkpoint"):
        assert find_latest(tmp_path) == good
    assert "step-00000002: no COMPLETE marker" in caplog.text
    assert "step-00000003: model.safetensors has 10 bytes" in caplog.text
    for bad in (no_marker, truncated):
        with pytest.raises(UserError, match="not a complete checkpoint") as e:
            resolve_resume(tmp_path, str(bad))
        assert "\n" not in str(e.value)
        with pytest.raises(UserError, match="not a complete checkpoint"):
            load_checkpoint(bad)


def test_same_size_corruption_is_caught_by_the_checksum(tmp_path):
    path = _save(tmp_path, 1)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    assert find_latest(tmp_path) == path  # sizes still match: the cheap check passes
    with pytest.raises(UserError, match="sha256 does not match"):
        load_checkpoint(path)
    assert not torch.equal(load_checkpoint(path, verify=False).tensors["model"]["w"], torch.ones(3, 2))


class _Exploit:
    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.makedirs, (self.target,))


def test_malicious_pickle_in_state_is_refused(tmp_path):
    path = _save(tmp_path, 1)
    pwned = tmp_path / "pwned"
    torch.save({"optimizer": _Exploit(str(pwned))}, path / "state.pt")
    # The attacker also rewrites the marker, so only weights_only loading stands in the way.
    marker = json.loads((path / "COMPLETE").read_text())
    marker["files"]["state.pt"] = {"num_bytes": (path / "state.pt").stat().st_size,
                                   "sha256": hashlib.sha256((path / "state.pt").read_bytes()).hexdigest()}
    (path / "COMPLETE").write_text(json.dumps(marker))
    with pytest.raises(UserError, match="refusing to load") as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value)
    assert not pwned.exists()


def test_a_plain_pickle_as_state_is_refused_without_torch_warnings(tmp_path):
    """A state file written by pickle itself (not torch.save): the same one-line refusal, and
    nothing else on stderr (torch warns about the pickle protocol before refusing)."""
    path = _save(tmp_path, 1)
    pwned = tmp_path / "pwned"
    with open(path / ckpt.STATE, "wb") as f:
        pickle.dump({"optimizer": _Exploit(str(pwned))}, f, protocol=4)
    vouch(path, ckpt.STATE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UserError, match="refusing to load"):
            load_checkpoint(path)
    assert [str(w.message) for w in caught] == [] and not pwned.exists()


def test_state_that_weights_only_cannot_load_is_rejected_before_writing(tmp_path):
    for bad in ({"lr": np.float64(0.1)}, {"obj": object()}, {"t": {(1, 2): 3}}):
        with pytest.raises(TypeError, match="save_checkpoint: state"):
            save_checkpoint(tmp_path, 1, {"model": {}}, bad, {}, keep_last=0)
    with pytest.raises(TypeError, match="not JSON serializable"):
        save_checkpoint(tmp_path, 1, {"model": {}}, {}, {"when": object()}, keep_last=0)
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path, 1, {"model": {}}, {}, {"step": 3}, keep_last=0)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_retention_keep_last_and_keep_every(tmp_path):
    for step in range(1, 10):
        _save(tmp_path, step, keep_last=2, keep_every=4)
        assert step in _steps(tmp_path)  # never the newest
    assert _steps(tmp_path) == [4, 8, 9]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if "." in p.name]

    other = tmp_path / "keep-all"
    for step in range(1, 4):
        _save(other, step, keep_last=0)
    assert _steps(other) == [1, 2, 3]


def test_resaving_an_earlier_step_replaces_it_and_keeps_later_ones(tmp_path, caplog):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=1)
    assert _steps(tmp_path) == [3]
    _save(tmp_path, 1, keep_last=1)
    with caplog.at_level(logging.WARNING, logger="latentforge.checkpoint"):
        path = _save(tmp_path, 1, keep_last=1, value=-5.0)  # a resumed run passing step 1 again
    assert "replacing existing checkpoint" in caplog.text and "later step" in caplog.text
    assert _steps(tmp_path) == [1, 3]
    assert torch.equal(load_checkpoint(path).tensors["model"]["w"], torch.full((3, 2), -5.0))


def test_non_writer_writes_nothing(tmp_path):
    path = save_checkpoint(tmp_path, 7, {"model": {"w": torch.zeros(1)}}, {}, {}, keep_last=1, is_writer=False)
    assert path == tmp_path / "checkpoints" / "step-00000007"
    assert not (tmp_path / "checkpoints").exists()


def test_resolve_resume(tmp_path):
    assert resolve_resume(tmp_path, "none") is None
    assert resolve_resume(tmp_path, "auto") is None
    _save(tmp_path, 1)
    latest = _save(tmp_path, 2)
    assert resolve_resume(tmp_path, "auto") == latest
    assert resolve_resume(tmp_path, "none") is None
    assert resolve_resume(tmp_path, str(tmp_path / "checkpoints" / "step-00000001")).name == "step-00000001"
    with pytest.raises(UserError, match="no such checkpoint directory"):
        resolve_resume(tmp_path, str(tmp_path / "nope"))
    for whole in (tmp_path, tmp_path / "checkpoints"):
        with pytest.raises(UserError, match=r"a run's directory, not one checkpoint: give one of its checkpoints/"):
            resolve_resume(tmp_path, str(whole))


class _Wrapper(torch.nn.Module):
    """Registers the wrapped model under ``name``, as torch.compile (``_orig_mod``) and DDP
    (``module``) do; importing torch._dynamo just for its key names would cost seconds."""

    def __init__(self, name: str, inner: torch.nn.Module):
        super().__init__()
        self.add_module(name, inner)


def test_clean_state_dict_keys():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    plain = list(model.state_dict())
    ddp_of_compiled = _Wrapper("module", _Wrapper("_orig_mod", model)).state_dict()
    compiled_ddp = _Wrapper("_orig_mod", _Wrapper("module", model)).state_dict()
    assert list(ddp_of_compiled)[0] == "module._orig_mod.0.weight"
    assert list(clean_state_dict_keys(ddp_of_compiled)) == plain
    assert list(clean_state_dict_keys(compiled_ddp)) == plain
    submodule_compiled = {"unet.down._orig_mod.weight": 1, "unet.up.weight": 2}
    assert list(clean_state_dict_keys(submodule_compiled)) == ["unet.down.weight", "unet.up.weight"]
    # A real submodule called "module" next to others keeps its name.
    assert list(clean_state_dict_keys({"module.w": 1, "head.w": 2})) == ["module.w", "head.w"]
    with pytest.raises(ValueError, match="same name"):
        clean_state_dict_keys({"_orig_mod.w": 1, "w": 2})


def _draw() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(())), np.random.normal()


def test_rng_state_round_trips_through_weights_only_load():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    buf = io.BytesIO()
    torch.save(rng_state(), buf)
    expected = _draw()
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    buf.seek(0)
    set_rng_state(torch.load(buf, weights_only=True))
    assert _draw() == expected


def test_generators_per_rank():
    g0, g0_again, g1 = make_generator(7, 0, "cpu"), make_generator(7, 0, "cpu"), make_generator(7, 1, "cpu")
    a = torch.randn(5, generator=g0)
    assert torch.equal(a, torch.randn(5, generator=g0_again))
    assert not torch.equal(a, torch.randn(5, generator=g1))
    assert not torch.equal(torch.randn(5, generator=make_generator(8, 0, "cpu")), a)
    saved = generator_state(g0)
    expected = torch.randn(5, generator=g0)
    set_generator_state(g0, saved)
    assert torch.equal(torch.randn(5, generator=g0), expected)


# ----------------------------------------------------------------------- exact resume, end to end

TOTAL_STEPS = 10


class _Run:
    """A tiny training loop whose every step consumes all the RNGs a real one uses."""

    def __init__(self, init_seed: int):
        torch.manual_seed(init_seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
        self.cfg = OptimConfig(lr=1e-2, warmup_steps=3, schedule="cosine", min_lr_ratio=0.1, grad_clip=0.5)
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg, "cpu")
        self.scheduler = build_lr_scheduler(self.optimizer, self.cfg, TOTAL_STEPS)
        self.ema = EMA(self.model, EMAConfig(decay=0.9, start_step=2, warmup=True))
        self.noise = make_generator(seed=5, rank=0, device="cpu")
        self.step = 0
        self.losses: list[float] = []

    def train_step(self) -> None:
        x = torch.randn(8, 4)  # torch global RNG (like dropout)
        target = torch.randn(8, 2, generator=self.noise)  # the diffusion noise generator
        scale = 1.0 + random.random() + float(np.random.rand())  # python + numpy RNGs (augmentation)
        loss = torch.nn.functional.mse_loss(self.model(x) * scale, target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.ema.update(self.model, self.step)
        self.losses.append(loss.item())
        self.step += 1

    def save(self, run_dir: Path) -> Path:
        ema = self.ema.state_dict()
        return save_checkpoint(
            run_dir, self.step,
            tensors={"model": self.model.state_dict(), "ema": ema["params"]},
            state={"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                   "rng": rng_state(), "noise": generator_state(self.noise), "ema_num_updates": ema["num_updates"]},
            meta={"phase_index": 0},
            keep_last=2,
        )

    def load(self, path: Path) -> None:
        c = load_checkpoint(path)
        self.model.load_state_dict(c.tensors["model"])
        self.optimizer.load_state_dict(c.state["optimizer"])
        self.scheduler.load_state_dict(c.state["scheduler"])
        self.ema.load_state_dict({"params": c.tensors["ema"], "num_updates": c.state["ema_num_updates"]})
        set_rng_state(c.state["rng"])
        set_generator_state(self.noise, c.state["noise"])
        self.step = c.step


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(0)
    straight = _Run(init_seed=1)
    for _ in range(TOTAL_STEPS):
        straight.train_step()

    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(0)
    first = _Run(init_seed=1)
    for _ in range(4):
        first.train_step()
    first.save(tmp_path)
    for _ in range(2):  # work lost in the "crash"
        first.train_step()

    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(123)  # a new process starts from other RNG states
    resumed = _Run(init_seed=2)
    resumed.load(resolve_resume(tmp_path, "auto"))
    assert resumed.step == 4
    for _ in range(TOTAL_STEPS - 4):
        resumed.train_step()

    assert resumed.losses == straight.losses[4:]
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(resumed.ema.shadow, straight.ema.shadow):
        assert torch.equal(a, b)
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]


# ---------------------------------------------------------------------- trusted only after checks


def vouch(step_dir: Path, *names: str) -> None:
    """Rewrite the COMPLETE marker so that it lists ``names`` with their current size and sha256:
    what a tool (or an attacker) that edits a checkpoint and its marker together leaves."""
    marker = json.loads((step_dir / ckpt.MARKER).read_text())
    for name in names:
        marker["files"][name] = {"num_bytes": (step_dir / name).stat().st_size, "sha256": ckpt._sha256(step_dir / name)}
    (step_dir / ckpt.MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("damage", ["pickle", "truncated", "text"])
def test_a_file_that_is_not_safetensors_is_a_one_line_error_naming_it(tmp_path, damage):
    path = _save(tmp_path, 1)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    if damage == "pickle":
        torch.save({"w": torch.zeros(3, 2)}, weights)
    elif damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_text("version https://git-lfs.github.com/spec/v1\n")
    vouch(path, "model.safetensors")
    for verify in (True, False):
        with pytest.raises(UserError, match=r"model\.safetensors: not a readable safetensors file") as e:
            load_checkpoint(path, verify=verify)
        assert str(weights) in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_state_file_is_a_one_line_error(tmp_path):
    path = _save(tmp_path, 1)
    state = path / ckpt.STATE
    state.write_bytes(state.read_bytes()[:40])
    vouch(path, ckpt.STATE)
    with pytest.raises(UserError, match=r"state\.pt: not a readable torch state file") as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value)


def test_names_from_meta_and_marker_never_leave_the_checkpoint(tmp_path):
    """A tensor group named ../../x in meta.json (and a marker listing ../ files) made the loader
    read files outside the checkpoint: names are checked on load as they are on save."""
    path = _save(tmp_path / "run", 1)
    save_file_outside = tmp_path / "secret.safetensors"
    import safetensors.torch

    safetensors.torch.save_file({"stolen": torch.ones(2)}, save_file_outside)
    meta = json.loads((path / ckpt.META).read_text())
    meta["tensors"] = ["model", "../../../secret"]
    (path / ckpt.META).write_text(json.dumps(meta))
    marker = json.loads((path / ckpt.MARKER).read_text())
    marker["files"]["../../../secret.safetensors"] = {"num_bytes": save_file_outside.stat().st_size,
                                                      "sha256": ckpt._sha256(save_file_outside)}
    (path / ckpt.MARKER).write_text(json.dumps(marker))
    vouch(path, ckpt.META)
    assert (path / "../../../secret.safetensors").resolve() == save_file_outside
    with pytest.raises(UserError, match="not a complete checkpoint") as e:
        load_checkpoint(path)
    assert "'../../../secret.safetensors'" in str(e.value)
    # The marker alone is fixed: meta.json's group name is refused by the same rule as on save.
    del marker["files"]["../../../secret.safetensors"]
    (path / ckpt.MARKER).write_text(json.dumps(marker))
    vouch(path, ckpt.META)
    with pytest.raises(UserError, match=r"tensor group name '\.\./\.\./\.\./secret'"):
        load_checkpoint(path)
    assert ckpt.find_latest(tmp_path / "run") is None  # never picked for a resume either
    with pytest.raises(ValueError, match="tensor group name"):
        save_checkpoint(tmp_path / "other", 1, {"../x": {"w": torch.zeros(1)}}, {}, {}, keep_last=1)


def test_resume_auto_stops_when_no_checkpoint_is_usable(tmp_path):
    path = _save(tmp_path, 4)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    marker = json.loads((path / ckpt.MARKER).read_text())
    marker["files"]["model.safetensors"]["num_bytes"] += 1  # a stale marker from another write
    (path / ckpt.MARKER).write_text(json.dumps(marker))
    with pytest.raises(UserError) as e:
        resolve_resume(tmp_path, "auto")
    msg = str(e.value)
    assert "none usable" in msg and "step-00000004" in msg and "--resume none" in msg and "--resume PATH" in msg
    assert "\n" not in msg
    assert resolve_resume(tmp_path, "none") is None  # the way to start over
    assert {p.name: p.read_bytes() for p in path.iterdir() if p.name != ckpt.MARKER} == \
        {k: v for k, v in before.items() if k != ckpt.MARKER}
    empty = tmp_path / "fresh"
    assert resolve_resume(empty, "auto") is None  # no checkpoints at all: a new run


def test_a_run_never_deletes_or_overwrites_checkpoints_it_did_not_write(tmp_path, caplog, monkeypatch):
    """Checkpoints written by another run of the same directory survive a run started with
    --resume none: retention keeps them and a checkpoint of the same step moves them aside."""
    with monkeypatch.context() as other_process:  # what a process knows of its own writes starts empty
        other_process.setattr(ckpt, "_written", set())
        other_process.setattr(ckpt, "_resumed_step", {})
        for step in (1, 2, 3):
            save_checkpoint(tmp_path, step, {"model": {"w": torch.full((2,), -1.0)}}, {}, {}, keep_last=0)
    foreign = {s: (tmp_path / "checkpoints" / ckpt.checkpoint_dir_name(s) / "model.safetensors").read_bytes()
               for s in (1, 2, 3)}
    assert resolve_resume(tmp_path, "none") is None
    with caplog.at_level(logging.WARNING, logger="latentforge.checkpoint"):
        for step in (2, 4, 5):
            _save(tmp_path, step, keep_last=1)
    assert "not written by this run" in caplog.text
    assert _steps(tmp_path) == [1, 3, 5]  # own step 2 and 4 pruned; the foreign 1 and 3 kept
    kept = [p for p in (tmp_path / "checkpoints").iterdir() if ".kept-" in p.name]
    assert [p.name.split(".")[0] for p in kept] == ["step-00000002"]
    assert (kept[0] / "model.safetensors").read_bytes() == foreign[2]
    assert load_checkpoint(kept[0]).step == 2  # complete, loadable
    # Resuming the run (auto) makes its checkpoints at or before the resume point its own.
    assert resolve_resume(tmp_path, "auto").name == "step-00000005"
    _save(tmp_path, 6, keep_last=1)
    assert _steps(tmp_path) == [6]


def test_weights_of_another_model_stop_in_one_line_naming_the_first_difference():
    """torch lists every missing, unexpected and resized tensor over many lines; load_weights keeps one
    line: the first two names of a list and how many there are, or the first resized tensor."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    full = model.state_dict()
    cases = {
        "Missing key(s) in state_dict: \"1.weight\", \"1.bias\", ... (4 in all)":
            {k: v for k, v in full.items() if k.startswith("0.")},
        "Unexpected key(s) in state_dict: \"extra\"": {**full, "extra": torch.zeros(1)},
        "size mismatch for 0.weight: copying a param with shape torch.Size([5, 2]) from checkpoint, the shape in "
        "current model is torch.Size([3, 2])": {**full, "0.weight": torch.zeros(5, 2)},
    }
    for first, tensors in cases.items():
        with pytest.raises(UserError) as e:
            ckpt.load_weights(model, tensors, "W", "the model of C", "fix it")
        assert str(e.value) == f"W: its weights do not fit the model of C ({first}); fix it"
    before = {k: v.clone() for k, v in full.items()}
    ckpt.load_weights(model, {k: v + 1 for k, v in before.items()}, "W", "the model of C", "fix it")  # fits: loaded
    assert all(torch.equal(model.state_dict()[k], before[k] + 1) for k in before)
