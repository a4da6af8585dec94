"""Time to one epoch of a small fine-tune: latentforge (ingest + encode + train) against a
diffusers-example-style loop (decode + VAE + text encoder every step), and the break-even.

    OMP_NUM_THREADS=1 python bench/bench_finetune_epoch.py [--num 2048] [--rounds 1] [--online] [--mask on|pipeline]
        [--peer-data files|datasets|both] [--captions synth|distinct]

The same data and model on both sides: ``--num`` procedurally generated 64 px PNGs with captions
(the demo's ``synth``, generated before timing), fine-tuned at 32 px; the demo's VAE shape
(untrained: the cost does not depend on the weights), the built-in MiniLM-L6 text encoder (24
tokens), run 13's demo U-Net (4.6M parameters, bench/measured_unet.py), its micro batch (32),
v-prediction with min-SNR 5, AdamW at the recipe's lr, EMA 0.995, fp32, one torch thread (set
OMP_NUM_THREADS=1). ``--mask``: the encode's ``attention_mask`` (on: the text encoder sees the
captions' padding mask, the demo's setting; pipeline: it does not, as SD 1.x/2.x's CLIP), used on
every side; the U-Net's cross-attention sees the mask on the diffusers side only if latentforge's U-Net trains with it
(it does not: ``UNetDenoiser.uses_text_mask``).

``--captions``: ``synth`` keeps the generated captions (templated: ``--num 2048`` gives 1,589
distinct of 2,048, and ``encode`` runs its text encoder once per distinct caption); ``distinct``
appends ", image N" to the N-th caption, so that every caption is new (the worst case for (a)).

(a) latentforge, in this process as the three commands would run it: ``ingest`` (one worker
    process) of the image folder, ``encode`` (loads the encoders), ``train`` for one epoch
    (``steps = num // batch``, the final checkpoint included).
(b) the loop of diffusers' examples/text_to_image/train_text_to_image.py: load the VAE, text
    encoder and tokenizer, then every step read the batch's image and caption files, decode,
    resize + centre-crop + normalise (torchvision, as the example), tokenise, VAE encode and
    sample the latents, text encoder forward, noise, U-Net forward/backward, clip, AdamW
    (torch's default implementation, as the example), and diffusers' ``EMAModel`` (its default
    per-parameter loop). ``--peer-data`` says how it reads the images: ``files`` reads each batch's
    PNG and .txt files with Pillow directly, leaner than the example; ``datasets`` as the example
    does with ``--train_data_dir``: ``load_dataset("imagefolder", data_files={"train": DIR/**})``
    into a new cache directory (a first run has none; its time is counted, as a user waits for it),
    captions from ``metadata.jsonl`` (written, untimed, beside copies of the same PNGs: the
    example's input format), ``with_transform`` decoding and tokenising each sample, and a
    ``DataLoader`` with ``shuffle=True`` and the example's ``collate_fn``. ``both`` times each.
    ``datasets`` is not a dependency of latentforge: ``pip install datasets`` (``.[bench]``).
(c) with ``--online``: ``ingest`` then ``train --online-encode`` (one Ray encoder actor on a local
    Ray instance, its start-up included) for one epoch.

The sides run one after the other, ``--rounds`` times in alternation, in one process (a shared
machine's load then weighs on all alike); medians. The break-even is the number of epochs after
which (a) is ahead: its preparation (ingest + encode) is paid once, each further epoch costs the
training steps only.

Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from latentforge.config import from_dict, to_dict
from latentforge.data.encode import encode_dataset
from latentforge.data.ingest import ingest
from latentforge.data.synth import generate
from latentforge.models.autoencoder import build_vae
from latentforge.models.text import builtin_text_encoder
from latentforge.recipe import load_recipe
from measured_unet import RUN13_UNET
from latentforge.train.run import RunConfig, train


def run_config(recipe, data: Path, steps: int, cache: Path) -> RunConfig:
    t = to_dict(recipe.train)
    t.update(loggers=[], sampling={"prompts": [], "every_steps": 0}, eval={"every_steps": 0},
             optim={**t["optim"], "warmup_steps": 0, "schedule": "constant"},
             checkpoint={"every_steps": 100_000, "keep_last": 1},
             phases=[{"datasets": [{"path": str(data)}], "steps": steps}])
    t["unet"].update(cross_attention_dim=384)
    return from_dict(RunConfig, {"train": t, "data": {**to_dict(recipe.loader), "cache_dir": str(cache)}})


def timed_ingest(recipe, images: Path, out: Path) -> float:
    """Seconds to ingest the image folder into ``out`` (one worker, as every side of the bench)."""
    t0 = time.perf_counter()
    ingest([str(images)], out, replace(recipe.ingest, num_workers=1), progress=False)
    return time.perf_counter() - t0


def ours(recipe, images: Path, enc, tmp: Path, steps: int, tag: str) -> dict[str, float]:
    times = {"ingest": timed_ingest(recipe, images, tmp / f"raw-{tag}")}
    t0 = time.perf_counter()
    encode_dataset(str(tmp / f"raw-{tag}"), str(tmp / f"lat-{tag}"), enc, progress=False)
    times["encode"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    summary = train(run_config(recipe, tmp / f"lat-{tag}", steps, tmp / f"cache-{tag}"), tmp / f"run-{tag}",
                    progress=False)
    times["train"] = time.perf_counter() - t0
    times["steps"] = summary["seconds"]  # the training loop alone (an added epoch costs this)
    return times


def online(recipe, images: Path, enc, tmp: Path, steps: int, tag: str) -> dict[str, float]:
    import ray

    from latentforge.distributed.ray_data import OnlineSource
    from latentforge.distributed.ray_cluster import RayConfig, ray_session

    times = {"ingest": timed_ingest(recipe, images, tmp / f"oraw-{tag}")}
    t0 = time.perf_counter()
    cfg = run_config(recipe, tmp / f"oraw-{tag}", steps, tmp / f"ocache-{tag}")
    with ray_session(RayConfig(), tmp / f"orun-{tag}", quiet=True):
        summary = train(cfg, tmp / f"orun-{tag}", progress=False, source=OnlineSource(enc, 1))
    times["train"] = time.perf_counter() - t0
    times["steps"] = summary["seconds"]
    assert not ray.is_initialized()
    return times


def example_folder(images: Path, out: Path) -> Path:
    """The same PNGs as the diffusers example's ``--train_data_dir`` wants them: an image folder
    with a ``metadata.jsonl`` of ``file_name`` and ``text`` (untimed preparation)."""
    out.mkdir(parents=True)
    with open(out / "metadata.jsonl", "w") as f:
        for png in sorted(images.glob("*.png")):
            shutil.copyfile(png, out / png.name)
            f.write(json.dumps({"file_name": png.name, "text": png.with_suffix(".txt").read_text()}) + "\n")
    return out


def files_batches(images: Path, tf, tokenize, steps: int, batch: int):
    """``--peer-data files``: each batch's PNG and caption files read directly, in a seeded order."""
    from PIL import Image

    files = sorted(images.glob("*.png"))
    order = torch.randperm(len(files)).tolist()
    for step in range(steps):
        sel = [files[i] for i in order[step * batch:(step + 1) * batch]]
        yield torch.stack([tf(Image.open(f).convert("RGB")) for f in sel]), tokenize([f.with_suffix(".txt").read_text()
                                                                                    for f in sel])


def datasets_batches(folder: Path, cache: Path, tf, tokenize, batch: int, seed: int):
    """``--peer-data datasets``: the example's data path (``load_dataset`` imagefolder, a per-sample
    ``with_transform``, a shuffling ``DataLoader`` with its ``collate_fn``)."""
    from datasets import load_dataset

    dataset = load_dataset("imagefolder", data_files={"train": str(folder / "**")}, cache_dir=str(cache))

    def preprocess_train(examples):
        examples["pixel_values"] = [tf(image.convert("RGB")) for image in examples["image"]]
        tokens = tokenize(list(examples["text"]))
        examples["input_ids"], examples["attention_mask"] = tokens.input_ids, tokens.attention_mask
        return examples

    def collate_fn(examples):
        pixel_values = torch.stack([e["pixel_values"] for e in examples]).to(memory_format=torch.contiguous_format)
        return pixel_values.float(), {"input_ids": torch.stack([e["input_ids"] for e in examples]),
                                      "attention_mask": torch.stack([e["attention_mask"] for e in examples])}

    loader = torch.utils.data.DataLoader(dataset["train"].with_transform(preprocess_train), shuffle=True,
                                         collate_fn=collate_fn, batch_size=batch, drop_last=True,
                                         generator=torch.Generator().manual_seed(seed))
    for pixels, tokens in loader:
        yield pixels, SimpleNamespace(**tokens)


def theirs(recipe, images: Path, enc, steps: int, batch: int, seed: int, data: str = "files",
           folder: Path | None = None, cache: Path | None = None) -> dict[str, float]:
    """The diffusers text_to_image example's loop (see the module docstring); ``data``: how it
    reads the images (``files``: ``images`` directly; ``datasets``: ``folder`` through the example's
    data path, cached in ``cache``)."""
    from diffusers import AutoencoderKL, DDPMScheduler
    from diffusers.training_utils import EMAModel, compute_snr
    from torchvision import transforms
    from transformers import AutoModel, AutoTokenizer

    from latentforge.models.denoiser import UNetDenoiser
    from latentforge.models.unet import build_unet

    times = {}
    t0 = time.perf_counter()
    vae = AutoencoderKL.from_pretrained(enc.vae).requires_grad_(False)
    text_encoder = AutoModel.from_pretrained(enc.text_encoder).requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(enc.text_encoder)
    ucfg = replace(recipe.train.unet, in_channels=vae.config.latent_channels, out_channels=vae.config.latent_channels,
                   sample_size=recipe.ingest.image.resolution // 2, cross_attention_dim=384)
    torch.manual_seed(seed)
    unet = build_unet(ucfg).train()
    ema = EMAModel(unet.parameters(), decay=recipe.train.ema.decay)
    opt = torch.optim.AdamW(unet.parameters(), lr=recipe.train.optim.lr, weight_decay=recipe.train.optim.weight_decay)
    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                          prediction_type="v_prediction")
    res = recipe.ingest.image.resolution
    tf = transforms.Compose([transforms.Resize(res, interpolation=transforms.InterpolationMode.BILINEAR),
                             transforms.CenterCrop(res), transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])
    # The same model as (a): with encode.attention_mask "on" the text encoder sees the captions'
    # padding mask (the example's SD CLIP runs unmasked); the U-Net's cross-attention sees it only
    # if latentforge's U-Net trains with it (UNetDenoiser.uses_text_mask: it does not, as SD's).
    masked = enc.attention_mask == "on"
    unet_masked = masked and UNetDenoiser.uses_text_mask

    def tokenize(captions):
        return tokenizer(captions, max_length=enc.max_length, padding="max_length", truncation=True,
                         return_tensors="pt")

    if data == "datasets":
        batches = datasets_batches(folder, cache, tf, tokenize, batch, seed)
    else:
        batches = files_batches(images, tf, tokenize, steps, batch)
    times["load"] = time.perf_counter() - t0  # the models; the datasets path builds its dataset below
    t0 = time.perf_counter()
    for step in range(steps):
        pixels, tokens = next(batches)
        if step == 0:
            times["first_batch"] = time.perf_counter() - t0  # with datasets: load_dataset's build
        mask = tokens.attention_mask if masked else None
        latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (len(pixels),))
        hidden = text_encoder(tokens.input_ids, attention_mask=mask, return_dict=False)[0]
        pred = unet(sched.add_noise(latents, noise, t), t, encoder_hidden_states=hidden,
                    encoder_attention_mask=mask if unet_masked else None).sample
        target = sched.get_velocity(latents, noise, t)
        snr = compute_snr(sched, t)
        weights = torch.stack([snr, 5.0 * torch.ones_like(t)], dim=1).min(dim=1)[0] / (snr + 1)
        loss = (torch.nn.functional.mse_loss(pred, target, reduction="none").mean(dim=[1, 2, 3]) * weights).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ema.step(unet.parameters())
    times["steps"] = time.perf_counter() - t0
    times["train"] = times["load"] + times["steps"]
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=2048, help="images (one epoch)")
    ap.add_argument("--rounds", type=int, default=1, help="alternations of the sides")
    ap.add_argument("--online", action="store_true", help="also time (c), train --online-encode on Ray")
    ap.add_argument("--mask", choices=("on", "pipeline"), default="on", help="encode.attention_mask, all sides")
    ap.add_argument("--peer-data", choices=("files", "datasets", "both"), default="both",
                    help="how (b) reads the images: files directly, or the example's datasets path")
    ap.add_argument("--captions", choices=("synth", "distinct"), default="synth",
                    help="the generated captions, or each made distinct (', image N' appended)")
    args = ap.parse_args()
    recipe = load_recipe("tiny-cpu", RUN13_UNET)
    batch = recipe.train.micro_batch_size
    steps = args.num // batch
    peers = ["files", "datasets"] if args.peer_data == "both" else [args.peer_data]
    if "datasets" in peers and importlib.util.find_spec("datasets") is None:
        raise SystemExit("--peer-data datasets needs the datasets package: pip install datasets (or -e .[bench]), "
                         "or run with --peer-data files")
    if "datasets" in peers:
        import datasets  # noqa: F401  (imported before timing, as every module of the other sides is)
    tmp = Path(tempfile.mkdtemp(prefix="lf-bench-epoch-", dir="/tmp"))
    try:
        generate(tmp / "synth", replace(recipe.synth, num=args.num, num_heldout=0), progress=False)
        images = tmp / "synth" / "train"
        captions = sorted(images.glob("*.txt"))
        if args.captions == "distinct":
            for i, txt in enumerate(captions):
                txt.write_text(f"{txt.read_text()}, image {i}")
        distinct = len({txt.read_text() for txt in captions})
        folder = example_folder(images, tmp / "example-data") if "datasets" in peers else None
        build_vae(recipe.vae.model).save_pretrained(tmp / "vae")
        enc = replace(recipe.encode, vae=str(tmp / "vae"), text_encoder=builtin_text_encoder(), device="cpu",
                      attention_mask=args.mask)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), OMP_NUM_THREADS="
              f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; {args.num} images, batch {batch}, {steps} steps "
              f"= one epoch, encode batch {enc.batch_size}, attention mask {args.mask}, peer data {'+'.join(peers)}, "
              f"{distinct} distinct captions")
        sides = ["ours"] + [f"b-{p}" for p in peers] + (["online"] if args.online else [])
        results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for r in range(args.rounds):
            results["ours"].append(ours(recipe, images, enc, tmp, steps, str(r)))
            for peer in peers:
                results[f"b-{peer}"].append(theirs(recipe, images, enc, steps, batch, r, peer, folder,
                                                   tmp / f"hf-cache-{r}"))
            if args.online:
                results["online"].append(online(recipe, images, enc, tmp, steps, str(r)))
            for side in sides:
                print(f"   round {r} {side:10s}: " + ", ".join(f"{k} {v:.1f} s" for k, v in results[side][-1].items()))
        med = {side: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for side, rs in results.items()}
        o = med["ours"]
        ours_epoch = o["ingest"] + o["encode"] + o["train"]
        print(f"\n(a) latentforge: ingest {o['ingest']:.1f} s + encode {o['encode']:.1f} s + train {o['train']:.1f} s "
              f"(of which the steps {o['steps']:.1f} s) = {ours_epoch:.1f} s to one epoch")
        if "online" in med:
            c = med["online"]
            print(f"(c) ingest {c['ingest']:.1f} s + train --online-encode {c['train']:.1f} s "
                  f"(steps {c['steps']:.1f} s) = {c['ingest'] + c['train']:.1f} s to one epoch")
        for peer in peers:
            t = med[f"b-{peer}"]
            print(f"(b) diffusers-style loop, {peer}: loading {t['load']:.1f} s + steps {t['steps']:.1f} s "
                  f"(first batch {t['first_batch']:.1f} s) = {t['train']:.1f} s to one epoch")
            ahead = t["train"] - ours_epoch
            if ahead >= 0:
                print(f"    break-even against it: within the first epoch (latentforge {ahead:.1f} s ahead after one)")
            elif t["steps"] > o["steps"]:
                epochs = 1 + -ahead / (t["steps"] - o["steps"])
                print(f"    break-even against it: after {epochs:.2f} epochs (latentforge is {-ahead:.1f} s behind "
                      f"after one, and gains {t['steps'] - o['steps']:.1f} s per further epoch)")
            else:
                print("    break-even against it: never (its epoch is not slower than latentforge's training steps)")
        print(json.dumps(med))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
