"""``from_pretrained`` imported inside ``configure_model``, as lazy user code does.

transformers loads ``modeling_utils`` on the first use of a model class. When that first
use is ``configure_model`` itself (under the strategy's meta-device context), the lazy
load must still be set up: it used to stop with transformers' "from_pretrained with a
meta device context manager" error. This module imports no model class at top level,
so the rank's first use is inside ``configure_model``.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.distributed import dist_run

VOCAB = 96


class _ImportsInside(pl.LightningModule):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path, self.model, self.initial = path, None, {}
        self.built_on_meta = None

    def configure_model(self) -> None:
        from transformers import LlamaForCausalLM  # the first use: loads modeling_utils

        self.model = LlamaForCausalLM.from_pretrained(self.path)
        self.built_on_meta = all(t.is_meta for t in self.model.state_dict().values())

    def on_fit_start(self) -> None:
        state = self.trainer.strategy.engine.full_state_dict()
        self.initial = {name.removeprefix("model."): t.clone() for name, t in state.items()}

    def training_step(self, tokens, batch_idx):
        logits = self.model(input_ids=tokens).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_importing_inside(path: str) -> dict:
    loaded_before = "transformers.modeling_utils" in sys.modules
    module = _ImportsInside(path)
    trainer = pl.Trainer(
        strategy="yafsdp", accelerator="cpu", devices=2, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(torch.randint(0, VOCAB, (4, 8)), batch_size=2))
    return {"loaded_before": loaded_before, "meta": module.built_on_meta, "initial": module.initial}


def test_from_pretrained_imported_inside_configure_model_loads_the_saved_weights(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(5)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    for facts in dist_run(2, _fit_importing_inside, str(tmp_path), timeout_s=240):
        assert not facts["loaded_before"]  # else this test tests nothing
        assert facts["meta"] is True
        for name, tensor in model.state_dict().items():
            assert torch.equal(facts["initial"][name], tensor), name
