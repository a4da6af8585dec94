"""The demo's judge at the recipe's settings: its validation on fresh renders and its agreement
with the labels assigned by eye in tests/fixtures/judge/.

    python bench/bench_judge.py [--vae runs/demo/vae] [--work /tmp/judge-bench] [--flip-table] [demo.judge.KEY=VALUE ...]

Trains the judge exactly as ``latentforge demo`` does (recipe tiny-cpu: its ``synth`` data and
``demo.judge``, with the given overrides; on ``demo.judge.threads`` threads, as the demo),
validates it as the demo does (``validate_judge`` on fresh renders of another seed: clean,
blurred, down/up-sampled, through ``--vae`` if given, and fresh non-shapes per kind) and prints
its agreement with the fixture per attribute: with the first labels for the images of the weak
model (000-065), of the stronger one (066-125) and for all; for all with the second labeller's
labels, the third's and the labels all three gave; the labellers' agreement with each other;
then every disagreement with the first labels; then, per set of tests/fixtures/judge-samples/ (images
of the demo's models labelled by blind labellers), the agreement with each and with the labels all gave,
each labeller's agreement with the labels all the others gave (what a person reaches), and the
images with both colour and shape right by the judge and by the labellers. ``--flip-table``: also the shape verdicts at
floors 0.5-0.9 with one view, and with a horizontally flipped second view (all six shapes are
symmetric about the vertical axis) whose probabilities are averaged (``mean``) or whose lower
probability of the chosen class counts (``min``): per row the real renders' shape accuracy per
condition, the fresh non-shapes rejected and the fixture's shape agreement. Prints figures; the
training seconds depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from itertools import combinations
from pathlib import Path

import torch
from PIL import Image

from latentforge.data.synth import generate
from latentforge.evaluate.judge import (ATTRIBUTES, agreed_labels, agreement, build_judge, labelled_figures,
                                        read_labelled_samples, validate_judge, verdicts)
from latentforge.recipe import load_recipe

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "judge"
SAMPLES = FIXTURE.with_name("judge-samples")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vae", default="", help="a trained VAE directory (the demo's OUT/vae) for the ceiling row")
    ap.add_argument("--work", default="/tmp/latentforge-bench-judge", help="where the renders are written")
    ap.add_argument("--flip-table", action="store_true", help="also the floor x flipped-view table of shape verdicts")
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
    for key in ("between_sizes", "below_sizes"):
        r = val[key]
        print(f"  fresh shapes of no dataset size, widths {r['widths'][0]}-{r['widths'][1]}: shape {r['shape']:.1%}, "
              f"colour {r['color']:.1%} of {r['num']}")
    ns = val["nonshapes"]
    print(f"  fresh non-shapes rejected: {ns['shape_rejected']:.1%} of {ns['num']} ("
          + ", ".join(f"{k} {x:.0%}" for k, x in ns["by_kind"].items()) + ")"
          + ("; extra kinds: " + ", ".join(f"{k} {x:.0%}" for k, x in ns["extra_by_kind"].items())
             if ns.get("extra_by_kind") else ""))
    print("  colour 'none' on renders with no colour of the six: "
          + ", ".join(f"{k} {x:.0%}" for k, x in ns["color_rejected_by_kind"].items()))
    labellers = {name: [json.loads(line) for line in (FIXTURE / file).read_text().splitlines() if line]
                 for name, file in (("first", "labels.jsonl"), ("second", "labels-second.jsonl"),
                                    ("third", "labels-third.jsonl"))}
    rows = labellers["first"]
    found = verdicts(judge, [Image.open(FIXTURE / r["file"]) for r in rows], size, cfg.floor)
    parts = {"weak model (000-065)": [i for i, r in enumerate(rows) if int(r["file"][:3]) < 66],
             "stronger model (066-)": [i for i, r in enumerate(rows) if int(r["file"][:3]) >= 66],
             "all": list(range(len(rows)))}
    for name, idx in parts.items():
        c = agreement({a: [found[a][i] for i in idx] for a in ATTRIBUTES}, {a: [rows[i][a] for i in idx] for a in ATTRIBUTES})
        print(f"  fixture, {name}: " + ", ".join(f"{a} {v['right']}/{v['num']}" for a, v in c.items()))
    wanted = {f"the {k} labeller's labels": {a: [r[a] for r in v] for a in ATTRIBUTES}
              for k, v in labellers.items() if k != "first"}
    wanted["the labels all three gave"] = agreed_labels(*labellers.values())
    for name, labels in wanted.items():
        c = agreement(found, labels)
        print(f"  fixture, all, {name}: " + ", ".join(f"{a} {v['right']}/{v['num']}" for a, v in c.items()))
    for (n1, s1), (n2, s2) in combinations(labellers.items(), 2):
        pairs = {a: [(x[a], y[a]) for x, y in zip(s1, s2) if x[a] is not None and y[a] is not None] for a in ATTRIBUTES}
        print(f"  fixture, the {n1} and the {n2} labeller with each other (images both labelled): "
              + ", ".join(f"{a} {sum(x == y for x, y in p)}/{len(p)}" for a, p in pairs.items()))
    for i, r in enumerate(rows):
        for a in ATTRIBUTES:
            if r[a] is not None and found[a][i] != r[a]:
                print(f"    {r['file']} {a}: judge {found[a][i]!r}, by eye {r[a]!r}")
    samples(judge, size, cfg.floor)
    if args.flip_table:
        fixture = [Image.open(FIXTURE / r["file"]) for r in rows]
        flip_table(judge, work / "synth-check", size, cfg, autoencode, fixture, [r["shape"] for r in rows])


def samples(judge, size: int, floor: float) -> None:
    """The judge against the blind labellers of tests/fixtures/judge-samples/ (images of the demo's
    models), per set: agreement per attribute with each labeller and with the labels all gave, and
    both colour and shape right (as the demo scores the prompt's pair) by the judge, by each labeller
    and by all, per split and wording."""
    provenance, label_sets = read_labelled_samples(SAMPLES)
    found = verdicts(judge, [Image.open(SAMPLES / r["file"]) for r in provenance], size, floor)
    figures = labelled_figures(found, provenance, label_sets)
    total = agreement(found, agreed_labels(*label_sets))
    print("  samples, all sets, the labels all gave: " + ", ".join(f"{a} {v['right']}/{v['num']}" for a, v in total.items()))
    for name, f in figures.items():
        idx = [i for i, r in enumerate(provenance) if r.get("set", "all") == name]
        for k, (rows, c) in enumerate(zip(label_sets, f["agreement_each"]), 1):
            who = "/".join(dict.fromkeys(str(rows[i].get("labeller", "?")) for i in idx))
            print(f"  samples {name} ({f['num']}), labeller {k} ({who}): "
                  + ", ".join(f"{a} {v['right']}/{v['num']}" for a, v in c.items()))
        for k, c in enumerate(f["labeller_vs_rest"], 1):
            print(f"  samples {name}, labeller {k} against the labels all the others gave: "
                  + ", ".join(f"{a} {v['right']}/{v['num']}" for a, v in c.items()))
        print(f"  samples {name}, the labels all gave: "
              + ", ".join(f"{a} {v['right']}/{v['num']}" for a, v in f["agreement"].items()))
        for key, g in sorted(f["both_right"].items()):
            print(f"    both right, {key} ({g['num']}): judge {g['judge']}, "
                  + ", ".join(f"labeller {k} {n}" for k, n in enumerate(g["labellers"], 1))
                  + f", all labellers {g['all_labellers']}")


@torch.no_grad()
def flip_table(judge, check_dir: Path, size: int, cfg, autoencode, fixture: list, fixture_shapes: list) -> None:
    """The shape verdicts with one view and with a flipped second view, at floors 0.5-0.9 (see the docstring)."""
    import numpy as np
    import torch.nn.functional as F

    from latentforge.evaluate.judge import NONE, blur, down_up, load_labelled, to_tensor
    from latentforge.evaluate.nonshapes import nonshape_set

    judge.eval()
    x, labels, info = load_labelled(check_dir, size)
    sets = {"clean": x, "blur": blur(x, 1.0), "down_up": down_up(x, 2)}
    if autoencode is not None:
        sets["vae"] = torch.cat([autoencode(x[i:i + 64]) for i in range(0, len(x), 64)]).clamp(-1, 1)
    non = nonshape_set(max(60, cfg.num_nonshapes // 5), cfg.seed + 7919, int(info["config"]["image_size"]))
    is_non = [n.shape == NONE for n in non]
    sets["nonshapes"], sets["fixture"] = to_tensor([n.image for n in non], size), to_tensor(fixture, size)
    views = {k: (F.softmax(judge(v)["shape"], 1), F.softmax(judge(torch.flip(v, dims=[3]))["shape"], 1))
             for k, v in sets.items()}
    names = judge.classes["shape"]

    def verdict(p0: torch.Tensor, p1: torch.Tensor, mode: str, floor: float) -> list[str]:
        k = (p0 if mode == "one view" else p0 + p1).argmax(1)
        q = p0.gather(1, k[:, None])[:, 0]
        if mode == "flip, mean":
            q = (q + p1.gather(1, k[:, None])[:, 0]) / 2
        elif mode == "flip, min":
            q = torch.minimum(q, p1.gather(1, k[:, None])[:, 0])
        return [names[j] if v >= floor else NONE for v, j in zip(q.tolist(), k.tolist())]

    print("\n| verdict | floor | " + " | ".join(k for k in sets if k not in ("nonshapes", "fixture"))
          + " | fresh non-shapes rejected | fixture shapes |")
    for mode in ("one view", "flip, mean", "flip, min"):
        for floor in (0.5, 0.6, 0.7, 0.8, 0.9):
            real = [np.mean([a == b for a, b in zip(verdict(*views[k], mode, floor), labels["shape"]) if b is not None])
                    for k in sets if k not in ("nonshapes", "fixture")]
            rejected = np.mean([v == NONE for v, m in zip(verdict(*views["nonshapes"], mode, floor), is_non) if m])
            agree = sum(v == w for v, w in zip(verdict(*views["fixture"], mode, floor), fixture_shapes) if w is not None)
            print(f"| {mode} | {floor} | " + " | ".join(f"{r:.1%}" for r in real)
                  + f" | {rejected:.1%} of {sum(is_non)} | {agree}/{sum(w is not None for w in fixture_shapes)} |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
