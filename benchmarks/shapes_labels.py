"""A labelled set of the shapes model's own samples, and the reward's agreement with it.

The shapes reward reads images the way :mod:`digen.rewards.shapes` says; whether that is
how a person reads the blocky, stretched, touching shapes a small model draws is measured
against samples labelled by hand:

    python benchmarks/shapes_labels.py sample --model DIR [--lora DIR] --name base \\
        --per-category 32 --out tests/data/shapes_labels
    python benchmarks/shapes_labels.py sheets --out tests/data/shapes_labels --to /tmp/sheets \\
        [--set base]
    python benchmarks/shapes_labels.py agree --out tests/data/shapes_labels

``sample`` draws held-out and training captions (``per-category`` of each category from
each set) from the weights with the evaluation's fixed noise and settings, and appends the
32 px images to ``<name>.png`` (one row of tiles per 16 images) and their captions to
``samples.jsonl``. ``sheets`` draws the tiles 8 times larger with their index and caption,
24 to a sheet, for labelling by eye (the reader's reading is not shown). Labels go to
``labels.jsonl``, one line per image::

    {"set": "base", "i": 17, "objects": ["red square", "blue ?"], "meets": false}

``objects``: every object a person sees, as colour and shape (``?`` for a blob that is no
circle, square or triangle; ``red square|circle`` for one a person could name either way;
a leading ``~`` for a speck a person could as well overlook); ``meets``: whether the image
meets its caption by GenEval's rule as a person judges it (``null`` where the shapes a
person leaves open decide it). ``agree`` reads every labelled image with the reward and
reports how often its objects pair off with the label's (colour and an allowed shape, one
to one) and, where the label gives one, how often its verdict is the label's, in all and per
set. Four sets are labelled (96 held-out and 96 training captions each, 16 of each category,
10 Euler steps, guidance 3): ``v1-base``, the shapes FLUX shipped before its pretraining on
the pair split; ``v2-base``, the one shipped since; ``v2-rl``, the same after the README's
30-step run with seed 0; ``w4k-base``, the 4000-step pretraining with fixed text encoders
(docs/TRAINING.md, "Word order"), labelled after the reader was settled. The reader gives
the label's verdict on 148 of 163, 168 of 172, 170 of 171 and 156 of 171 decided images
(docs/REWARDS.md has the history).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

COLUMNS = 16
SIDE = 32


def _tiles(path: Path) -> np.ndarray:
    """``[N, 32, 32, 3]`` uint8 from an atlas PNG (tiles in rows of 16, no gaps)."""
    from PIL import Image

    atlas = np.asarray(Image.open(path).convert("RGB"))
    rows, cols = atlas.shape[0] // SIDE, atlas.shape[1] // SIDE
    tiles = atlas.reshape(rows, SIDE, cols, SIDE, 3).transpose(0, 2, 1, 3, 4)
    return tiles.reshape(rows * cols, SIDE, SIDE, 3)


def _write_atlas(path: Path, tiles: np.ndarray) -> None:
    from PIL import Image

    n = len(tiles)
    rows = math.ceil(n / COLUMNS)
    canvas = np.full((rows * COLUMNS, SIDE, SIDE, 3), 255, dtype=np.uint8)
    canvas[:n] = tiles
    grid = canvas.reshape(rows, COLUMNS, SIDE, SIDE, 3).transpose(0, 2, 1, 3, 4)
    Image.fromarray(grid.reshape(rows * SIDE, COLUMNS * SIDE, 3)).save(path, optimize=True)


def load(out: Path) -> tuple[dict[str, np.ndarray], list[dict]]:
    """The sets' tiles by name, and every sample's record (``set``, ``i``, ``caption``)."""
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    names = sorted({r["set"] for r in records})
    return {n: _tiles(out / f"{n}.png") for n in names}, records


def sample(args: argparse.Namespace) -> None:
    from digen.run.shapes_pretrain import evaluate_model, evaluation_prompts

    results, images = evaluate_model(
        args.model,
        steps=args.steps,
        guidance=args.guidance,
        per_category=args.per_category,
        seed=args.seed,
        lora=args.lora,
    )
    chosen = evaluation_prompts(args.per_category)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tiles, records = [], []
    for split in ("heldout", "train"):
        pixels = images[split]
        for k, prompt in enumerate(chosen[split]):
            records.append({"set": args.name, "i": len(tiles), "split": split, "caption": prompt})
            tiles.append(pixels[k, 0].numpy())
    _write_atlas(out / f"{args.name}.png", np.stack(tiles))
    with (out / "samples.jsonl").open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(json.dumps({"set": args.name, "images": len(tiles), "accuracy": results}))


def sheets(args: argparse.Namespace) -> None:
    from PIL import Image, ImageDraw

    sets, records = load(args.out)
    if args.set:
        records = [r for r in records if r["set"] == args.set]
    args.to.mkdir(parents=True, exist_ok=True)
    scale, per_sheet, cols = 8, 24, 6
    cell_w, cell_h = SIDE * scale + 8, SIDE * scale + 36
    for start in range(0, len(records), per_sheet):
        chunk = records[start : start + per_sheet]
        rows = math.ceil(len(chunk) / cols)
        sheet = Image.new("RGB", (cols * cell_w, rows * cell_h), (128, 128, 128))
        draw = ImageDraw.Draw(sheet)
        for j, r in enumerate(chunk):
            tile = Image.fromarray(sets[r["set"]][r["i"]]).resize(
                (SIDE * scale, SIDE * scale), Image.NEAREST
            )
            x, y = (j % cols) * cell_w + 4, (j // cols) * cell_h + 4
            sheet.paste(tile, (x, y))
            draw.text((x, y + SIDE * scale + 2), f"{r['set']} {r['i']}", fill=(255, 255, 255))
            draw.text((x, y + SIDE * scale + 16), r["caption"][:44], fill=(255, 255, 255))
        sheet.save(args.to / f"sheet-{start // per_sheet:03d}.png")
    print(f"{math.ceil(len(records) / per_sheet)} sheets in {args.to}")


def readings(label: str) -> tuple[str, frozenset[str], bool]:
    """A labelled object, ``"red square"`` or ``"red square|circle"`` (a blob a person could
    name either way; ``?``: no circle, square or triangle), with a leading ``~`` when it is
    a speck a person could as well overlook: its colour, the shapes it may be read as
    (``?`` kept as ``?``) and whether it must be read."""
    required = not label.startswith("~")
    colour, _, shapes = label.lstrip("~").partition(" ")
    return colour, frozenset(shapes.split("|")), required


def objects_agree(read: list[tuple[str, str]], labelled: list[str]) -> bool:
    """Whether the reader's objects ``(colour, shape or "?")`` pair off one to one with the
    labelled ones, each read as one of the readings its label allows; a label marked ``~``
    may go unread."""
    allowed = [readings(label) for label in labelled]

    def match(k: int, free: frozenset[int]) -> bool:
        if k == len(read):
            return not any(allowed[j][2] for j in free)
        colour, shape = read[k]
        return any(
            allowed[j][0] == colour and shape in allowed[j][1] and match(k + 1, free - {j})
            for j in free
        )

    return match(0, frozenset(range(len(labelled))))


def agreement(out: Path, options: Any = None) -> dict[str, Any]:
    """How often the reward reads a labelled image as its label does: its objects (colour
    and shape, paired one to one, a label's alternatives each allowed) over every labelled
    image, and its verdict over the images whose label gives one (``meets`` not null); in
    all and per set (``sets``)."""
    from digen.rewards.shapes import find_objects
    from digen.shapes import check, parse

    sets, records = load(out)
    caption = {(r["set"], r["i"]): r["caption"] for r in records}
    labels = [json.loads(line) for line in (out / "labels.jsonl").read_text().splitlines()]
    counts: dict[str, list[int]] = {}  # set -> [images, same objects, decided, same verdict]
    misread = []
    for label in labels:
        frame = sets[label["set"]][label["i"]]
        found = find_objects(frame, options)
        read = [(o.colour, o.shape or "?") for o in found]
        agree = objects_agree(read, label["objects"])
        met = all(r.met for r in check(parse(caption[label["set"], label["i"]]), found))
        c = counts.setdefault(label["set"], [0, 0, 0, 0])
        c[0] += 1
        c[1] += agree
        if label["meets"] is not None:
            c[2] += 1
            c[3] += met == label["meets"]
        if not agree or (label["meets"] is not None and met != label["meets"]):
            misread.append((label["set"], label["i"]))

    def summary(images: int, objects: int, decided: int, verdicts: int) -> dict[str, Any]:
        return {
            "images": images,
            "objects": objects / images,
            "verdicts": decided,
            "verdict": verdicts / max(decided, 1),
        }

    totals = [sum(c[j] for c in counts.values()) for j in range(4)]
    return {
        **summary(*totals),
        "sets": {name: summary(*c) for name, c in sorted(counts.items())},
        "misread": misread,
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/shapes_labels.py")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="sample images to label")
    s.add_argument("--model", type=Path, required=True)
    s.add_argument("--lora", type=Path, default=None)
    s.add_argument("--name", required=True)
    s.add_argument("--per-category", type=int, default=16)
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--guidance", type=float, default=3.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", type=Path, required=True)
    h = sub.add_parser("sheets", help="contact sheets for labelling by eye")
    h.add_argument("--out", type=Path, required=True)
    h.add_argument("--to", type=Path, required=True)
    h.add_argument("--set", default=None, help="only this set's images (default: every set)")
    a = sub.add_parser("agree", help="the reward's agreement with the labels")
    a.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.command == "sample":
        sample(args)
    elif args.command == "sheets":
        sheets(args)
    else:
        print(json.dumps(agreement(args.out)))


if __name__ == "__main__":
    main()
