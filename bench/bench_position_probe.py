"""Does a trained demo model put the shape where the prompt says, or where its initial noise says?

    python bench/bench_position_probe.py RUN_OR_DEMO_DIR [--seeds 8] [--checkpoint CKPT]

For each noise seed, the same prompt ("a small red circle" + each of the nine position phrases
of the training captions) is drawn nine times from the same initial noise, one position each,
with the demo's sampler settings (``demo``: sampler, steps, guidance, EMA weights). The judge,
trained as ``latentforge demo`` trains it (recipe tiny-cpu, ``demo.judge``) on the demo's own
renders (``DIR/synth``), names the place of every image. Prints, per seed, the places drawn; then
how many of the images are where their prompt says (chance: 1 in 9). A model that follows the
position words draws nine places per seed; one whose layout comes from the noise draws one.
Prints figures only; the judge's training takes about 90 s on a quiet 2-vCPU machine.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

from latentforge.data.synth import POSITIONS, caption_for
from latentforge.evaluate.judge import build_judge, verdicts
from latentforge.inference import generate, load_components
from latentforge.recipe import load_recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo_dir", help="a `latentforge demo --out` directory (its synth/ and run/)")
    ap.add_argument("--checkpoint", default="", help="a checkpoint to probe instead of DIR/run (its latest)")
    ap.add_argument("--seeds", type=int, default=8, help="initial-noise seeds")
    ap.add_argument("--shape", default="circle")
    ap.add_argument("--color", default="red")
    ap.add_argument("--size", default="small")
    args = ap.parse_args()
    out = Path(args.demo_dir)
    recipe = load_recipe("tiny-cpu")
    d, size = recipe.demo, recipe.ingest.image.resolution
    judge, _ = build_judge([out / "synth"], size, d.judge)
    comps = load_components(Path(args.checkpoint or out / "run"), use_ema=True)
    prompts = [caption_for(args.shape, args.color, args.size, p, "light", 0) for p in POSITIONS]
    right = 0
    for seed in range(args.seeds):
        images = []
        for prompt in prompts:  # one call per prompt: every prompt starts from the same noise
            images += generate(comps.unet, comps.vae, comps.text_model, comps.tokenizer, comps.noise,
                               comps.max_length, [prompt], seed=seed, num_steps=d.num_steps,
                               guidance_scale=d.guidance_scale, sampler=d.sampler)
        places = verdicts(judge, images, size, d.judge.floor)["position"]
        right += sum(a == b for a, b in zip(places, POSITIONS))
        print(f"seed {seed}: places drawn {dict(collections.Counter(places).most_common())}", flush=True)
    n = args.seeds * len(POSITIONS)
    print(f"where the prompt says: {right} of {n} ({right / n:.0%}; chance {1 / len(POSITIONS):.0%})")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
