"""Vocabulary-sized embeddings and heads run in row chunks ([Note: row chunks]).

Real gloo ranks against a single-process reference of the same model and batches:
losses and final weights to fp32 round-off, at world sizes 1, 2 and 3, with a
bias on the head, a padding index, accumulation and clipping; the buffer slots
are block-sized, and ``memory_report()`` equals the estimate's schedule.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_yafsdp.core import get_engine, shard_model
from lightning_yafsdp.core.runtime.layout import FlatLayout
from lightning_yafsdp.core.runtime.row_chunks import MAX_ROW_CHUNKS, split_rows
from tests.distributed import dist_run

VOCAB, DIM = 997, 24  # a prime vocabulary: chunks and shards never line up


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self, *, head_bias: bool, padding_idx: int | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=head_bias)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _batches(steps: int, world_size: int, micro: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [
        torch.randint(0, VOCAB, (world_size * 2, 9), generator=gen) for _ in range(steps * micro)
    ]


def _train(model, optimizer, batches, micro, *, rank=0, world_size=1, clip=None):
    losses = []
    for i, batch in enumerate(batches):
        ids = batch[rank * 2 : (rank + 1) * 2] if world_size > 1 else batch
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        (loss / micro).backward()
        losses.append(loss.detach().clone())
        if (i + 1) % micro == 0:
            if clip is not None:
                engine = model.__dict__.get("_yafsdp_engine")
                if engine is not None:
                    engine.clip_grad_norm_(clip)
                else:
                    nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return losses


def _model(options) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(head_bias=options["head_bias"], padding_idx=options["padding_idx"])


def _sharded_run(options, steps, micro):
    world_size = dist.get_world_size()
    model = _model(options)
    engine = shard_model(model, vocab_chunks=options.get("chunks", True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches(steps, world_size, micro)
    losses = _train(
        model,
        optimizer,
        batches,
        micro,
        rank=dist.get_rank(),
        world_size=world_size,
        clip=options.get("clip"),
    )
    names = [u.name for u in engine.units]
    report = engine.memory_report()
    # Losses are per rank's half batch: all-gather them to compare with the reference.
    gathered = [torch.zeros(len(losses)) for _ in range(world_size)]
    dist.all_gather(gathered, torch.stack(losses))
    full = engine.full_state_dict()
    slots = [b.tensor.numel() for b in engine.weight_buffers]
    return torch.stack(gathered).mean(0), full, names, report, slots


def _reference(options, steps, micro, world_size):
    model = _model(options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches(steps, world_size, micro)
    losses = []
    for i, batch in enumerate(batches):  # the global batch, as the mean of the ranks' losses
        parts = []
        for rank in range(world_size):
            ids = batch[rank * 2 : (rank + 1) * 2]
            logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            (loss / (micro * world_size)).backward()
            parts.append(loss.detach())
        losses.append(torch.stack(parts).mean())
        if (i + 1) % micro == 0:
            if options.get("clip") is not None:
                nn.utils.clip_grad_norm_(model.parameters(), options["clip"])
            optimizer.step()
            optimizer.zero_grad()
    return torch.stack(losses), copy.deepcopy(model.state_dict())


CASES = [
    (1, dict(head_bias=True, padding_idx=None)),
    (2, dict(head_bias=True, padding_idx=3)),
    (2, dict(head_bias=False, padding_idx=None, clip=0.5)),
    (3, dict(head_bias=True, padding_idx=500)),
]


@pytest.mark.parametrize(("world_size", "options"), CASES)
def test_chunked_vocabulary_matches_the_reference(world_size, options):
    steps, micro = 3, 2 if world_size == 2 else 1
    results = dist_run(world_size, _sharded_run, options, steps, micro, timeout_s=300)
    losses, full, names, _, slots = results[0]
    expected_losses, expected = _reference(options, steps, micro, world_size)
    assert any("embed[" in n for n in names) and any("head[" in n for n in names), names
    largest_block = max(sum(p.numel() for p in Block().parameters()) + 64, 1)
    assert max(slots) <= largest_block, slots
    torch.testing.assert_close(losses, expected_losses, rtol=2e-6, atol=0)
    # As tests/test_core_parity.py: the norm of the difference over the norm (measured:
    # <= 3e-7 here; AdamW turns round-off of near-zero grads into elementwise 1e-5).
    errors = {name: _relative_error(full[name], value) for name, value in expected.items()}
    assert max(errors.values()) < FP32_RTOL, errors


FP32_RTOL = 1e-5


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def test_unchunked_option_keeps_whole_units():
    options = dict(head_bias=True, padding_idx=None, chunks=False)
    (losses, full, names, _, slots), _ = dist_run(2, _sharded_run, options, 1, 1)
    assert "embed" in names and "head" in names
    assert max(slots) >= VOCAB * DIM


def test_split_rows_bounds_every_chunk_and_covers_every_element_once():
    layout = FlatLayout(["w", "b"], [torch.Size([VOCAB, DIM]), torch.Size([VOCAB])], world_size=3)
    chunks = split_rows(layout, 5000)
    assert chunks is not None and len(chunks) >= layout.padded_numel // 5000
    assert max(c.layout.padded_numel for c in chunks) <= 5000
    assert chunks[0].start == 0 and chunks[-1].end == VOCAB
    owned = sorted(
        (t.rank * layout.shard_numel + t.shard_offset, t.numel) for c in chunks for t in c.transfers
    )
    covered = sum(n for _, n in owned)
    assert covered == VOCAB * DIM + VOCAB
    assert all(a + n <= b for (a, n), (b, _) in zip(owned, owned[1:], strict=False))
    assert split_rows(layout, layout.padded_numel) is None


def _misuse(chunks: bool) -> dict:
    model = _model(dict(head_bias=True, padding_idx=None))
    shard_model(model, vocab_chunks=chunks)
    ids = torch.randint(0, VOCAB, (2, 5))
    facts = {
        # nn.Embedding / nn.Linear name their argument ``input``; callers may pass it so.
        "by_keyword": model.head(input=model.embed(input=ids)).shape,
        "chunked": any("[" in u.name for u in get_engine(model).units),
    }
    for bad in (-1, VOCAB, VOCAB + 3):
        try:
            model.embed(torch.tensor([[1, bad]]))
            facts[bad] = "no error"
        except IndexError as error:
            facts[bad] = str(error)
    return facts


@pytest.mark.parametrize("chunks", [True, False])
def test_keyword_input_and_out_of_range_ids_behave_as_the_whole_table(chunks):
    facts = dist_run(2, _misuse, chunks)[0]
    assert facts["chunked"] is chunks
    assert facts["by_keyword"] == torch.Size([2, 5, VOCAB])
    for bad in (-1, VOCAB, VOCAB + 3):
        assert "index out of range" in facts[bad], (bad, facts[bad])


def test_a_tiny_block_beside_a_huge_table_gets_at_most_max_row_chunks():
    layout = FlatLayout(["w"], [torch.Size([50257, 16])], world_size=2)
    chunks = split_rows(layout, 3000)  # 268 chunks of one block each would be needed
    assert len(chunks) <= MAX_ROW_CHUNKS
    assert sum(c.end - c.start for c in chunks) == 50257


# -- round-off: chunks change the order of sums, nothing else (issue 35, point 4) -----------
#
# In fp32 a chunked head computes each chunk's logits and its share of the hidden state's
# gradient in a separate matmul, so the sums run in another order than one whole matmul:
# round-off of 1e-7. AdamW divides every update by sqrt(v): an element whose gradient is
# near zero moves by lr x (round-off / |g|), which is how 1e-7 became the 1e-5..1e-4 seen
# on embeddings after a few steps (also between DDP on 2 ranks and one process). In float64
# the same runs agree to 1e-15 in norm (elementwise 6.9e-13 after 6 AdamW steps on a vocab
# of 8192, 6.4e-16 with SGD), so the chunked path computes the same function as the whole.


def _float64_runs(optimizer_name: str, steps: int) -> dict:
    finals = {}
    for chunks in (True, False):
        model = _model(dict(head_bias=True, padding_idx=None)).double()
        dtypes = dict(master_dtype=torch.float64, reduce_dtype=torch.float64)
        engine = shard_model(model, vocab_chunks=chunks, param_dtype=torch.float64, **dtypes)
        assert any("[" in unit.name for unit in engine.units) == chunks
        if optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        world_size, rank = dist.get_world_size(), dist.get_rank()
        _train(model, optimizer, _batches(steps, world_size, 1), 1, rank=rank,
               world_size=world_size)  # fmt: skip
        finals[chunks] = engine.full_state_dict()
    return finals


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_chunked_and_whole_vocabularies_agree_in_float64(optimizer_name):
    # Norm-relative, as the fp32 tests (measured after 4 steps: AdamW 2.2e-15, SGD 1.1e-15).
    chunked, whole = dist_run(2, _float64_runs, optimizer_name, 4, timeout_s=240)[0].values()
    errors = {name: _relative_error(chunked[name], value) for name, value in whole.items()}
    assert max(errors.values()) < 1e-13, errors
