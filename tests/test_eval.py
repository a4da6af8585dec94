"""``latentforge eval``: FID/KID on the FID Inception-v3, FD in other encoders, CLIP score, caching, resume.

The networks are the real architectures with random weights, saved the way real ones are: the FID
Inception-v3 as a plain state dict (the format of pt_inception-2015-12-05-6726825d.pth), a CLIP
model and a DINOv2 model as transformers directories. Each metric is checked against an
independent computation: scipy's sqrtm, a plain numpy unbiased MMD, torchmetrics' own Inception
loader and FID class, direct model calls. Generation uses a tiny run trained for 2 steps on the
shared latent fixtures. The Inception layer 64 (pooled after the third convolution) keeps most
tests fast; the 2048 layer is checked against torchmetrics on a few images.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
from PIL import Image

from latentforge.cli import main
from latentforge.config import from_dict
from latentforge.data.encode import EncodeConfig, encode_dataset
from latentforge.errors import UserError
from latentforge.evaluate import metrics
from latentforge.evaluate.eval import EvalConfig, evaluate, generate_all
from latentforge.evaluate.features import INCEPTION_SIZE, EncoderExtractor, InceptionExtractor, clean_resize, load_clip
from latentforge.train.run import RunConfig, train
from tiny_models import (
    make_raw_dataset,
    make_tiny_bert,
    make_tiny_clip_model,
    make_tiny_dinov2,
    make_tiny_inception_weights,
    make_tiny_vae,
)

PROMPTS = ["a small red circle in the corner", "a big blue square", "a tiny green star", "a large white cross"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval_models")
    return {"inception": make_tiny_inception_weights(root / "pt_inception-random.pth", seed=0),
            "inception_other": make_tiny_inception_weights(root / "pt_inception-random-1.pth", seed=1),
            "clip": make_tiny_clip_model(root / "clip"), "dino": make_tiny_dinov2(root / "dinov2-tiny")}


@pytest.fixture(scope="module")
def inception64(models) -> InceptionExtractor:
    return InceptionExtractor(models["inception"], feature=64)


def make_images(n: int, seed: int, size: int = 32) -> list[Image.Image]:
    """Coloured rectangles on coloured backgrounds (structured images, not white noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = np.empty((size, size, 3), np.uint8)
        a[:] = rng.integers(0, 256, 3)
        x0, y0 = rng.integers(0, size // 2, 2)
        x1, y1 = rng.integers(size // 2 + 1, size + 1, 2)
        a[y0:y1, x0:x1] = rng.integers(0, 256, 3)
        out.append(Image.fromarray(a))
    return out


def add_noise(images: list[Image.Image], sigma: float, seed: int = 7) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(np.clip(np.asarray(im, np.float64) + rng.normal(0, sigma, (*im.size[::-1], 3)), 0, 255)
                            .round().astype(np.uint8)) for im in images]


def write_folder(root: Path, images: list[Image.Image]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images):
        im.save(root / f"{i:04d}.png")
    return root


def scipy_fid(a: np.ndarray, b: np.ndarray) -> float:
    """Heusel et al. 2017, eq. 6, written out with scipy's matrix square root (pytorch-fid's way)."""
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


# ---------------------------------------------------------------- metric math


def test_frechet_distance_matches_scipy_sqrtm_on_fixed_features():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(60, 6)) @ rng.normal(size=(6, 6))
    b = rng.normal(0.5, 1.5, size=(50, 6)) @ rng.normal(size=(6, 6))
    expected = scipy_fid(a, b)
    assert expected > 1
    assert metrics.frechet_distance(torch.tensor(a), torch.tensor(b)) == pytest.approx(expected, rel=1e-6)
    assert metrics.frechet_distance(torch.tensor(a), torch.tensor(a)) == pytest.approx(0, abs=1e-8)


def test_kid_matches_numpy_unbiased_mmd():
    """With one subset of all samples the subset draw does not matter: KID is the unbiased MMD^2
    with k(x, y) = (x.y / d + 1)^3 (Bińkowski et al. 2018), written out here in numpy."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(30, 5)), rng.normal(0.3, 1.2, size=(30, 5))
    k = lambda u, v: (u @ v.T / u.shape[1] + 1) ** 3  # noqa: E731
    m = len(x)
    kxx, kyy, kxy = k(x, x), k(y, y), k(x, y)
    expected = ((kxx.sum() - np.trace(kxx)) / (m * (m - 1)) + (kyy.sum() - np.trace(kyy)) / (m * (m - 1))
                - 2 * kxy.mean())
    mean, std = metrics.kernel_inception_distance(torch.tensor(x), torch.tensor(y), subset_size=m, subsets=1)
    assert mean == pytest.approx(expected, rel=1e-6) and std == 0
    # Subsets are drawn from a seeded generator: the same seed gives the same value.
    state = torch.random.get_rng_state()
    a = metrics.kernel_inception_distance(torch.tensor(x), torch.tensor(y), subset_size=10, subsets=5, seed=3)
    assert a == metrics.kernel_inception_distance(torch.tensor(x), torch.tensor(y), subset_size=10, subsets=5, seed=3)
    # ... and the seed is used (another draws other subsets), without touching the global generator
    assert a != metrics.kernel_inception_distance(torch.tensor(x), torch.tensor(y), subset_size=10, subsets=5, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    with pytest.raises(UserError, match="KID: subset size 31 needs at least 31 images"):
        metrics.kernel_inception_distance(torch.tensor(x), torch.tensor(y), subset_size=31)


def test_fid_sample_warning_says_how_many_are_needed():
    assert metrics.fid_sample_warning(5000, 5000, 2048) is None
    msg = metrics.fid_sample_warning(100, 300, 2048)
    assert "100 images for 2048-dim features" in msg and "at least 2049 images" in msg
    # the boundary: N = D samples give a covariance of rank D - 1, still singular; D + 1 is the first that is not
    assert "2048 images for 2048-dim features" in metrics.fid_sample_warning(2048, 5000, 2048)
    assert metrics.fid_sample_warning(5000, 2049, 2048) is None
    with pytest.raises(UserError, match="at least 2 images"):
        metrics.fid_sample_warning(1, 10, 64)


# ---------------------------------------------------------------- feature extractors


def test_clean_resize_is_pil_bicubic_in_float_to_299():
    """clean-fid's resize: PIL bicubic per channel in float. torch's antialiased bicubic uses PIL's
    kernel (a = -0.5), so it is an independent computation of the same thing; PIL's uint8 path
    clips between its two passes and differs at sharp edges, and so does plain bicubic (a = -0.75)."""
    im = make_images(1, 0)[0]
    ours = clean_resize(im, INCEPTION_SIZE)
    assert ours.shape == (299, 299, 3) and ours.dtype == np.uint8
    x = torch.from_numpy(np.asarray(im, np.float32)).permute(2, 0, 1)[None]
    resize = lambda aa: torch.nn.functional.interpolate(x, size=(299, 299), mode="bicubic", antialias=aa,  # noqa: E731
                                                        align_corners=False)[0].permute(1, 2, 0).clamp(0, 255).round()
    assert np.abs(resize(True).numpy() - ours).max() == 0
    assert np.abs(resize(False).numpy() - ours).max() > 2
    pil_uint8 = np.asarray(im.resize((299, 299), Image.Resampling.BICUBIC), np.int16)
    assert np.abs(pil_uint8 - ours.astype(np.int16)).max() > 2


def test_inception_matches_torchmetrics_own_loader(models):
    """Our verified loading gives the network torchmetrics builds from the same file with its own
    loader, on the 2048 layer; and the FID of torchmetrics' FrechetInceptionDistance class (its own
    network and statistics) equals ours on layer 64 for the same clean-resized images."""
    from torchmetrics.image.fid import FrechetInceptionDistance, NoTrainInceptionV3

    real, fake = make_images(8, 0), add_noise(make_images(8, 0), 30)
    to_uint8 = lambda ims: torch.from_numpy(np.stack([clean_resize(i, 299) for i in ims])).permute(0, 3, 1, 2)  # noqa: E731
    ours = InceptionExtractor(models["inception"], feature=2048)(real[:2])
    theirs = NoTrainInceptionV3("inception-v3-compat", ["2048"], str(models["inception"]))(to_uint8(real[:2]))
    assert ours.shape == (2, 2048) and ours.std() > 0.01
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-6)

    ex = InceptionExtractor(models["inception"], feature=64)
    fid = FrechetInceptionDistance(feature=64, feature_extractor_weights_path=str(models["inception"]))
    fid.update(to_uint8(real), real=True)
    fid.update(to_uint8(fake), real=False)
    assert metrics.frechet_distance(ex(real), ex(fake)) == pytest.approx(float(fid.compute()), rel=1e-4)


def test_fid_of_a_set_with_itself_is_zero_and_grows_with_noise(inception64):
    images = make_images(12, 3)
    ref = inception64(images)
    self_fid = metrics.frechet_distance(ref, inception64(images))
    fids = [metrics.frechet_distance(ref, inception64(add_noise(images, s))) for s in (4, 24, 96)]
    # 12 images of 64-dim features: singular covariances, so "0" is 0 up to the eigenvalue
    # round-off of a rank-deficient product (measured 4e-7 against 9e-3 for noise of 4/255).
    assert abs(self_fid) < 1e-3 * fids[0]
    assert fids == sorted(fids) and fids[0] > 0, fids
    assert fids[-1] > 5 * fids[0]


def test_fd_encoder_is_the_dinov2_cls_token(models):
    from transformers import AutoImageProcessor, Dinov2Model

    images = make_images(6, 4)
    ex = EncoderExtractor(models["dino"])
    model = Dinov2Model.from_pretrained(str(models["dino"])).eval()
    pixels = AutoImageProcessor.from_pretrained(str(models["dino"]))(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        direct = model(pixel_values=pixels).last_hidden_state[:, 0]  # after the final norm: x_norm_clstoken
    torch.testing.assert_close(ex(images), direct)
    many, others = make_images(24, 4), make_images(24, 5)  # more images than feature dims: full-rank covariances
    assert ex.dim == 16 and abs(metrics.frechet_distance(ex(many), ex(many))) < 1e-6
    assert metrics.frechet_distance(ex(many), ex(others)) > 1e-3


def test_clip_score_matches_a_direct_cosine(models):
    """torchmetrics' CLIPScore on our CLIP directory = 100 * mean cosine of the model's own embeddings;
    the tokenizer is real (words become their own tokens) and the prompts change the score."""
    from transformers import CLIPModel, CLIPProcessor

    images = make_images(4, 5)
    chw = [torch.from_numpy(np.asarray(i).copy()).permute(2, 0, 1) for i in images]
    model, processor, _ = load_clip(models["clip"])
    assert processor.tokenizer.tokenize("a red circle") == ["a</w>", "red</w>", "circle</w>"]
    score = metrics.clip_score(chw, PROMPTS, model, processor, batch_size=3)
    ref = CLIPModel.from_pretrained(str(models["clip"])).eval()
    inputs = CLIPProcessor.from_pretrained(str(models["clip"]))(text=PROMPTS, images=images, return_tensors="pt",
                                                                padding=True)
    with torch.no_grad():
        out = ref(**inputs)
    cos = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds)
    assert score == pytest.approx(max(float(100 * cos.mean()), 0.0), rel=1e-4, abs=1e-4)
    other = metrics.clip_score(chw, ["a black diamond"] * 4, model, processor)
    assert other != pytest.approx(score, abs=1e-3)


def test_prompts_from_text_jsonl_parquet_and_raw_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from latentforge.evaluate.inputs import load_prompts

    (tmp_path / "p.txt").write_text("a red circle\n\n  a blue square  \n")
    assert load_prompts(str(tmp_path / "p.txt")) == ["a red circle", "a blue square"]
    (tmp_path / "p.jsonl").write_text('{"text": "a red circle"}\n\n{"text": "a star"}\n')
    assert load_prompts(str(tmp_path / "p.jsonl"), "text") == ["a red circle", "a star"]
    with pytest.raises(UserError, match="line 1: no 'caption' field"):
        load_prompts(str(tmp_path / "p.jsonl"))
    pq.write_table(pa.table({"caption": ["x y", None, "z"], "n": [1, 2, 3]}), tmp_path / "p.parquet")
    assert load_prompts(str(tmp_path / "p.parquet")) == ["x y", "z"]
    with pytest.raises(UserError, match="no 'text' column"):
        load_prompts(str(tmp_path / "p.parquet"), "text")
    raw = make_raw_dataset(tmp_path / "raw", n=5, resolution=8, num_shards=2)
    rows = [r for s in sorted(raw.glob("shard-*.parquet")) for r in pq.read_table(s, columns=["caption"]).to_pylist()]
    assert load_prompts(str(raw)) == [r["caption"] for r in rows] and len(rows) == 5
    with pytest.raises(UserError, match="prompt file not found"):
        load_prompts(str(tmp_path / "missing.txt"))


# ---------------------------------------------------------------- the evaluation run


@dataclass(frozen=True)
class TinyRun:
    path: Path  # the run directory
    raw: Path  # its raw dataset (16 px, captions): prompts and reference images


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> TinyRun:
    """A run of 2 steps on 12 raw images at 16 px; its VAE has no shift factor, so it exports."""
    root = tmp_path_factory.mktemp("eval_run")
    raw = make_raw_dataset(root / "raw", n=12, resolution=16, num_shards=2)
    encode_dataset(str(raw), str(root / "latents"), EncodeConfig(
        vae=str(make_tiny_vae(root / "vae", shift_factor=None)), text_encoder=str(make_tiny_bert(root / "bert")),
        max_length=8, batch_size=12, device="cpu"), progress=False)
    cfg = from_dict(RunConfig, {
        "train": {"unet": {"preset": "tiny"}, "ema": {"decay": 0.5}, "optim": {"lr": 1e-2},
                  "phases": [{"datasets": [{"path": str(root / "latents")}], "steps": 2}],
                  "micro_batch_size": 4, "device": "cpu", "loggers": [], "checkpoint": {"every_steps": 100}},
        "data": {"num_workers": 0, "cache_dir": str(root / "cache")},
    })
    assert train(cfg, root / "run", progress=False)["finished"]
    return TinyRun(root / "run", raw)


def eval_config(run: TinyRun | Path, prompts: Path, **kw) -> EvalConfig:
    base = {"checkpoint": str(run.path if isinstance(run, TinyRun) else run), "prompts": str(prompts),
            "num_steps": 3, "batch_size": 3, "device": "cpu",
            "guidance_scales": [1.0, 4.0], "inception_feature": 64, "kid_subset_size": 4, "kid_subsets": 5}
    return from_dict(EvalConfig, {**base, **kw})


def _pngs(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*.png"))}


def test_eval_end_to_end_metrics_cache_and_invalidation(tiny_run, models, inception64, tmp_path):
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(PROMPTS) + "\n\n")
    ref_dir = write_folder(tmp_path / "ref", make_images(8, 9, size=16))
    cfg = eval_config(tiny_run, prompt_file, num_images=7, reference=str(ref_dir), inception=str(models["inception"]),
                      fd_encoders=[str(models["dino"])], clip=str(models["clip"]), cache_dir=str(tmp_path / "cache"))
    res = evaluate(cfg, tmp_path / "out", progress=False)

    assert [r["guidance_scale"] for r in res["rows"]] == [1.0, 4.0]
    assert res["reference"]["inception64"]["cache"] == "computed"
    assert res["reference"]["dinov2-tiny"]["cache"] == "computed"
    assert Path(res["reference"]["inception64"]["path"]).parent == ref_dir / ".latentforge-eval-cache"
    # The numbers are the metrics of the images on disk, recomputed here from the PNGs.
    gen = [Image.open(tmp_path / "out" / "images" / "cfg-4" / f"{i:06d}.png").convert("RGB") for i in range(7)]
    ref_imgs = [Image.open(p).convert("RGB") for p in sorted(ref_dir.glob("*.png"))]
    row = res["rows"][1]
    assert row["fid64"] == pytest.approx(scipy_fid(inception64(ref_imgs).double().numpy(),
                                                   inception64(gen).double().numpy()), rel=1e-4)
    assert row["kid"] > -1 and "kid_std" in row and "fd_dinov2-tiny" in row and row["clip_score"] >= 0
    assert res["rows"][0]["fid64"] != pytest.approx(row["fid64"])  # guidance changes the images
    assert any("covariance is singular" in w for w in res["warnings"])
    md = (tmp_path / "out" / "results.md").read_text()
    assert md.startswith("| guidance | images | fid64 | kid | fd_dinov2-tiny | clip_score |") and "| 4 | 7 |" in md
    assert (tmp_path / "out" / "tradeoff.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out" / "results.json").read_text())["rows"] == res["rows"]

    # Same reference, same weights: the cached features are used (none is extracted again) and the
    # finished batches are not generated again.
    again = evaluate(cfg, tmp_path / "out", progress=False)
    assert again["reference"]["inception64"]["cache"] == "hit" and again["reference"]["dinov2-tiny"]["cache"] == "hit"
    assert again["generation"]["generated_batches"] == 0 and again["rows"] == res["rows"]
    # Proof that the cache file is what is read: features written into it change the result.
    import safetensors.torch

    cache_file = Path(res["reference"]["inception64"]["path"])
    with safetensors.safe_open(str(cache_file), "pt") as f:
        meta, feats = f.metadata(), f.get_tensor("features")
    safetensors.torch.save_file({"features": feats + 1.0}, str(cache_file), metadata=meta)
    shifted = evaluate(cfg, tmp_path / "out", progress=False)
    assert shifted["rows"][1]["fid64"] != pytest.approx(row["fid64"], rel=1e-3)

    # Other weights: computed again (another key); the DINOv2 features stay cached.
    other = evaluate(eval_config(tiny_run, prompt_file, num_images=7, reference=str(ref_dir),
                                 inception=str(models["inception_other"]), fd_encoders=[str(models["dino"])]),
                     tmp_path / "out", progress=False)
    assert other["reference"]["inception64"]["cache"] == "computed"
    assert other["reference"]["inception64"]["path"] != str(cache_file)
    assert other["reference"]["dinov2-tiny"]["cache"] == "hit"
    # Another image list (one more reference image): computed again.
    make_images(1, 10, size=16)[0].save(ref_dir / "extra.png")
    more = evaluate(cfg, tmp_path / "out", progress=False)
    assert more["reference"]["inception64"]["cache"] == "computed" and more["reference"]["inception64"]["num_images"] == 9
    # Images of other generation settings are never mixed into OUT.
    with pytest.raises(UserError, match=r"holds images generated with other settings \(seed changed\)"):
        evaluate(eval_config(tiny_run, prompt_file, num_images=7, seed=1, clip=str(models["clip"])), tmp_path / "out",
                 progress=False)
    # One evaluation at a time in OUT (it resumes, so a second one would write the same images): after its checks.
    from latentforge.storage import directory_lock

    with directory_lock(tmp_path / "out", "latentforge eval"):
        with pytest.raises(UserError, match=r"out: another latentforge eval is working in this directory \(process"):
            evaluate(cfg, tmp_path / "out", progress=False, lock="latentforge eval")


def test_ranks_split_the_batches_and_give_the_images_of_one_rank(tiny_run, tmp_path):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"caption": p, "other": 1}) + "\n" for p in PROMPTS))
    cfg = eval_config(tiny_run, prompt_file, num_images=8, guidance_scales=[3.0])
    prompts = [PROMPTS[i % 4] for i in range(8)]
    one = generate_all(cfg, prompts, tmp_path / "one", progress=False)
    r0 = generate_all(cfg, prompts, tmp_path / "two", rank=0, world_size=2, progress=False)
    r1 = generate_all(cfg, prompts, tmp_path / "two", rank=1, world_size=2, progress=False)
    assert one["batches"] == 3 and (r0["batches"], r1["batches"]) == (2, 1)
    a, b = _pngs(tmp_path / "one"), _pngs(tmp_path / "two")
    assert len(a) == 8 and a == b
    manifests = sorted(p.name for p in (tmp_path / "two" / "images" / "cfg-3").glob("manifest-*"))
    assert manifests == ["manifest-rank0.jsonl", "manifest-rank1.jsonl"]
    assert len(set(a.values())) == 8  # different seeds and prompts: different images
    # Batch 1 (images 3-5) is what `generate` gives for its prompts with seed + 1, computed directly.
    from latentforge.inference import generate, load_components

    c = load_components(tiny_run.path)
    direct = generate(c.unet, c.vae, c.text_model, c.tokenizer, c.noise, c.max_length, prompts[3:6], seed=cfg.seed + 1,
                      num_steps=cfg.num_steps, guidance_scale=3.0, sampler=cfg.sampler)
    saved = [np.asarray(Image.open(tmp_path / "one" / "images" / "cfg-3" / f"{i:06d}.png")) for i in range(3, 6)]
    assert all(np.array_equal(np.asarray(d), s) for d, s in zip(direct, saved))


def test_torchrun_two_ranks_split_the_prompts_and_rank_0_measures(tiny_run, models, tmp_path):
    """``torchrun --nproc_per_node 2 -m latentforge eval``: each rank writes its own batches (its own
    manifest), rank 0 alone prints and writes the results, and the images are those of one process."""
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(PROMPTS) + "\n")
    args = ["eval", "--checkpoint", str(tiny_run.path), "--prompts", str(prompt_file), "--clip", str(models["clip"]),
            "--cfg", "2", "--num-images", "6", "--steps", "3", "--batch-size", "2", "eval.device=cpu", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "latentforge", *args, "--out", str(tmp_path / "two")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("| guidance | images | clip_score |") == 1  # rank 0 only
    d = tmp_path / "two" / "images" / "cfg-2"
    assert [json.loads(x)["batch"] for x in (d / "manifest-rank0.jsonl").read_text().splitlines()] == [0, 2]
    assert [json.loads(x)["batch"] for x in (d / "manifest-rank1.jsonl").read_text().splitlines()] == [1]
    cfg = eval_config(tiny_run, prompt_file, num_images=6, guidance_scales=[2.0], batch_size=2)
    generate_all(cfg, [PROMPTS[i % 4] for i in range(6)], tmp_path / "one", progress=False)
    assert _pngs(tmp_path / "two" / "images") == _pngs(tmp_path / "one" / "images")
    assert len(json.loads((tmp_path / "two" / "results.json").read_text())["rows"]) == 1


def test_killed_eval_resumes_with_the_images_of_an_uninterrupted_run(tiny_run, models, tmp_path):
    """The CLI is SIGKILLed mid-generation (after its first finished batch, before the last) and rerun:
    the finished batches are kept, the rest generated, and images and metrics equal a straight run."""
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(PROMPTS) + "\n")
    ref_dir = write_folder(tmp_path / "ref", make_images(6, 11, size=16))
    args = ["eval", "--checkpoint", str(tiny_run.path), "--prompts", str(prompt_file), "--reference", str(ref_dir),
            "--inception", str(models["inception"]), "--cfg", "1,4", "--num-images", "8", "--steps", "6",
            "--batch-size", "1", "--seed", "5", "eval.inception_feature=64", "eval.kid_subset_size=4",
            "eval.device=cpu", "--quiet"]
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                                                   os.environ.get("PYTHONPATH", "")])}
    manifest = out / "images" / "cfg-1" / "manifest-rank0.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "latentforge", *args, "--out", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (manifest.exists() and manifest.read_text().count("\n") >= 2):
            assert proc.poll() is None, f"eval exited with {proc.returncode}: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "no finished batch after 240 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    done_before = len(manifest.read_text().splitlines())
    assert not (out / "results.json").exists() and done_before < 8, "the run finished before it was killed"

    assert main(args + ["--out", str(out)]) == 0
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["generation"]["resumed_batches"] >= done_before and resumed["generation"]["generated_batches"] > 0
    straight = tmp_path / "straight"
    assert main(args + ["--out", str(straight)]) == 0
    assert _pngs(out / "images") == _pngs(straight / "images") and len(_pngs(out / "images")) == 16
    assert resumed["rows"] == json.loads((straight / "results.json").read_text())["rows"]


def test_exported_diffusers_dir_on_raw_shard_prompts_and_reference(tiny_run, models, tmp_path):
    """The exported pipeline, evaluated on the captions and images of raw shards, gives the checkpoint's
    images (the export reproduces sampling; PNG rounding and float order allow 2/255) and so its metrics."""
    export = tmp_path / "export"
    assert main(["export", "--checkpoint", str(tiny_run.path), "--out", str(export)]) == 0
    kw = dict(reference=str(tiny_run.raw), num_images=5, guidance_scales=[3.0],
              clip=str(models["clip"]), fd_encoders=[str(models["dino"])], cache_dir=str(tmp_path / "cache"))
    ckpt = evaluate(eval_config(tiny_run, tiny_run.raw, **kw), tmp_path / "ckpt", progress=False)
    pipe = evaluate(eval_config(export, tiny_run.raw, **kw), tmp_path / "pipe", progress=False)
    assert pipe["models"]["generator"]["kind"] == "diffusers" and ckpt["models"]["generator"]["kind"] == "checkpoint"
    a, b = (np.stack([np.asarray(Image.open(tmp_path / d / "images" / "cfg-3" / f"{i:06d}.png"), np.int16)
                      for i in range(5)]) for d in ("ckpt", "pipe"))
    assert np.abs(a - b).max() <= 2 and a.std() > 1
    assert pipe["reference"]["dinov2-tiny"]["num_images"] == 12 and pipe["reference"]["dinov2-tiny"]["cache"] == "hit"
    assert pipe["rows"][0]["clip_score"] == pytest.approx(ckpt["rows"][0]["clip_score"], abs=0.5)
    # The prompts are the raw shards' captions, in order.
    from latentforge.evaluate.inputs import load_prompts

    captions = load_prompts(str(tiny_run.raw))
    assert len(captions) == 12 and captions[0].startswith("a ")


# ---------------------------------------------------------------- bad input: one line, exit code 2


class Payload:
    """An object that a full unpickle would construct (and could run code for): weights_only refuses it."""


def _cli_error(capsys, args: list[str]) -> str:
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    err = [x for x in lines if "it/s]" not in x]  # transformers' "Loading weights" progress bars are not errors
    assert len(err) == 1 and err[0].startswith("latentforge: error: "), err
    return err[0]


@pytest.fixture
def cli_inputs(tmp_path) -> dict[str, Path]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    return {"prompts": prompts, "ref": write_folder(tmp_path / "ref", make_images(3, 0, size=16))}


def test_bad_weights_give_one_line(models, cli_inputs, tmp_path, capsys):
    base = ["eval", "--checkpoint", str(tmp_path), "--prompts", str(cli_inputs["prompts"]), "--reference",
            str(cli_inputs["ref"]), "--out", str(tmp_path / "out")]
    assert "weights file not found" in _cli_error(capsys, base + ["--inception", str(tmp_path / "nope.pth")])

    text = tmp_path / "notes.pth"
    text.write_text("not weights")
    assert "not a weights file readable with weights_only=True" in _cli_error(capsys, base + ["--inception", str(text)])

    evil = tmp_path / "evil.pth"
    torch.save({"fc.weight": torch.zeros(1), "x": Payload()}, evil)
    assert "weights_only=True" in _cli_error(capsys, base + ["--inception", str(evil)])

    state = torch.load(models["inception"], weights_only=True)
    state["fc.weight"] = torch.zeros(10, 2048)  # another classifier head
    del state["Mixed_7c.branch_pool.conv.weight"]
    wrong = tmp_path / "wrong.safetensors"
    import safetensors.torch

    safetensors.torch.save_file(state, str(wrong))
    msg = _cli_error(capsys, base + ["--inception", str(wrong)])
    assert "not the FID Inception-v3 weights" in msg and "1 missing tensors (e.g. Mixed_7c.branch_pool.conv.weight)" in msg
    assert "fc.weight: (10, 2048) in the file, (1008, 2048) in the network" in msg
    assert not (tmp_path / "out").exists()


def test_other_bad_input_gives_one_line(models, cli_inputs, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    base = ["eval", "--checkpoint", str(tmp_path), "--reference", str(cli_inputs["ref"]), "--out", str(tmp_path / "o")]
    assert "no prompts in it" in _cli_error(capsys, base + ["--prompts", str(empty), "--clip", str(models["clip"])])
    msg = _cli_error(capsys, base + ["--prompts", str(cli_inputs["prompts"]), "--inception", str(models["inception"]),
                                     "eval.inception_feature=64", "--num-images", "5"])
    assert "KID: subset size 1000 needs at least 1000 images" in msg and "got 3 reference and 5 generated" in msg
    assert "no metric to compute" in _cli_error(capsys, base + ["--prompts", str(cli_inputs["prompts"])])
    assert "not a CLIP model directory" in _cli_error(capsys, base + ["--prompts", str(cli_inputs["prompts"]),
                                                                      "--clip", str(models["dino"])])
    msg = _cli_error(capsys, base + ["--prompts", str(cli_inputs["prompts"]), "--fd-encoder", str(models["dino"]),
                                     "eval.plot_metric=fid"])
    assert "eval.plot_metric: 'fid' is not computed by this evaluation (it computes: fd_dinov2-tiny)" in msg
    assert "--cfg: expected comma-separated numbers" in _cli_error(capsys, base + ["--cfg", "1,x"])
    assert "eval.guidance_scales: duplicates" in _cli_error(capsys, base + ["--cfg", "2,2"])
