"""EMA (fused update, reference values, swapping) and AdamW / Muon / LR schedule / gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch

from latentforge.config import from_dict
from latentforge.errors import ConfigError, UserError
from latentforge.train.ema import EMA, EMAConfig
from latentforge.train.optim import (
    MuonAdamW,
    OptimConfig,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm,
    hidden_matrices,
    lr_multiplier,
    orthogonalize,
)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3), torch.nn.GroupNorm(2, 4), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3)
    )


def _perturb(model: torch.nn.Module, scale: float = 0.1) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


# ----------------------------------------------------------------------------------------- EMA


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_matches_a_per_parameter_reference(warmup):
    model = _model()
    cfg = EMAConfig(decay=0.95, start_step=3, warmup=warmup)
    ema = EMA(model, cfg)
    reference = {n: p.detach().clone().double() for n, p in model.named_parameters()}
    num_updates = 0
    for step in range(12):
        _perturb(model)
        ema.update(model, step)
        for n, p in model.named_parameters():
            if step < cfg.start_step:
                reference[n] = p.detach().clone().double()
                continue
            d = min(cfg.decay, (1 + num_updates) / (10 + num_updates)) if warmup else cfg.decay
            reference[n] = d * reference[n] + (1 - d) * p.detach().double()
        if step >= cfg.start_step:
            num_updates += 1
    assert ema.num_updates == num_updates == 9
    for name, shadow in ema.state_dict()["params"].items():
        assert shadow.dtype == torch.float32
        torch.testing.assert_close(shadow, reference[name].float(), rtol=1e-6, atol=1e-6)
    # The EMA is not the model: it lags behind.
    assert not torch.allclose(ema.shadow[0], next(model.parameters()))


def test_ema_copies_weights_before_start_step():
    model = _model()
    ema = EMA(model, EMAConfig(decay=0.99, start_step=5))
    _perturb(model)
    ema.update(model, step=4)
    for s, p in zip(ema.shadow, model.parameters()):
        assert torch.equal(s, p)
    assert ema.num_updates == 0


def test_ema_update_is_one_foreach_call(monkeypatch):
    model = _model()
    ema = EMA(model, EMAConfig(decay=0.9))
    calls = []
    real_lerp = torch._foreach_lerp_

    def counting_lerp(tensors, ends, weight):
        calls.append((len(tensors), weight))
        return real_lerp(tensors, ends, weight)

    monkeypatch.setattr(torch, "_foreach_lerp_", counting_lerp)
    ema.update(model, step=0)
    num_params = len(list(model.parameters()))
    assert num_params == 6
    assert calls == [(num_params, pytest.approx(0.1))]


def test_ema_follows_the_model_it_is_given_after_listing_its_parameters_once():
    # The Parameter objects are listed on the first update of a model, not every step; updates
    # follow in-place changes and swapped storage of those parameters, and another model object is
    # listed anew.
    model, other = _model(), _model()
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(1.0)
    listed = []
    for m in (model, other):
        real = m.parameters
        m.parameters = lambda *a, _real=real, _m=m, **k: (listed.append(_m), _real(*a, **k))[1]
    ema = EMA(model, EMAConfig(decay=0.5))
    start = [s.clone() for s in ema.shadow]
    params = list(model.parameters())
    calls = []

    def update(m, step):
        listed.clear()
        ema.update(m, step)
        calls.append(list(listed))

    update(model, 0)
    with torch.no_grad():
        for p in params:
            p.add_(2.0)  # as an optimizer step does
    update(model, 1)
    for s, s0, p in zip(ema.shadow, start, params):
        torch.testing.assert_close(s, 0.5 * s0 + 0.5 * p.detach())  # step 0 averaged s0 with itself
    for p in params:
        p.data = torch.full_like(p.data, 3.0)  # new storage in the same Parameter
    before = [s.clone() for s in ema.shadow]
    update(model, 2)
    for s, b in zip(ema.shadow, before):
        torch.testing.assert_close(s, 0.5 * b + 1.5)
    before = [s.clone() for s in ema.shadow]
    update(other, 3)
    for s, b in zip(ema.shadow, before):
        torch.testing.assert_close(s, 0.5 * b + 0.5)
    assert calls == [[model], [], [], [other]]  # each model object listed once, on its first update


def test_ema_of_bf16_weights_stays_fp32():
    model = _model().to(torch.bfloat16)
    ema = EMA(model, EMAConfig(decay=0.5, device="cpu"))
    start = [s.clone() for s in ema.shadow]
    _perturb(model, scale=1.0)
    ema.update(model, step=0)
    assert all(s.dtype == torch.float32 and s.device.type == "cpu" for s in ema.shadow)
    for s, s0, p in zip(ema.shadow, start, model.parameters()):
        torch.testing.assert_close(s, 0.5 * s0 + 0.5 * p.float())


def test_ema_state_dict_round_trip_with_wrapped_model():
    model = _model()
    ema = EMA(model, EMAConfig(decay=0.9))
    _perturb(model)
    ema.update(model, 0)
    sd = ema.state_dict()
    assert list(sd["params"]) == [n for n, _ in model.named_parameters()]

    wrapper = torch.nn.Module()
    wrapper.add_module("_orig_mod", _model(seed=1))  # keys as torch.compile writes them
    restored = EMA(wrapper, EMAConfig(decay=0.9))
    assert restored.names == ema.names
    restored.load_state_dict(sd)
    assert restored.num_updates == 1
    for a, b in zip(restored.shadow, ema.shadow):
        assert torch.equal(a, b)

    other = EMA(torch.nn.Linear(2, 2), EMAConfig())
    with pytest.raises(UserError, match="EMA state does not match the model"):
        other.load_state_dict(sd)


def test_ema_swapped_into_restores_trained_weights():
    model = _model()
    ema = EMA(model, EMAConfig(decay=0.5))
    _perturb(model)
    ema.update(model, 0)
    trained = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="eval failed"):
        with ema.swapped_into(model) as m:
            for s, p in zip(ema.shadow, m.parameters()):
                assert torch.equal(s, p)
            raise RuntimeError("eval failed")
    for t, p in zip(trained, model.parameters()):
        assert torch.equal(t, p)
    ema.copy_to(model)
    assert torch.equal(next(model.parameters()), ema.shadow[0])


@pytest.mark.parametrize("data, message", [
    ({"decay": 1.0}, "decay: must be in (0, 1)"),
    ({"start_step": -1}, "start_step: must be >= 0"),
    ({"device": "gpu"}, "device: must be one of"),
])
def test_ema_config_errors(data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_dict(EMAConfig, data)


# -------------------------------------------------------------------------------------- optim


def test_weight_decay_groups_and_implementation():
    model = _model()
    model[0].bias.requires_grad_(False)  # frozen: not optimized at all
    opt = build_optimizer(model.parameters(), OptimConfig(weight_decay=0.05), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[3].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[1].weight), id(model[1].bias), id(model[3].bias)}
    assert decay["fused"] is True  # auto on CPU: the fused kernel is 10x faster than foreach here
    foreach = build_optimizer(model.parameters(), OptimConfig(fused=False), "cpu")
    assert foreach.param_groups[0]["foreach"] is True and not foreach.param_groups[0]["fused"]
    assert build_optimizer(model.parameters(), OptimConfig(), "mps").param_groups[0]["foreach"] is True


def test_optim_config_from_recipe_data():
    cfg = from_dict(OptimConfig, {"betas": [0.9, 0.95], "fused": False, "schedule": "cosine"})
    assert cfg.betas == (0.9, 0.95) and cfg.fused is False
    assert from_dict(OptimConfig, {"fused": "auto"}).fused == "auto"
    for data, message in [
        ({"fused": "yes"}, "fused: expected"),
        ({"lr": 0}, "lr: must be > 0"),
        ({"betas": [0.9, 1.0]}, "betas: beta2"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"schedule": "step"}, "schedule: must be one of"),
        ({"muon_momentum": 1.0}, "muon_momentum: must be in"),
        ({"muon_ns_steps": 0}, "muon_ns_steps: must be >= 1"),
        ({"name": "lion"}, "name: must be one of"),
    ]:
        with pytest.raises(ConfigError, match=message):
            from_dict(OptimConfig, data)


def test_lr_multiplier_values():
    total = 110
    cos = OptimConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(0, cos, total) == pytest.approx(0.1)
    assert lr_multiplier(4, cos, total) == pytest.approx(0.5)
    assert lr_multiplier(9, cos, total) == pytest.approx(1.0)
    assert lr_multiplier(10, cos, total) == pytest.approx(1.0)
    assert lr_multiplier(60, cos, total) == pytest.approx(0.55)  # halfway: (1 + min) / 2
    assert lr_multiplier(35, cos, total) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_multiplier(110, cos, total) == pytest.approx(0.1)
    assert lr_multiplier(500, cos, total) == pytest.approx(0.1)  # past the end: stays at the floor
    lin = OptimConfig(warmup_steps=10, schedule="linear", min_lr_ratio=0.0)
    assert lr_multiplier(60, lin, total) == pytest.approx(0.5)
    assert lr_multiplier(110, lin, total) == pytest.approx(0.0)
    const = OptimConfig(warmup_steps=0, schedule="constant")
    assert [lr_multiplier(s, const, total) for s in (0, 50, 1000)] == [1.0, 1.0, 1.0]


def test_lr_scheduler_follows_the_multiplier_and_resumes_from_its_state():
    cfg = OptimConfig(lr=0.2, warmup_steps=2, schedule="cosine", min_lr_ratio=0.0)
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model.parameters(), cfg, "cpu")
    sched = build_lr_scheduler(opt, cfg, total_steps=8)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.2 * lr_multiplier(s, cfg, 8) for s in range(5)])

    opt2 = build_optimizer(model.parameters(), cfg, "cpu")
    sched2 = build_lr_scheduler(opt2, cfg, total_steps=8)
    sched2.load_state_dict(sched.state_dict())
    assert sched2.state_dict()["lr_lambdas"] == [None, None]  # the schedule itself is not saved
    opt2.step()
    sched2.step()
    assert opt2.param_groups[1]["lr"] == pytest.approx(0.2 * lr_multiplier(6, cfg, 8))


def test_lr_scheduler_rejects_warmup_longer_than_training():
    cfg = OptimConfig(warmup_steps=100, schedule="cosine")
    opt = build_optimizer(torch.nn.Linear(2, 2).parameters(), cfg, "cpu")
    with pytest.raises(ConfigError, match=r"^train\.optim\.warmup_steps: 100 >= total steps 50"):
        build_lr_scheduler(opt, cfg, total_steps=50)


def test_clip_grad_norm():
    model = _model()
    model(torch.randn(2, 2, 6, 6)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.cat([g.flatten() for g in grads]).norm()

    norm = clip_grad_norm(model.parameters(), max_norm=0)  # 0: measure only
    assert norm.dtype == torch.float32 and norm.ndim == 0
    torch.testing.assert_close(norm, expected)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))

    max_norm = float(expected) / 4
    norm = clip_grad_norm(model.parameters(), max_norm)
    torch.testing.assert_close(norm, expected)  # the norm before clipping
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    torch.testing.assert_close(clipped, torch.tensor(max_norm), rtol=1e-4, atol=0)

    assert float(clip_grad_norm(torch.nn.Linear(2, 2).parameters(), 1.0)) == 0.0  # no grads yet


# --------------------------------------------------------------------------------------- muon


@pytest.mark.parametrize("shape", [(12, 40), (40, 12)])
def test_orthogonalize_brings_every_singular_value_near_one_with_the_same_singular_vectors(shape):
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=g, dtype=torch.float64))
    k = min(shape)
    s = torch.logspace(0, -2, k, dtype=torch.float64)  # condition number 100
    m = (u[:, :k] * s) @ v[:, :k].T
    before = m.clone()
    o = orthogonalize(m.float(), steps=5)
    assert torch.equal(m, before)  # pure
    sv = torch.linalg.svdvals(o.double())
    assert sv.min() > 0.6 and sv.max() < 1.25, sv  # the quintic's band, from singular values 1 ... 0.01
    target = u[:, :k] @ v[:, :k].T  # U V^T
    cosine = (o.double() * target).sum() / (o.double().norm() * target.norm())
    assert cosine > 0.97
    # A stack of matrices goes through as each one alone.
    stack = torch.stack([m.float(), 3 * m.float().flip(0)])
    torch.testing.assert_close(orthogonalize(stack), torch.stack([o, orthogonalize(3 * m.float().flip(0))]),
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="a matrix or a stack"):
        orthogonalize(torch.ones(3))
    # In bfloat16 (the optimizer's default): the same directions, the same band.
    low = orthogonalize(m.float(), dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16
    assert (low.double() * o.double()).sum() / (low.double().norm() * o.double().norm()) > 0.99
    sv = torch.linalg.svdvals(low.double())
    assert sv.min() > 0.55 and sv.max() < 1.3, sv


def _muon_reference(p0, grads, lr, wd, momentum, steps):
    """Muon by its definition, one tensor: Nesterov momentum, the (out, rest) matrix orthogonalised,
    scaled by 0.2 sqrt(max dim), decoupled weight decay first."""
    p, buf = p0.clone(), torch.zeros_like(p0)
    for grad in grads:
        p = p * (1 - lr * wd)
        buf = momentum * buf + (1 - momentum) * grad
        update = ((1 - momentum) * grad + momentum * buf).reshape(p.shape[0], -1)
        p = p - lr * 0.2 * max(update.shape) ** 0.5 * orthogonalize(update, steps).reshape(p.shape)
    return p


def test_muon_adamw_steps_match_muon_and_torch_adamw_by_their_definitions():
    """Three steps of the conv kernel on Muon, the rest on AdamW: the kernel matches the definition
    above, the AdamW groups torch's own AdamW (bias correction, decoupled decay) to fp32 precision."""
    model = _model()
    ref = _model()
    opt = build_optimizer(model.parameters(), OptimConfig(name="muon", lr=1e-2, weight_decay=0.1,
                                                          betas=(0.9, 0.95), muon_momentum=0.9,
                                                          muon_ns_dtype="float32"),
                          "cpu", hidden=[model[0].weight])
    assert [g["muon"] for g in opt.param_groups] == [True, False, False]
    assert opt.param_groups[0]["params"] == [model[0].weight]
    torch_adamw = torch.optim.AdamW([{"params": [ref[3].weight], "weight_decay": 0.1},
                                     {"params": [ref[1].weight, ref[1].bias, ref[0].bias, ref[3].bias],
                                      "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), foreach=False)
    kernel0 = model[0].weight.detach().clone()
    g = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(3):
        step_grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
        grads.append(step_grads["0.weight"])
        for m in (model, ref):
            for n, p in m.named_parameters():
                p.grad = step_grads[n].clone()
        opt.step()
        torch_adamw.step()
    expected = _muon_reference(kernel0, grads, lr=1e-2, wd=0.1, momentum=0.9, steps=5)
    torch.testing.assert_close(model[0].weight.detach(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(model[0].weight, ref[0].weight)  # the kernel did not take AdamW's path
    for name in ("3.weight", "1.weight", "1.bias", "0.bias", "3.bias"):
        torch.testing.assert_close(dict(model.named_parameters())[name], dict(ref.named_parameters())[name],
                                   rtol=1e-5, atol=1e-6)


def test_muon_adamw_state_round_trips_a_weights_only_checkpoint(tmp_path):
    """Two steps, the state saved and loaded (weights_only) into a new optimizer, two more: the
    same weights as four steps in one go."""
    cfg = OptimConfig(name="muon", lr=1e-2, weight_decay=0.01)

    def grads(step):
        g = torch.Generator().manual_seed(step)
        return [torch.randn(p.shape, generator=g) for p in _model().parameters()]

    def steps(model, opt, start, stop):
        for s in range(start, stop):
            for p, gr in zip(model.parameters(), grads(s)):
                p.grad = gr
            opt.step()

    straight = _model()
    opt = build_optimizer(straight.parameters(), cfg, "cpu", hidden=[straight[0].weight])
    steps(straight, opt, 0, 4)
    first = _model()
    opt = build_optimizer(first.parameters(), cfg, "cpu", hidden=[first[0].weight])
    steps(first, opt, 0, 2)
    torch.save({"model": first.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    second = _model()
    second.load_state_dict(saved["model"])
    opt = build_optimizer(second.parameters(), cfg, "cpu", hidden=[second[0].weight])
    opt.load_state_dict(saved["optim"])
    steps(second, opt, 2, 4)
    for a, b in zip(straight.parameters(), second.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backbone", ["unet", "dit"])
def test_muon_takes_the_hidden_matrices_of_a_backbone_and_refuses_what_it_cannot_do(backbone):
    from latentforge.models.denoiser import denoiser_of
    from latentforge.models.dit import DiTConfig, build_dit
    from latentforge.models.unet import UNetConfig, build_unet

    if backbone == "unet":
        model = build_unet(UNetConfig(preset="tiny", cross_attention_dim=16, sample_size=8))
        edges, inner = {"conv_in.weight", "conv_out.weight"}, "time_embedding.linear_1.weight"
    else:
        model = build_dit(DiTConfig(preset="tiny", caption_channels=16, sample_size=8))
        edges, inner = {"pos_embed.proj.weight", "proj_out.weight"}, "caption_projection.linear_1.weight"
    hidden = hidden_matrices(torch.nn.ModuleDict({"module": model}), denoiser_of(model).edge_layers)  # a wrapper
    names = {id(p): n for n, p in model.named_parameters()}
    hidden_names = {names[id(p)] for p in hidden}
    assert not edges & hidden_names and inner in hidden_names
    assert any(n.endswith("attn2.to_k.weight") for n in hidden_names)
    assert all(p.ndim >= 2 for p in hidden) and len(hidden) == len(set(map(id, hidden)))
    opt = build_optimizer(model.parameters(), OptimConfig(name="muon"), "cpu", hidden=hidden)
    adam_names = {names[id(p)] for g in opt.param_groups[1:] for p in g["params"]}
    assert edges <= adam_names and not adam_names & hidden_names
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    with pytest.raises(ConfigError, match="no hidden matrices"):
        build_optimizer(model.parameters(), OptimConfig(name="muon"), "cpu", hidden=[])
    bias = next(p for p in model.parameters() if p.ndim == 1)
    with pytest.raises(ValueError, match="ndim >= 2"):
        MuonAdamW([{"params": [bias], "muon": True}], lr=1e-3)
    # An AdamW run ignores `hidden`.
    assert len(build_optimizer(model.parameters(), OptimConfig(), "cpu", hidden=hidden).param_groups) == 2
