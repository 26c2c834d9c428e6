"""The engine on CUDA: comm stream + events with NCCL (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import dist_run

pytestmark = pytest.mark.cuda


def _train_on_cuda(steps: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_yafsdp.core import shard_model
    from lightning_yafsdp.models.llama import Llama, LlamaConfig
    from tests.schedule_check import four_condition_violations

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    nccl = dist.new_group(backend="nccl")
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Llama(LlamaConfig.from_name("tiny")).cuda()
        engine = shard_model(model, process_group=nccl, param_dtype=dtype)
        assert engine.scheduler.comm_stream is not None
        optimizer = torch.optim.AdamW(engine.sharded_parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(steps):
            tokens = torch.randint(0, 256, (4, 32), generator=generator).cuda()
            with engine.recording() as log:
                logits = model(tokens)
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            slots = {u.name: (u.weight_buffer.index, u.grad_buffer.index) for u in engine.units}
            assert four_condition_violations(list(log), slots) == []
        results[str(dtype)] = losses
    return results


def _train_on_cpu(steps: int) -> list[float]:
    import torch.nn.functional as F

    from lightning_yafsdp.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (4, 32), generator=generator)
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_cuda_engine_matches_cpu_reference_and_keeps_the_schedule() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cuda = dist_run(1, _train_on_cuda, 5, timeout_s=300)[0]
    reference = _train_on_cpu(5)
    assert cuda["torch.float32"] == pytest.approx(reference, rel=1e-4)
    assert cuda["torch.bfloat16"] == pytest.approx(reference, rel=3e-2)
