"""The third model set: containers as units, sparse gradients, constructor values on meta.

Through ``Trainer(strategy="yafsdp")`` against ``strategy="ddp"`` with the same seed,
``32-true``, per-step losses and final weights (``tests/parity_fits.py``):

- a diffusers ``UNet2DModel`` under the default units, whose blocks hold ``ModuleList``s
  that their parents call child by child (no unit may be a module without a forward), and
  a plain-torch model of the same shape; ``units=`` naming a ``ModuleList`` is refused;
- ``nn.Embedding(sparse=True)``: its sparse gradient is added into the flat gradient;
- meta builds (``configure_model``) of CLIP (``logit_scale``, a constant of the
  constructor) and wav2vec2 (a weight-normed positional convolution and a draw made in
  ``__init__``) start from the constructor's values, the same on every rank
  ([Note: constructor values in meta builds]).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import dist_run
from tests.parity_fits import fit, loss_error, weights_error

# [Tolerance] 32-true under yafsdp runs DDP's fp32 ops on the same full weights; only the
# order of the gradient sums differs. Measured: UNet losses <= 2.4e-7, weights <= 1.9e-7;
# sparse embedding losses 0.0, weights <= 7.5e-8; the attention stack <= 3e-7.
_PARITY_RTOL = 2e-6


def _assert_parity(runs: list[dict]) -> None:
    for rank, run in enumerate(runs):
        losses = loss_error(run["yafsdp"], run["ddp"])
        weights, where = weights_error(run["yafsdp"], run["ddp"])
        assert losses <= _PARITY_RTOL, (rank, losses, run["yafsdp"]["losses"])
        assert weights <= _PARITY_RTOL, f"rank {rank}: {where} off by {weights:.3g}"


def _parity(build, loss_fn, rows, world_size: int, **options) -> dict:
    runs = {}
    for strategy in ("ddp", "yafsdp"):
        runs[strategy] = fit(strategy, build, loss_fn, rows, world_size=world_size, **options)
    return runs


# -- 1. containers: units are modules that are called ----------------------------------------


def _unet() -> nn.Module:
    from diffusers import UNet2DModel

    # layers_per_block=1: the down blocks' ModuleLists hold one block each, so they are no
    # repeated container and once were chosen as root units themselves.
    return UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, attention_head_dim=8,
    )  # fmt: skip


def _unet_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    predicted = model(batch["x"], batch["t"]).sample
    return nn.functional.mse_loss(predicted, batch["noise"])


def _unet_rows(count: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [
        {
            "x": torch.randn(3, 8, 8, generator=gen),
            "t": torch.randint(0, 1000, (), generator=gen),
            "noise": torch.randn(3, 8, 8, generator=gen),
        }
        for _ in range(count)
    ]


def _unet_parity(world_size: int) -> dict:
    return _parity(_unet, _unet_loss, _unet_rows(6 * world_size), world_size, steps=3)


def test_diffusers_unet_trains_like_ddp_under_the_default_units():
    pytest.importorskip("diffusers")
    runs = dist_run(2, _unet_parity, 2, timeout_s=300)
    _assert_parity(runs)
    units = runs[0]["yafsdp"]["units"]
    assert "model.down_blocks.1" in units  # a block holding single-child ModuleLists
    assert "model.mid_block.attentions.0" in units  # the attention its ModuleList holds
    assert not any(name.endswith(("attentions", "resnets", "down_blocks")) for name in units)


class _Attention(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mix = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.attn(x, x, x, need_weights=False)[0])


class _Stage(nn.Module):
    """A stage whose ModuleLists (one attention, one MLP) it calls child by child."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.attentions = nn.ModuleList([_Attention(dim)])
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU())])
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attentions[0](x)
        return x + self.down(self.mlps[0](x))


class _StageNet(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.encode = nn.Linear(4, dim)
        self.stages = nn.ModuleList([_Stage(dim), _Stage(dim)])
        # Outside the blocks and as large as one: a root unit, which must be the stage the
        # ModuleDict holds (called), not the ModuleDict (never called).
        self.post = nn.ModuleDict({"inner": _Stage(dim)})
        self.decode = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encode(x)
        for stage in self.stages:
            x = stage(x)
        return self.decode(self.post["inner"](x))


def _stage_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def _stage_rows(count: int) -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    return [{"x": torch.randn(5, 4, generator=gen), "y": torch.randn(5, 4, generator=gen)}
            for _ in range(count)]  # fmt: skip


def _stage_parity(world_size: int, eager: bool) -> dict:
    rows = _stage_rows(6 * world_size)
    return _parity(_StageNet, _stage_loss, rows, world_size, steps=3, eager=eager)


def test_modulelists_called_child_by_child_train_like_ddp_at_three_ranks():
    runs = dist_run(3, _stage_parity, 3, True, timeout_s=240)
    _assert_parity(runs)
    units = runs[0]["yafsdp"]["units"]
    assert units[:2] == ["model.stages.0", "model.stages.1"]
    assert "model.post.inner" in units and "model.post" not in units


def _refusal(units) -> str:
    from lightning_yafsdp.core import shard_model

    try:
        shard_model(_StageNet(), units=units)
    except ValueError as err:
        return str(err)
    return "no error"


def test_units_naming_a_module_without_forward_is_refused_naming_it_and_the_fix():
    (message,) = dist_run(1, _refusal, ["stages.0.attentions"], timeout_s=120)
    assert "'stages.0.attentions', a ModuleList, which has no forward" in message
    assert "units=['stages.0.attentions.0']" in message and "units=[_Attention]" in message
    assert "\n" not in message


# -- 2. sparse gradients ----------------------------------------------------------------------


class _SparseLM(nn.Module):
    def __init__(self, vocab: int = 97, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, sparse=True)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in "ab"])
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _sparse_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["ids"][:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["ids"][:, 1:].flatten())


def _sparse_parity(world_size: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    rows = [{"ids": torch.randint(0, 97, (9,), generator=gen)} for _ in range(6 * world_size)]
    # No clipping: torch's clip_grad_norm_ (DDP's) cannot take the norm of a sparse grad.
    return _parity(_SparseLM, _sparse_loss, rows, world_size, steps=3, clip=None)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_sparse_embedding_trains_like_ddp(world_size):
    _assert_parity(dist_run(world_size, _sparse_parity, world_size, timeout_s=240))


# -- 3. constructor values of meta builds -----------------------------------------------------

_LOGIT_SCALE = 2.6592


def _clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=16)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                  num_attention_heads=4, image_size=8, patch_size=4)  # fmt: skip
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16,
                        logit_scale_init_value=_LOGIT_SCALE)  # fmt: skip
    return CLIPModel(config)


def _clip_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["ids"], pixel_values=batch["pixels"], return_loss=True).loss


def _wav2vec2() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=0.0,
    )  # fmt: skip
    return Wav2Vec2ForCTC(config)


def _wav2vec2_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(input_values=batch["audio"], labels=batch["labels"]).loss


def _rows(family: str, count: int) -> list[dict]:
    gen = torch.Generator().manual_seed(4)
    if family == "clip":
        return [
            {"ids": torch.randint(3, 99, (7,), generator=gen),
             "pixels": torch.randn(3, 8, 8, generator=gen)}
            for _ in range(count)
        ]  # fmt: skip
    return [
        {"audio": torch.randn(400, generator=gen),
         "labels": torch.randint(1, 12, (5,), generator=gen)}
        for _ in range(count)
    ]  # fmt: skip


_FAMILIES = {"clip": (_clip, _clip_loss), "wav2vec2": (_wav2vec2, _wav2vec2_loss)}


def _meta_build_run(family: str) -> dict:
    build, loss_fn = _FAMILIES[family]
    torch.manual_seed(100 + dist.get_rank())  # unseeded ranks draw differently in __init__
    runs = {"meta": fit("yafsdp", build, loss_fn, _rows(family, 8), eager=False,
                        world_size=2, steps=2)}  # fmt: skip
    return runs


@pytest.fixture(scope="module")
def meta_builds() -> dict:
    return {family: dist_run(2, _meta_build_run, family, timeout_s=300) for family in _FAMILIES}


def _initial_weights(meta_builds, family: str) -> list[dict]:
    runs = meta_builds[family]
    for run in runs:
        assert run["meta"]["error"] is None, run["meta"]["error"]
        # Another draw of the same init as DDP's eager build: not the same numbers (CLIP's
        # contrastive loss over a batch of 2 moves 40% with the draw), but finite ones.
        assert all(math.isfinite(loss) for loss in run["meta"]["losses"]), run["meta"]
    return [run["meta"]["initial"] for run in runs]


def test_clip_built_on_meta_keeps_the_constructors_logit_scale(meta_builds):
    first, second = _initial_weights(meta_builds, "clip")
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name
    assert first["model.logit_scale"].item() == torch.tensor(_LOGIT_SCALE).item()


def test_wav2vec2_built_on_meta_has_its_weight_norm_and_draws_the_same_on_every_rank(
    meta_builds,
):
    first, second = _initial_weights(meta_builds, "wav2vec2")
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name
    prefix = "model.wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight."
    g, v = first[prefix + "original0"], first[prefix + "original1"]
    # The constructor's weight norm: g = ||v|| over all but dim 2, kaiming-uniform v
    # (bound sqrt(1 / fan_in) = sqrt(groups / (hidden * kernel)) = 0.0884).
    torch.testing.assert_close(g, v.norm(dim=(0, 1), keepdim=True), rtol=1e-6, atol=0)
    bound = math.sqrt(4 / (32 * 16))
    assert 0.5 * bound < v.abs().max().item() < 1.5 * bound
    # masked_spec_embed is drawn in __init__ with the legacy torch.Tensor(n), real even on
    # meta: every rank starts from rank 0's draw. (Sharded, each rank's piece of its own
    # draw would still be one consistent vector; a frozen one, below, would not be.)
    from lightning_yafsdp.core.plan.meta_build import meta_device

    torch.manual_seed(100)  # rank 0's generator before its build
    with meta_device():
        drawn = _wav2vec2().wav2vec2.masked_spec_embed
    assert torch.equal(first["model.wav2vec2.masked_spec_embed"], drawn)


class _FrozenDraw(nn.Module):
    """A frozen gain drawn in ``__init__`` (replicated, not sharded) beside two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.gain = nn.Parameter(torch.Tensor(8).uniform_(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x)) * self.gain
        return x


def _frozen_draw_run() -> dict:
    torch.manual_seed(200 + dist.get_rank())
    gen = torch.Generator().manual_seed(5)
    rows = [{"x": torch.randn(8, generator=gen), "y": torch.randn(8, generator=gen)}
            for _ in range(4)]  # fmt: skip
    return fit("yafsdp", _FrozenDraw, _stage_loss, rows, eager=False, world_size=2, steps=2)


def test_a_frozen_value_drawn_in_the_constructor_is_rank_zeros_on_every_rank():
    first, second = dist_run(2, _frozen_draw_run, timeout_s=120)
    assert first["error"] is None, first["error"]
    torch.manual_seed(200)  # rank 0's generator before its build
    assert torch.equal(first["initial"]["model.gain"], torch.Tensor(8).uniform_())
    assert torch.equal(second["initial"]["model.gain"], first["initial"]["model.gain"])


def test_a_constant_from_python_data_stays_meta_and_keeps_its_value():
    from lightning_yafsdp.core.plan.meta_build import meta_device, value_from_constructor

    with meta_device():
        scale = nn.Parameter(torch.tensor(2.5))
        # The constructor's own arithmetic with other meta tensors works as on plain meta.
        mixed = torch.tensor([1.0, 2.0]) * torch.ones(2)
    assert scale.is_meta and mixed.is_meta
    assert value_from_constructor(scale).item() == 2.5
    assert value_from_constructor(mixed) is None  # computed, not data: the init guard's


class _ConstructorValues(nn.Module):
    """A constant from Python data (kind 1) and a legacy draw (kind 2) beside two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.gain = nn.Parameter(torch.Tensor(8).uniform_())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x * self.gain * self.scale


def _registries() -> tuple[int, int]:
    from lightning_yafsdp.core.plan import meta_build

    return len(meta_build._made_under_meta), len(meta_build._values_of_meta)


class _SharedConstant(nn.Module):
    """Two blocks and a parameter made from a constant another module may share."""

    def __init__(self, constant: torch.Tensor) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.scale = nn.Parameter(constant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x)) * self.scale


def _live_registries() -> tuple[int, int]:
    """The registries' sizes once what no one holds any more is collected and pruned."""
    import gc

    from lightning_yafsdp.core.comm import collectives
    from lightning_yafsdp.core.plan.meta_build import prune_constructor_values

    # A broadcast draw's alias is held until gloo's worker lets go of it ([Note: gloo work
    # outlives its wait]); the Trainer's reference cycles hold its meta build's tensors.
    collectives._held_tensors.release_at_exit(timeout_s=5.0)
    gc.collect()
    prune_constructor_values()
    return _registries()


def _kept_constructor_values_run() -> dict:
    from lightning_yafsdp.core import shard_model
    from lightning_yafsdp.core.plan.meta_build import meta_device

    gen = torch.Generator().manual_seed(5)
    rows = [{"x": torch.randn(8, generator=gen), "y": torch.randn(8, generator=gen)}
            for _ in range(4)]  # fmt: skip
    before = _live_registries()
    run = fit("yafsdp", _ConstructorValues, _stage_loss, rows, eager=False, world_size=2, steps=2)
    after_fit = _live_registries()
    # Two modules built before either is sharded: sharding one keeps the other's values.
    with meta_device():
        first, second = _ConstructorValues(), _ConstructorValues()
    built = _live_registries()
    shard_model(first)
    after_first = _live_registries()
    shard_model(second)
    after_second = _live_registries()
    # One constant shared by two modules: whichever is sharded first, both get its value.
    scales = {}
    for order in ("ab", "ba"):
        with meta_device():
            constant = torch.tensor(2.5)
            models = {"a": _SharedConstant(constant), "b": _SharedConstant(constant)}
        del constant
        for name in order:
            scales[order + name] = shard_model(models[name]).full_state_dict()["scale"].item()
    return {
        "error": run["error"], "scale": run["initial"]["model.scale"].item(), "shared": scales,
        "counts": [before, after_fit, built, after_first, after_second, _live_registries()],
    }  # fmt: skip


def test_the_constructor_values_of_a_model_are_dropped_once_it_is_sharded():
    for facts in dist_run(2, _kept_constructor_values_run, timeout_s=120):
        assert facts["error"] is None, facts["error"]
        assert facts["scale"] == 2.0  # the kept value was used before it was dropped
        assert set(facts["shared"].values()) == {2.5}, facts["shared"]
        before, after_fit, built, after_first, after_second, at_end = facts["counts"]
        assert after_fit == before, facts["counts"]  # the Trainer's model, sharded
        assert built == (before[0] + 2, before[1] + 2), facts["counts"]
        assert after_first == (before[0] + 1, before[1] + 1), facts["counts"]
        assert after_second == at_end == before, facts["counts"]
