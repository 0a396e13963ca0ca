"""The built-in visual task (``builtin:colour_count``): count the cells of a named colour.

Each problem is a 32x32 image of a 4x4 grid of 8-pixel cells, each white or red, green or
blue, and the question "How many <colour> cells?"; the answer is the count, in the DAPO
answer format. The warm-up's answers carry noise (a count off by one, or a last line that
ignores the format), so the warmed-up ``builtin:tiny-vlm`` starts above zero and below
perfect, and RL against the exact scorer has a visual job to do.
"""

from __future__ import annotations

import random
from typing import Any

from dapo.data.records import PromptRecord

NAME = "builtin:colour_count"
DATA_SOURCE = "builtin_colour_count"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 30, 220)}
GRID, CELL = 4, 8
NOISE_COUNT = 0.4  # share of warm-up answers off by one
NOISE_FORMAT = 0.2  # share of warm-up answers that end "Count: X", not "Answer: X"
MAX_PROMPTS = 5000  # problems per split at most (each holds its image; encoding 5,000 takes ~2 s)


def draw(cells: list[str | None]) -> Any:
    """The grid as a PIL image: ``cells[r * GRID + c]`` is a colour name or None (white)."""
    from PIL import Image

    image = Image.new("RGB", (GRID * CELL, GRID * CELL), (255, 255, 255))
    for i, colour in enumerate(cells):
        if colour is not None:
            r, c = divmod(i, GRID)
            box = (c * CELL, r * CELL, (c + 1) * CELL, (r + 1) * CELL)
            image.paste(COLOURS[colour], box)
    return image


def prompt_text(colour: str) -> str:
    return f"<image>How many {colour} cells? End with: Answer: <count>\n"


def sample(rng: random.Random) -> tuple[list[str | None], str]:
    """A grid (each cell filled with probability 1/2, its colour uniform) and a colour."""
    cells = [rng.choice(list(COLOURS)) if rng.random() < 0.5 else None for _ in range(GRID**2)]
    return cells, rng.choice(list(COLOURS))


def _seen(cells: list[str | None], colour: str) -> int:
    return sum(c == colour for c in cells)


def sft_example(rng: random.Random) -> tuple[str, Any, str]:
    """A warm-up example ``(prompt, image, answer)`` with the warm-up noise."""
    cells, colour = sample(rng)
    n = _seen(cells, colour)
    if rng.random() < NOISE_COUNT:
        n = max(0, n + rng.choice([-1, 1]))
    label = "Count" if rng.random() < NOISE_FORMAT else "Answer"
    return prompt_text(colour), draw(cells), f"{label}: {n}"


def colour_count_records(
    split: str = "train", n: int = 4000, seed: int = 1234
) -> list[PromptRecord]:
    """``n`` problems of ``split`` (at most :data:`MAX_PROMPTS`; "train" or "test", drawn
    with distinct seeds, so the held-out grids are new ones almost surely)."""
    if split not in ("train", "test"):
        raise ValueError(f"{NAME} has splits 'train' and 'test', not {split!r}")
    rng = random.Random(f"{seed}-{split}-{NAME}")
    out = []
    for i in range(min(n, MAX_PROMPTS)):
        cells, colour = sample(rng)
        code = "".join("." if c is None else c[0] for c in cells)
        out.append(
            PromptRecord(
                prompt=prompt_text(colour),
                ground_truth=str(_seen(cells, colour)),
                data_source=DATA_SOURCE,
                uid=f"count-{split}-{i}-{code}-{colour}",
                images=[draw(cells)],
            )
        )
    return out
