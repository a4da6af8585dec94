"""The validation loss during training (``train.val``, train/validation.py).

The logged figures are checked against a computation written apart from the trainer: the
checkpoint's EMA weights loaded on their own, the latents read from the shards, noised and
targeted by diffusers' DDPMScheduler (v-prediction) or the rectified-flow formulas in plain torch
(flow matching), and the empty caption read from the dataset's file. The split of the samples
over ranks is checked at fake scale (two ranks in one process); two real gloo ranks under DDP
and FSDP2 are in tests/test_distributed.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.numpy
import torch
from diffusers import DDPMScheduler

from latent_fixtures import latent_data  # noqa: F401
from latentforge.config import from_dict
from latentforge.data.encode import EMPTY_PROMPT
from latentforge.data.loader import LoaderConfig, StreamConfig, open_dataset
from latentforge.errors import ConfigError
from latentforge.inference import load_components
from latentforge.train.run import RunConfig, train
from latentforge.train.validation import VAL_LOG, ValidationSet, ValLossConfig, validation_noise, validation_times

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_SAMPLES, TIMES = 6, [125, 375, 625, 875]  # 4 fixed timesteps of 1000: the midpoints of 4 equal bins


def run_config(data, cache: Path, **train) -> RunConfig:
    return from_dict(RunConfig, {
        "train": {"unet": {"preset": "tiny"}, "ema": {"decay": 0.5}, "optim": {"lr": 1e-2},
                  "noise": {"prediction_type": "v_prediction"}, "min_snr_gamma": 5.0,
                  "phases": [{"datasets": [{"path": str(data["latent16"])}], "steps": 4}],
                  "micro_batch_size": 4, "device": "cpu", "loggers": [],
                  "checkpoint": {"every_steps": 2, "keep_last": 5},
                  "val": {"data": str(data["latent16"]), "every_steps": 2, "num_samples": NUM_SAMPLES,
                          "num_timesteps": 4, "batch_size": 4, "seed": 5}, **train},
        "data": {"num_workers": 0, "cache_dir": str(cache), "caption_dropout": 0.1},
    })


def val_records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / VAL_LOG).read_text().splitlines()]


def held_out(data, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first n samples' latents (posterior mean, shifted and scaled as the data meta says), text states,
    and the empty caption's states, read from the dataset."""
    ds = open_dataset(LoaderConfig(datasets=[StreamConfig(path=str(data["latent16"]))], shuffle=False,
                                   num_workers=0, cache_dir=str(data["cache"])))
    rows = ds.__getitems__(list(range(n)))
    meta = json.loads((data["latent16"] / "index.json").read_text())["meta"]["vae"]
    x0 = (torch.stack([r["latent_mean"] for r in rows]).float() - meta["shift_factor"]) * meta["scaling_factor"]
    hidden = torch.stack([r["text_hidden"] for r in rows]).float()
    empty = torch.from_numpy(safetensors.numpy.load_file(data["latent16"] / EMPTY_PROMPT)["text_hidden"]).float()
    return x0, hidden, empty


def test_fixed_times():
    assert validation_times(8, 1000, flow=False).tolist() == [62, 187, 312, 437, 562, 687, 812, 937]
    assert validation_times(4, 1000, flow=False).tolist() == TIMES
    assert validation_times(4, 1000, flow=True).tolist() == [0.125, 0.375, 0.625, 0.875]
    # Sample i has the same noise whatever the number of samples, and other samples other noise.
    a, b = validation_noise(5, 3, (2, 4, 4)), validation_noise(5, 5, (2, 4, 4))
    assert torch.equal(a, b[:3]) and not torch.equal(b[0], b[1])
    assert not torch.equal(a, validation_noise(6, 3, (2, 4, 4)))


@pytest.mark.parametrize("objective", ["v_prediction", "flow_matching"])
def test_the_logged_loss_is_the_ema_weights_loss_at_the_fixed_times(objective, latent_data, tmp_path):  # noqa: F811
    extra = {} if objective == "v_prediction" else {"noise": {"prediction_type": "flow_matching"}, "min_snr_gamma": 0}
    cfg = run_config(latent_data, tmp_path / "cache", **extra)
    assert train(cfg, tmp_path / "run", progress=False)["finished"]
    records = val_records(tmp_path / "run")
    assert [r["step"] for r in records] == [2, 4] and all(r["ema"] and r["num_samples"] == NUM_SAMPLES for r in records)

    x0, hidden, empty = held_out(latent_data, NUM_SAMPLES)
    noise = validation_noise(5, NUM_SAMPLES, tuple(x0.shape[1:]))
    ddpm = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                         prediction_type="v_prediction")
    for r in records:
        unet = load_components(tmp_path / "run" / "checkpoints" / f"step-{r['step']:08d}", use_ema=True).unet
        cond, uncond = [], []
        for k in range(4):
            if objective == "v_prediction":
                t = torch.full((NUM_SAMPLES,), TIMES[k])
                x_t, target, t_model = ddpm.add_noise(x0, noise, t), ddpm.get_velocity(x0, noise, t), t
            else:  # x_s = (1 - s) x0 + s eps, velocity eps - x0, the model given s * 1000
                s = (k + 0.5) / 4
                x_t, target, t_model = (1 - s) * x0 + s * noise, noise - x0, torch.full((NUM_SAMPLES,), s * 1000)
            with torch.no_grad():
                pred = unet(x_t, t_model, encoder_hidden_states=hidden).sample
                pred_u = unet(x_t, t_model, encoder_hidden_states=empty.expand_as(hidden)).sample
            cond.append(((pred - target) ** 2).mean().item())
            uncond.append(((pred_u - target) ** 2).mean().item())
        assert r["loss_by_t"] == pytest.approx(cond, rel=1e-5)
        assert r["loss_uncond_by_t"] == pytest.approx(uncond, rel=1e-5)
        assert r["loss"] == pytest.approx(sum(cond) / 4, rel=1e-5)
        assert r["text_gap"] == pytest.approx(sum(uncond) / 4 - sum(cond) / 4, rel=1e-4, abs=1e-7)
    assert records[0]["loss"] != records[1]["loss"]  # two different models
    assert records[0]["times"] == (TIMES if objective == "v_prediction" else [0.125, 0.375, 0.625, 0.875])


def test_validation_leaves_training_alone_and_a_resumed_run_logs_the_same_figures(latent_data, tmp_path):  # noqa: F811
    cache = tmp_path / "cache"
    with_val = run_config(latent_data, cache)
    without = run_config(latent_data, cache, val={"every_steps": 0})
    assert train(with_val, tmp_path / "a", progress=False)["finished"]
    assert train(without, tmp_path / "b", progress=False)["finished"]
    metrics = [[json.loads(line)["loss"] for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
               for r in ("a", "b")]
    assert metrics[0] == metrics[1]  # the swap of the EMA weights and back, eval mode and back: no trace
    assert not (tmp_path / "b" / VAL_LOG).exists()
    before = val_records(tmp_path / "a")
    assert train(with_val, tmp_path / "a", resume=str(tmp_path / "a" / "checkpoints" / "step-00000002"),
                 progress=False)["finished"]
    after = val_records(tmp_path / "a")
    assert [r["step"] for r in after] == [2, 4]  # step 4 dropped at resume, logged again
    for a, b in zip(before, after):
        assert a["loss_by_t"] == b["loss_by_t"] and a["loss_uncond_by_t"] == b["loss_uncond_by_t"]
    # the demo's report stage on such a run draws the quality report from the validation losses;
    # on a run without them, nothing
    from latentforge.demo import _quality_report_of_val_only, _val_curve

    assert _val_curve(tmp_path / "a") == after and _val_curve(tmp_path / "b") is None
    assert not (tmp_path / "a" / "report").exists()
    _quality_report_of_val_only(tmp_path / "a", _val_curve(tmp_path / "a"))
    _quality_report_of_val_only(tmp_path / "b", _val_curve(tmp_path / "b"))
    assert (tmp_path / "a" / "report" / "val_loss.png").is_file() and not (tmp_path / "b" / "report").exists()
    # `latentforge report` on a run with the validation loss only: its table and plot
    from latentforge.cli import main

    assert main(["report", str(tmp_path / "a")]) == 0
    text = (tmp_path / "a" / "report" / "quality.md").read_text()
    for r in after:
        assert (f"| {r['step']} | {r['samples_seen']:,} | {NUM_SAMPLES} | {r['loss']:.4f} | {r['loss_uncond']:.4f} | "
                f"{r['text_gap']:.4f} | {r['text_gap_by_t'][-1]:.4f} |") in text
    assert (tmp_path / "a" / "report" / "val_loss.png").stat().st_size > 1000


def test_ranks_split_the_samples_and_their_sums_make_the_whole():
    """Rank r of W denoises samples r, r + W, ... (7 samples over 2 and 3 ranks, padded): the
    per-rank figures (sums over the rank's samples / all samples) add up to the one-rank figure."""
    g = torch.Generator().manual_seed(0)
    cfg = ValLossConfig(data="x", every_steps=1, num_samples=7, num_timesteps=3, batch_size=2, seed=1)
    empty = {"text_hidden": torch.randn(3, 4, generator=g), "text_mask": torch.ones(3, dtype=torch.long)}
    vs = ValidationSet(cfg, torch.randn(7, 2, 4, 4, generator=g), torch.randn(7, 3, 4, generator=g),
                       torch.ones(7, 3, dtype=torch.long), empty)
    seen: list[int] = []

    def forward(x_t, t, hidden, mask):  # depends on the sample, the time and the caption
        seen.append(len(x_t))
        return x_t * (1 + t.float().reshape(-1, 1, 1, 1) / 1000) + hidden.mean(dim=(1, 2)).reshape(-1, 1, 1, 1)

    def noisy(x0, noise, t):
        return x0 + noise * t.float().reshape(-1, 1, 1, 1) / 1000, noise, t

    times = validation_times(3, 1000, flow=False)
    whole = vs.losses(forward, noisy, times, torch.device("cpu"))
    for world_size in (2, 3):
        seen.clear()
        parts = [vs.losses(forward, noisy, times, torch.device("cpu"), rank, world_size) for rank in range(world_size)]
        per_rank = -(-7 // world_size)
        assert sum(seen) == world_size * per_rank * 3 * 2  # every rank the same count: padded, cond + uncond
        for key in ("loss_by_t", "loss_uncond_by_t"):
            total = [sum(p[key][k] for p in parts) for k in range(3)]
            assert total == pytest.approx(whole[key], rel=1e-6)  # float32 per-sample losses
    assert whole["text_gap"] == pytest.approx(whole["loss_uncond"] - whole["loss"])


def test_bad_validation_settings_fail_before_training(latent_data, tmp_path):  # noqa: F811
    cfg = run_config(latent_data, tmp_path / "cache", val={"every_steps": 2})  # a recipe may leave data to a command
    with pytest.raises(ConfigError, match="train.val.data: every_steps is 2 but no held-out latent dataset is given"):
        train(cfg, tmp_path / "run", progress=False)
    cfg = run_config(latent_data, tmp_path / "cache")
    cfg.train.val.data = str(latent_data["latent32"])  # 16x16 latents against the training data's 8x8
    with pytest.raises(ConfigError, match=r"train.val.data: .*latent32 has latents of shape \[4, 16, 16\], the "
                                          r"training data \[4, 8, 8\]"):
        train(cfg, tmp_path / "run", progress=False)
    cfg.train.val.data = str(latent_data["raw16"])
    with pytest.raises(ConfigError, match="holds 'raw' shards"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_the_report_of_a_validation_without_the_empty_caption(tmp_path):
    """With train.val.unconditional off the records have no text gap: the report shows the loss alone."""
    from latentforge.evaluate.curve import plot_validation, validation_table

    records = [{"step": s, "samples_seen": 4 * s, "num_samples": 6, "ema": True, "times": TIMES, "loss": loss,
                "loss_by_t": [loss] * 4} for s, loss in ((2, 0.25), (4, 0.125))]
    table = validation_table(records).splitlines()
    assert table[0] == "| step | images seen | samples | loss |"
    assert table[2:] == ["| 2 | 8 | 6 | 0.2500 |", "| 4 | 16 | 6 | 0.1250 |"]
    assert plot_validation(records, tmp_path / "val.png").stat().st_size > 1000


def test_the_report_of_a_run_with_the_validation_loss_only_gives_the_planned_cost(tmp_path):
    """`latentforge report --recipe` on a run that logged the validation loss and no sampled
    evaluations: the plan's cost line and the validation table, nothing about evaluations."""
    from latentforge.evaluate.curve import write_quality_report

    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "samples_seen": 4 * s, "num_samples": 6, "ema": True, "times": TIMES, "loss": loss,
                "loss_by_t": [loss] * 4} for s, loss in ((2, 0.25), (4, 0.125))]
    (run / VAL_LOG).write_text("".join(json.dumps(r) + "\n" for r in records))
    plan = {"gpus": 8, "gpu": "A100-80GB", "train": {"gpu_hours": 1234.0, "days": 6.43, "cost": 2468.0}}
    text = write_quality_report(run, 16, plan).read_text()
    assert text.startswith("# Validation loss: run")
    assert "planned on 8 x A100-80GB (`latentforge plan`): 1,234 GPU-hours, 6.43 days, $2,468 of training." in text
    assert "| 4 | 16 | 6 | 0.1250 |" in text and "evaluations" not in text
    assert (run / "report" / "val_loss.png").is_file()
    assert "planned on" not in write_quality_report(run, 16).read_text()
