"""Unpadding's document mask: FlexAttention's block lists made from each 128-token block's
first and last row (the generated `document_mask`) against create_block_mask, which
evaluates every (query, key) pair of the packed tokens. Rows of 16-128 tokens (BERT
pretraining's length 128, padded rows unpadded), 1 to 256 rows per batch; median of 5.

    python bench/document_mask.py [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import generate, scratch
from torch.nn.attention.flex_attention import create_block_mask


def timed(build, device: str) -> float:
    """Median milliseconds of build() over 5 calls after one warm-up call."""
    build()
    times = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        build()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    project = generate("mosaicbert", scratch())
    sys.path.insert(0, str(project))
    import model  # the generated model.py

    generator = torch.Generator().manual_seed(0)
    print(f"device {args.device}, torch {torch.__version__}")
    print(
        f"{'rows':>5} {'tokens':>7} {'create_block_mask ms':>21} {'document_mask ms':>17}"
    )
    for rows in (1, 16, 64, 256):
        lengths = torch.randint(16, 129, (rows,), generator=generator)
        row = torch.repeat_interleave(torch.arange(rows), lengths).to(args.device)
        tokens = len(row)

        def same_row(batch, head, q_idx, kv_idx):
            return row[q_idx] == row[kv_idx]

        pairs = timed(
            lambda: create_block_mask(
                same_row, None, None, tokens, tokens, device=args.device
            ),
            args.device,
        )
        blocks = timed(lambda: model.document_mask(row), args.device)
        print(
            f"{rows:5d} {tokens:7d} {pairs:21.2f} {blocks:17.2f}  ({pairs / blocks:.0f}x)"
        )


if __name__ == "__main__":
    main()
