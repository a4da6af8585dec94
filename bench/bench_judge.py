"""The demo's judge at the recipe's settings: its validation on fresh renders and its agreement
with the labels assigned by eye in tests/fixtures/judge/.

    python bench/bench_judge.py [--vae runs/demo/vae] [--work /tmp/judge-bench] [demo.judge.KEY=VALUE ...]

Trains the judge exactly as ``latentforge demo`` does (recipe tiny-cpu: its ``synth`` data and
``demo.judge``, with the given overrides), validates it as the demo does (``validate_judge`` on
fresh renders of another seed: clean, blurred, down/up-sampled, through ``--vae`` if given, and
fresh non-shapes per kind) and prints its agreement with the fixture per attribute, for the
images of the weak model (000-065), of the stronger one (066-125) and for all, then every
disagreement. Prints figures; the training seconds depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image

from latentforge.data.synth import generate
from latentforge.evaluate.judge import ATTRIBUTES, agreement, build_judge, validate_judge, verdicts
from latentforge.recipe import load_recipe

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "judge"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vae", default="", help="a trained VAE directory (the demo's OUT/vae) for the ceiling row")
    ap.add_argument("--work", default="/tmp/latentforge-bench-judge", help="where the renders are written")
    ap.add_argument("overrides", nargs="*", help="demo.judge.KEY=VALUE")
    args = ap.parse_args()
    recipe = load_recipe("tiny-cpu", args.overrides)
    cfg, size = recipe.demo.judge, recipe.ingest.image.resolution
    work = Path(args.work)
    if not (work / "synth" / "synth.json").exists():
        generate(work / "synth", recipe.synth, progress=False)
    if not (work / "synth-check" / "synth.json").exists():  # as the demo makes it
        generate(work / "synth-check", replace(recipe.synth, seed=recipe.synth.seed + 1000, num=300, num_heldout=60),
                 progress=False)
    t0 = time.perf_counter()
    judge, _ = build_judge([work / "synth"], size, cfg, progress=True)
    seconds = time.perf_counter() - t0
    autoencode = None
    if args.vae:
        from latentforge.demo import _autoencoder
        from latentforge.models.autoencoder import load_vae

        autoencode = _autoencoder(load_vae(args.vae).eval())
    val = validate_judge(judge, work / "synth-check", size, cfg, autoencode=autoencode)
    print(f"judge {cfg}: trained in {seconds:.0f} s")
    for name, r in val["real"].items():
        print(f"  fresh renders, {name:8s}: " + ", ".join(f"{a} {r[a]:.1%}" for a in ATTRIBUTES) + f" of {r['num']}")
    ns = val["nonshapes"]
    print(f"  fresh non-shapes rejected: {ns['shape_rejected']:.1%} of {ns['num']} ("
          + ", ".join(f"{k} {x:.0%}" for k, x in ns["by_kind"].items()) + ")")
    print("  colour 'none' on renders with no colour of the six: "
          + ", ".join(f"{k} {x:.0%}" for k, x in ns["color_rejected_by_kind"].items()))
    rows = [json.loads(line) for line in (FIXTURE / "labels.jsonl").read_text().splitlines() if line]
    found = verdicts(judge, [Image.open(FIXTURE / r["file"]) for r in rows], size, cfg.floor)
    parts = {"weak model (000-065)": [i for i, r in enumerate(rows) if int(r["file"][:3]) < 66],
             "stronger model (066-)": [i for i, r in enumerate(rows) if int(r["file"][:3]) >= 66],
             "all": list(range(len(rows)))}
    for name, idx in parts.items():
        c = agreement({a: [found[a][i] for i in idx] for a in ATTRIBUTES}, {a: [rows[i][a] for i in idx] for a in ATTRIBUTES})
        print(f"  fixture, {name}: " + ", ".join(f"{a} {v['right']}/{v['num']}" for a, v in c.items()))
    for i, r in enumerate(rows):
        for a in ATTRIBUTES:
            if r[a] is not None and found[a][i] != r[a]:
                print(f"    {r['file']} {a}: judge {found[a][i]!r}, by eye {r[a]!r}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
