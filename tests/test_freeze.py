"""A recipe's frozen body (`freeze_epochs`, the `finetune` recipe): the body's param groups sit
at LR 0 and no weight decay for the first epochs while the head and the norm layers train, then
every group follows the schedule; nothing leaves the optimizer or stops requiring grad (DDP
registers the parameters that require grad once, when it wraps the model)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from imgclf import recipes
from imgclf.train import module as train_module

PEAK, PER_EPOCH, EPOCHS = 0.1, 7, 6


def finetune(**kw) -> recipes.Recipe:
    return replace(recipes.get("finetune"), **kw)


def built(recipe: recipes.Recipe, total: int = PER_EPOCH * EPOCHS, compressed: bool = False):
    """(model, optimizer, schedule, frozen steps) as ImageClassifier.configure_optimizers
    builds them for a run of `total` steps."""
    torch.manual_seed(0)
    model = recipes.build_model("resnet18", 10)
    opt = recipes.build_optimizer(model, recipe, PEAK)
    warm = train_module.warmup_steps(recipe.warmup_epochs, PER_EPOCH, total)
    frozen = train_module.frozen_steps(recipe.freeze_epochs, PER_EPOCH, total, recipe.epochs,
                                       compressed)
    sched = train_module.lr_schedule(opt, total_steps=total, warmup_steps=warm,
                                     start_factor=recipe.warmup_start_factor, frozen_steps=frozen)
    return model, opt, sched, frozen, warm


def expected_lr(recipe, step: int, total: int, warm: int) -> float:
    return PEAK * train_module.lr_factor(step, total_steps=total, warmup_steps=warm,
                                         start_factor=recipe.warmup_start_factor)


def is_body(group) -> bool:
    return bool(group.get(recipes.FROZEN_AT_FIRST))


@pytest.mark.parametrize("freeze, warmup", [(1, 0), (2, 1), (1, 2)])
def test_body_at_lr_0_while_frozen_then_every_group_follows_the_schedule(freeze, warmup):
    recipe = finetune(freeze_epochs=freeze, warmup_epochs=warmup, weight_decay=5e-4)
    model, opt, sched, frozen, warm = built(recipe)
    total = PER_EPOCH * EPOCHS
    assert frozen == freeze * PER_EPOCH
    body = [g for g in opt.param_groups if is_body(g)]
    first = [g for g in opt.param_groups if not is_body(g)]
    assert body and first and not is_body(opt.param_groups[0])  # train/lr logs group 0
    for step in range(total):
        want = expected_lr(recipe, step, total, warm)
        for g in first:  # the head and the norm layers: the schedule from the first step
            assert g["lr"] == pytest.approx(want, abs=1e-15)
            assert g["weight_decay"] == 5e-4
        for g in body:
            if step < frozen:
                assert g["lr"] == 0.0 and g["weight_decay"] == 0.0
            else:
                assert g["lr"] == pytest.approx(want, abs=1e-15)
                assert g["weight_decay"] == 5e-4
        if step < frozen or step < total - 1:  # the head trains while the body is frozen
            assert first[0]["lr"] > 0
        opt.step()
        sched.step()


def test_frozen_parameters_keep_their_values_and_stay_in_ddp():
    """Real steps with gradients: while frozen, the body's weights (convolutions) do not move,
    though they get gradients; the head, the norm layers' weights and BatchNorm's running
    statistics do. After the frozen steps the body moves too. Every parameter requires grad
    and is in exactly one group, so DDP syncs all of them from the first step."""
    recipe = finetune(freeze_epochs=1, warmup_epochs=0, weight_decay=5e-4)
    model, opt, sched, frozen, _ = built(recipe, total=8)
    assert frozen == 4  # an epoch of 7 steps, capped at half of the 8-step run
    model.train()
    assert all(p.requires_grad for p in model.parameters())
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    conv, bn, fc = model.conv1.weight, model.bn1, model.fc.weight
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        assert conv.grad is not None and conv.grad.abs().sum() > 0
        opt.step()
        sched.step()

    before = {"conv": conv.detach().clone(), "fc": fc.detach().clone(),
              "bn_w": bn.weight.detach().clone(), "bn_mean": bn.running_mean.clone()}
    for _ in range(frozen):
        step()
    assert torch.equal(conv, before["conv"])
    assert not torch.equal(fc, before["fc"]) and not torch.equal(bn.weight, before["bn_w"])
    assert not torch.equal(bn.running_mean, before["bn_mean"])
    step()
    assert not torch.equal(conv, before["conv"])


def test_frozen_share_of_compressed_runs_and_caps():
    """A compressed run (LR validation, batch curve) freezes the recipe's share of its steps;
    every run at most half of its steps, at least one step when anything is frozen."""
    f = train_module.frozen_steps
    assert f(1, 7, 56, 8, compressed=False) == 7
    assert f(1, 50, 40, 8, compressed=True) == 5   # 1 of the recipe's 8 epochs: 1/8 of 40
    assert f(3, 7, 10, 8, compressed=False) == 5   # half the run at most
    assert f(0.01, 7, 56, 8, compressed=False) == 1
    assert f(0, 7, 56, 8, compressed=False) == 0


def test_no_freeze_builds_what_it_built_before():
    """A recipe without `freeze_epochs`: the groups and the schedule of every other recipe."""
    recipe = recipes.get("demo")
    model, opt, sched, frozen, _ = built(recipe)
    assert frozen == 0 and len(opt.param_groups) == 1
    assert not any(recipes.FROZEN_AT_FIRST in g for g in opt.param_groups)
    assert type(sched) is torch.optim.lr_scheduler.LambdaLR


def test_frozen_schedule_resumes_mid_freeze():
    """A checkpoint taken while the body is frozen (optimizer and schedule state, as Lightning
    saves them) resumes with the body still frozen, then unfrozen on the same step."""
    recipe = finetune(freeze_epochs=2, warmup_epochs=0)
    _, opt, sched, frozen, _ = built(recipe)
    for _ in range(frozen - 3):
        opt.step()
        sched.step()
    saved = (opt.state_dict(), sched.state_dict())
    _, opt2, sched2, _, _ = built(recipe)
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    body = [i for i, g in enumerate(opt2.param_groups) if is_body(g)]
    frozen_now = []
    for _ in range(5):
        groups = [opt2.param_groups[i] for i in body]
        frozen_now.append(all(g["lr"] == 0 and g["weight_decay"] == 0 for g in groups))
        assert frozen_now[-1] or all(g["lr"] > 0 and g["weight_decay"] > 0 for g in groups)
        opt2.step()
        sched2.step()
    assert frozen_now == [True, True, True, False, False]
