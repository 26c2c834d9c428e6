"""Persistent bytes per rank over the YaFSDP floor, from ``yafsdp estimate``, side by side.

    python benchmarks/estimate_floor.py            # the three shapes of issue 32
    python benchmarks/estimate_floor.py --whole    # the same with vocab_chunks=false

Floor = 16 bytes x params / shard group size (fp32 master, grad, AdamW m and v) + 2 bf16
and 2 fp32 block-sized buffers (``tests/test_estimate.py``'s ``_yafsdp_floor``). No
process group, no weights: the estimate plans the model on the meta device.
"""

from __future__ import annotations

import argparse

from lightning_yafsdp.config import load_config
from lightning_yafsdp.estimate import estimate

RECIPE = "recipes/llama3-8b.yaml"
GEMMA2_9B_TIED = [
    "model.vocab_size=256000", "model.dim=3584", "model.n_layers=42", "model.tie_embeddings=true",
]  # fmt: skip
SHAPES = [
    ("Llama 3 8B, 64 ranks", [], 1.05),
    ("Gemma-2-9B shape, tied, 64 ranks", GEMMA2_9B_TIED, 1.10),
    ("Llama 3 8B hybrid 8 x 8", ["strategy.shard_size=8", "trainer.num_nodes=8"], 1.05),
]


def over_the_floor(overrides: list[str], world_size: int = 64) -> tuple[float, float, list[str]]:
    """``(persistent GB, floor GB, notes)`` per rank for the recipe with ``overrides``."""
    est = estimate(load_config(RECIPE, overrides), world_size=world_size)
    block = max(g.padded_numel for g in est.units if g.is_block)
    floor = 16 * est.num_parameters / est.shard_size + 2 * block * 2 + 2 * block * 4
    return est.states / 1e9, floor / 1e9, est.notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--whole", action="store_true", help="strategy.vocab_chunks=false")
    args = parser.parse_args()
    extra = ["strategy.vocab_chunks=false"] if args.whole else []
    print(f"{'shape':36s} {'GB/rank':>8s} {'floor':>7s} {'ratio':>6s}  goal")
    for label, overrides, goal in SHAPES:
        states, floor, notes = over_the_floor([*overrides, *extra])
        ratio = states / floor
        verdict = "met" if ratio <= goal else "missed"
        print(f"{label:36s} {states:8.2f} {floor:7.2f} {ratio:6.3f}  <= {goal}: {verdict}")
        for note in notes:
            print(f"    {note}")


if __name__ == "__main__":
    main()
