"""Peak memory of one forward + backward with the loss over chunks of tokens, and without.

One process on the CPU, the reference Llama (``--dim``, ``--layers``, ``--vocab``), a batch
of ``--batch`` x ``--seq`` tokens, next-token cross-entropy with fp32 logits, computed as
the recipes do ([Note: chunked loss], ``model.loss_chunk_size``): the whole logits
(``none``) or ``--chunks`` tokens at a time. Each setting runs in a fresh interpreter with
the memory-pass malloc settings (RSS follows live tensor bytes); the peak RSS of the
forward + backward above the RSS before it (``VmHWM`` reset right before) is the step's
activation peak plus the parameter grads (the same in every setting).

Example::

    python benchmarks/chunked_loss_memory.py --vocab 32000 --seq 512 --chunks none 2048 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._measure import LIVE_MALLOC_ENV, current_rss_kib, hwm_kib, reset_hwm  # noqa: E402


def _one(args: argparse.Namespace, chunk: str) -> dict:
    import torch
    import torch.nn.functional as F

    from lightning_yafsdp.models.llama import Llama, LlamaConfig
    from lightning_yafsdp.training.chunked_loss import chunk_tokens_for, chunked_cross_entropy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = dict(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, max_seq_len=args.seq)
    model = Llama(LlamaConfig.from_name("tiny", **shape))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    tokens_per_chunk = chunk_tokens_for(chunk, vocab_size=args.vocab)
    before = current_rss_kib()
    assert reset_hwm(), "this kernel cannot reset VmHWM (/proc/self/clear_refs)"
    started = time.perf_counter()
    hidden = model.hidden_states(tokens[:, :-1])
    if tokens_per_chunk is None:
        logits = model.output(hidden).float()
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        del logits
    else:
        loss = chunked_cross_entropy(
            hidden, model.output, tokens[:, 1:], chunk_tokens=tokens_per_chunk, fp32=True
        )
    del hidden
    loss.backward()
    return {
        "chunk": chunk,
        "tokens_per_chunk": tokens_per_chunk,
        "loss": loss.item(),
        "peak_above_start_mib": round((hwm_kib() - before) / 1024, 1),
        "seconds": round(time.perf_counter() - started, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunks", nargs="+", default=["none", "2048", "512"])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(_one(args, args.one)))
        return 0
    env = dict(os.environ, **LIVE_MALLOC_ENV, PYTHONPATH=str(REPO))
    base = [sys.executable, __file__, *sys.argv[1:]]
    logits_mib = args.batch * args.seq * args.vocab * 4 / 2**20
    print(
        f"Llama dim {args.dim}, {args.layers} layers, vocab {args.vocab}; batch {args.batch} x "
        f"seq {args.seq}: whole fp32 logits {logits_mib:.0f} MiB"
    )
    print("| loss_chunk_size | tokens per chunk | loss | peak above start (MiB) | time (s) |")
    print("|---|---:|---:|---:|---:|")
    for chunk in args.chunks:
        out = subprocess.run([*base, "--one", chunk], env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-2000:])
            return out.returncode
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {chunk} | {r['tokens_per_chunk'] or 'all'} | {r['loss']:.6f} | "
            f"{r['peak_above_start_mib']} | {r['seconds']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
