"""The LR range test: early stopping on divergence, and that a search leaves the model, RNG, trainer
counters and metrics exactly as they were (its suggestion rule: test_suggest.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from trainer_support import Regressor, flat, loader, quiet

import phalanx
from phalanx.tuner.lr_find import Tuner
from phalanx.utils.errors import MisconfigurationError
from phalanx.utils.seed import capture_rng_state


def test_lr_find_standalone_leaves_no_trace_and_sets_the_attribute() -> None:
    phalanx.seed_everything(4)
    trainer = phalanx.Trainer(max_epochs=1, accumulate_grad_batches=2, **quiet())
    model = Regressor(optimizer="adam", lr=1e-3, dropout=0.1)
    before_params, before_rng = flat(model), capture_rng_state()
    result = Tuner(trainer).lr_find(model, train_dataloaders=loader(64, 4, shuffle=True), num_training=100,
                                    min_lr=1e-5, max_lr=1.0, update_attr=True)
    assert len(result.lrs) == len(result.losses) == len(result.raw_losses) >= 10
    assert result.lrs == sorted(result.lrs) and result.lrs[0] == pytest.approx(1e-5)
    assert model.lr == result.suggestion() is not None
    assert torch.equal(flat(model), before_params)
    after_rng = capture_rng_state()
    assert torch.equal(after_rng["torch"], before_rng["torch"])
    assert torch.equal(after_rng["python"][1], before_rng["python"][1])
    assert trainer.global_step == 0 and trainer.current_epoch == 0 and trainer.callback_metrics == {}
    assert all(p.grad is None for p in model.parameters()) and model.training
    # A fit afterwards starts from the untouched weights with the suggested learning rate.
    trainer.fit(model, loader(64, 4, shuffle=True))
    assert trainer.global_step == 8 and trainer.optimizer.param_groups[0]["initial_lr"] == model.lr


def test_early_stop_on_divergence_and_linear_mode() -> None:
    trainer = phalanx.Trainer(max_epochs=1, **quiet())
    model = Regressor(optimizer="sgd")
    result = Tuner(trainer).lr_find(model, train_dataloaders=loader(32, 4), min_lr=1e-3, max_lr=1e4,
                                    num_training=60, update_attr=False)
    assert len(result.lrs) < 60  # the loss blew up before the end
    linear = Tuner(trainer).lr_find(model, train_dataloaders=loader(32, 4), min_lr=0.01, max_lr=0.1,
                                    num_training=5, mode="linear", early_stop_threshold=None, update_attr=False)
    assert linear.lrs == pytest.approx([0.01, 0.0325, 0.055, 0.0775, 0.1])


def test_batch_noise_does_not_stop_the_search_before_the_rule_has_its_points() -> None:
    """Batches of 2 where one sample in 16 has a target of 30 and the rest 0, the second batch among them: a
    batch's loss is 0.1 or 440, so the moving average, one batch at first, crosses 4x its lowest at lr 1e-8 on
    noise alone. The early stop waits for the 8 losses the suggestion needs; a real blow-up still ends it."""
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = torch.where(torch.arange(64) % 16 == 2, 30.0, 0.0).double().unsqueeze(1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
    trainer = phalanx.Trainer(max_epochs=1, **quiet())
    result = Tuner(trainer).lr_find(Regressor(optimizer="sgd"), train_dataloaders=data, min_lr=1e-8, max_lr=1e-6,
                                    num_training=30, update_attr=False, probe=False)
    assert result.losses[1] > 4 * result.losses[0]  # where the search stopped before
    assert len(result.lrs) == 30  # nothing diverges at 1e-8 ... 1e-6
    blown = Tuner(trainer).lr_find(Regressor(optimizer="sgd"), train_dataloaders=data, min_lr=1e-3, max_lr=1e6,
                                   num_training=60, update_attr=False, probe=False)
    assert 8 <= len(blown.lrs) < 60


def test_lr_find_errors() -> None:
    trainer = phalanx.Trainer(max_epochs=1, **quiet())
    tuner = Tuner(trainer)
    data = loader(16, 4)
    with pytest.raises(MisconfigurationError, match=r"mode='cosine'"):
        tuner.lr_find(Regressor(), train_dataloaders=data, mode="cosine")
    with pytest.raises(MisconfigurationError, match=r"0 < min_lr < max_lr"):
        tuner.lr_find(Regressor(), train_dataloaders=data, min_lr=1.0, max_lr=0.1)

    model = Regressor()
    del model.lr
    with pytest.raises(MisconfigurationError, match=r"has neither"):
        tuner.lr_find(model, train_dataloaders=data, update_attr=True)


class OneSetupStrategy(phalanx.strategies.SingleDeviceStrategy):
    """A single device that, like DeepSpeed, builds a model's optimizer with it, once (and records what
    it set up and released)."""

    sets_up_optimizers_separately = False

    def __init__(self, master_weights: bool = False) -> None:
        super().__init__()
        self.set_up: list[Any] = []
        self.released: list[Any] = []
        self.master_weights = master_weights

    def setup_module_and_optimizers(self, module: Any, optimizers: list[Any]) -> Any:
        self.set_up.append(module)
        if self.master_weights:
            for optimizer in optimizers:
                keep_master_weights(optimizer)
        return self.setup_module(module), [super(OneSetupStrategy, self).setup_optimizer(o) for o in optimizers]

    def setup_optimizer(self, optimizer: Any) -> Any:
        raise MisconfigurationError("set up with the model, once")

    def release_module(self, forward_module: Any) -> None:
        self.released.append(forward_module)


def keep_master_weights(optimizer: torch.optim.Optimizer) -> None:
    """Like DeepSpeed's ZeRO: the optimizer steps a copy of the weights of its own (the master weights)
    and writes it into the parameters after each step; the module's parameters are a view for forward."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    master = [p.detach().clone() for p in params]

    def before(*_: Any) -> None:
        for p, m in zip(params, master):
            p.data.copy_(m)

    def after(*_: Any) -> None:
        for p, m in zip(params, master):
            m.copy_(p.detach())

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def test_lr_find_where_the_optimizer_comes_with_its_model_searches_on_a_copy() -> None:
    """DeepSpeed's case (its engine is built once from the model and the optimizer): the search runs on
    a scratch copy that is set up and released; the module is never set up or touched, and the fit
    after it builds its optimizer from configure_optimizers with the learning rate found."""
    phalanx.seed_everything(4)
    strategy = OneSetupStrategy()
    trainer = phalanx.Trainer(max_epochs=1, strategy=strategy, **quiet())
    model = Regressor(optimizer="adam", lr=1e-3, dropout=0.1)
    before_params, before_rng = flat(model), capture_rng_state()
    result = Tuner(trainer).lr_find(model, train_dataloaders=loader(64, 4, shuffle=True), num_training=30,
                                    min_lr=1e-5, max_lr=1.0, update_attr=True)
    assert len(result.lrs) >= 10 and model.lr == result.suggestion()
    assert torch.equal(flat(model), before_params) and model.counts["train_batches"] == 0
    assert torch.equal(capture_rng_state()["torch"], before_rng["torch"])
    copies = list(strategy.set_up)  # the search's, then one per probe fit
    assert len(copies) == 1 + len(result.probe_lrs) and len(result.probe_lrs) > 0
    assert all(c is not model and isinstance(c, Regressor) for c in copies)
    assert strategy.released == copies and trainer.model is None and trainer.optimizers == []
    trainer.fit(model, loader(64, 4, shuffle=True))
    assert strategy.set_up[-1] is model and trainer.optimizer.param_groups[0]["initial_lr"] == model.lr
    # Once the model is set up with its optimizer, a search would need another: refused with the way out.
    with pytest.raises(MisconfigurationError, match=r"Tuner.lr_find is not supported on OneSetupStrategy after this "
                       r"Trainer set the model up: .* Call Tuner\(trainer\).lr_find\(model, ...\) before trainer.fit"):
        Tuner(trainer).lr_find(model, train_dataloaders=loader(64, 4), num_training=5)
    with pytest.raises(MisconfigurationError, match=r"Tuner.scale_batch_size is not supported on OneSetupStrategy"):
        Tuner(trainer).scale_batch_size(model)


def test_probe_fits_on_the_scratch_copy_match_those_of_a_separate_optimizer() -> None:
    """A curve still falling at max_lr (momentum SGD up to 0.1): where the optimizer comes with its model
    and keeps master weights a restore does not reach, each probe fit runs on a fresh scratch copy, from
    the state the search started from, with the same losses as where the optimizer is set up on its own."""

    def search(strategy: Any) -> tuple[Any, Regressor]:
        phalanx.seed_everything(4)
        trainer = phalanx.Trainer(max_epochs=1, strategy=strategy, **quiet())
        model = Regressor(optimizer="sgd", lr=1e-3)
        return Tuner(trainer).lr_find(model, train_dataloaders=loader(64, 4, shuffle=True), num_training=15,
                                      min_lr=1e-4, max_lr=0.1, update_attr=False), model

    separate, _ = search("auto")
    strategy = OneSetupStrategy(master_weights=True)
    before = flat(Regressor(optimizer="sgd", lr=1e-3))
    scratch, model = search(strategy)
    assert len(separate.probe_lrs) >= 2 and separate.suggestion() in separate.probe_lrs
    assert (scratch.probe_lrs, scratch.probe_scores) == (separate.probe_lrs, separate.probe_scores)
    assert scratch.raw_losses == separate.raw_losses and scratch.suggestion() == separate.suggestion()
    assert torch.equal(flat(model), before) and model.counts["train_batches"] == 0
    assert len(strategy.set_up) == 1 + len(scratch.probe_lrs) and strategy.released == strategy.set_up
    assert model not in strategy.set_up
