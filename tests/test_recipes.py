"""The named recipes build what the recipe table of docs/training.md says, and the pieces the
table names (repeated-augmentation sampler, EMA of the weights) behave as published.

The table is parsed from docs/training.md and every cell is rendered again from the built
objects (transforms, loss, optimizer, batch mixer, EMA callback, sampler, model), so the document
and the code cannot drift apart."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torchvision.transforms import v2

from imgclf import recipes, sampling
from imgclf.data import mixup, transforms

TABLE_DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"
RES = 224
NONE = "-"


def readme_table() -> dict[str, dict[str, str]]:
    """{recipe: {row label: cell}} from the table whose header starts `| recipe |`."""
    lines = TABLE_DOC.read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if re.match(r"\|\s*recipe\s*\|\s*`", line))

    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]

    names = [c.strip("`") for c in cells(lines[head])[1:]]
    table = {n: {} for n in names}
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        label, *values = cells(line)
        assert len(values) == len(names), line
        for n, v in zip(names, values):
            table[n][label] = v
    return table


def num(x: float) -> str:
    """0.0005, 2e-5, 0.99998: %g without the exponent's sign and leading zeros when positive."""
    m = re.fullmatch(r"(-?[\d.]+)e([+-])0*(\d+)", f"{x:g}")
    return f"{m[1]}e{'-' if m[2] == '-' else ''}{m[3]}" if m else f"{x:g}"


def sample_inputs():
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)
    return {"pil": Image.fromarray(array),
            "tensor": torch.from_numpy(array).permute(2, 0, 1).contiguous()}


def norm_and_bias_params(model: nn.Module) -> set[int]:
    norm = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)
    out = set()
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if isinstance(owner, norm) or name.endswith(".bias"):
            out.add(id(p))
    return out


def render(recipe: recipes.Recipe) -> dict[str, str]:
    """The table cells of `recipe`, from the objects the project builds for it."""
    from timm.layers import DropPath
    from timm.loss import BinaryCrossEntropy
    from timm.optim import Lamb

    from imgclf.train import ema

    inputs = sample_inputs()
    rows: dict[str, str] = {}

    # transforms: types and parameters in order, for both decode paths
    built = {}
    for decoder, x in inputs.items():
        train = transforms.train_transform(decoder, RES, recipe).transforms
        val = transforms.val_transform(decoder, RES, recipe).transforms
        to_tensor = [v2.PILToTensor] if decoder == "pil" else []
        augment = transforms.auto_augment(recipe)
        expected_train = ([v2.RandomResizedCrop, v2.RandomHorizontalFlip]
                          + ([type(augment)] if augment is not None else [])
                          + to_tensor + [v2.ToDtype, v2.Normalize]
                          + ([v2.RandomErasing] if recipe.random_erase > 0 else []))
        assert [type(t) for t in train] == expected_train
        assert [type(t) for t in val] == [v2.Resize, v2.CenterCrop, *to_tensor, v2.ToDtype,
                                          v2.Normalize]
        norm = next(t for t in train if isinstance(t, v2.Normalize))
        assert tuple(norm.mean) == transforms.MEAN and tuple(norm.std) == transforms.STD
        # they run, and give the sizes they promise
        y, z = v2.Compose(train)(x), v2.Compose(val)(x)
        assert y.dtype == z.dtype == torch.float32
        assert y.shape == (3, recipe.train_size(RES), recipe.train_size(RES))
        assert z.shape == (3, RES, RES)
        built[decoder] = (train, val)
    train, val = built["tensor"]
    rrc, flip, resize, crop = train[0], train[1], val[0], val[1]
    for pil_ops, tensor_ops in zip(built["pil"], built["tensor"]):  # same but PILToTensor
        assert [repr(t) for t in pil_ops if not isinstance(t, v2.PILToTensor)] == \
            [repr(t) for t in tensor_ops]
    rows["RandomResizedCrop scale"] = f"{num(rrc.scale[0])}-{num(rrc.scale[1])}"
    rows["horizontal flip"] = num(flip.p)
    aug = train[2] if len(train) > 2 and not isinstance(train[2], (v2.PILToTensor, v2.ToDtype)) \
        else None
    if aug is None:
        rows["augmentation"] = NONE
    elif isinstance(aug, v2.TrivialAugmentWide):
        rows["augmentation"] = "TrivialAugmentWide"
    else:
        assert isinstance(aug, v2.RandAugment) and aug.fill  # timm fills with the mean pixel
        rows["augmentation"] = (f"RandAugment {aug.num_ops} ops, magnitude "
                                f"{aug.magnitude}/{aug.num_magnitude_bins - 1}")
    erase = [t for t in train if isinstance(t, v2.RandomErasing)]
    rows["random erase"] = num(erase[0].p) if erase else NONE
    assert tuple(crop.size) == (RES, RES)
    rows["train crop / val resize / val crop at 224"] = \
        f"{rrc.size[0]} / {resize.size[0]} / {crop.size[0]}"
    assert rrc.interpolation == resize.interpolation
    rows["resize interpolation"] = rrc.interpolation.value

    # model (stochastic depth) and optimizer
    model = recipes.build_model("resnet18", 10, recipe.drop_path)
    rates = [m.drop_prob for m in model.modules() if isinstance(m, DropPath)]
    rows["stochastic depth"] = f"{num(max(rates))} (timm ResNet)" if rates else NONE
    opt = recipes.build_optimizer(model, recipe, recipe.lr)
    if isinstance(opt, Lamb):
        rows["optimizer"] = "LAMB (timm)"
    else:
        assert type(opt) is torch.optim.SGD
        g = opt.param_groups[0]
        rows["optimizer"] = f"SGD{' nesterov' if g['nesterov'] else ''} {num(g['momentum'])}"
    rows["LR at reference batch"] = f"{num(opt.param_groups[0]['lr'])} @ {recipe.ref_batch}"
    groups = opt.param_groups
    everything = {id(p) for p in model.parameters()}
    assert {id(p) for g in groups for p in g["params"]} == everything
    if len(groups) == 1:
        rows["weight decay"] = num(groups[0]["weight_decay"])
    else:
        decay, no_decay = groups
        assert {id(p) for p in no_decay["params"]} == norm_and_bias_params(model)
        rows["weight decay"] = (f"{num(decay['weight_decay'])}, "
                                f"{num(no_decay['weight_decay'])} on norm layers and biases")

    rows["epochs"] = str(recipe.epochs)
    rows["warm-up epochs"] = (f"{recipe.warmup_epochs}, from {num(recipe.warmup_start_factor)} "
                              f"x LR" if recipe.warmup_epochs else NONE)

    # loss
    loss = recipes.build_loss(recipe)
    if isinstance(loss, BinaryCrossEntropy):
        rows["loss"], rows["label smoothing"] = "BCE (timm)", num(loss.smoothing)
    else:
        assert type(loss) is nn.CrossEntropyLoss
        rows["loss"], rows["label smoothing"] = "CE", num(loss.label_smoothing)

    # batch mixing
    mixer = mixup.batch_mixer(recipe, 10)
    mixers = [] if mixer is None else getattr(mixer, "transforms", [mixer])
    if isinstance(mixer, v2.RandomChoice):
        assert mixer.p == [1 / len(mixers)] * len(mixers)  # torchvision's RandomChoice, as timm
    alphas = {type(m): m.alpha for m in mixers}
    rows["mixup alpha"] = num(alphas[v2.MixUp]) if v2.MixUp in alphas else NONE
    rows["cutmix alpha"] = num(alphas[v2.CutMix]) if v2.CutMix in alphas else NONE

    # EMA and repeated augmentation
    cb = ema.for_recipe(recipe, global_batch=recipe.ref_batch, epochs=recipe.epochs,
                        warmup_epochs=recipe.warmup_epochs)
    rows["EMA of the weights"] = (f"decay {num(cb.decay)}, every {cb.ema_steps} steps"
                                  if cb is not None else NONE)
    if recipe.repeated_aug > 1:
        rows["repeated augmentation"] = str(
            sampling.RepeatedAugSampler(range(64), 2, 0, reps=recipe.repeated_aug).reps)
    else:
        rows["repeated augmentation"] = NONE
    rows["published top-1"] = f"{num(recipe.top1)} %" if recipe.top1 is not None else NONE
    return rows


def test_readme_table_lists_every_recipe():
    table = readme_table()
    assert list(table) == list(recipes.RECIPES)
    assert len({frozenset(rows) for rows in table.values()}) == 1


@pytest.mark.parametrize("name", list(recipes.RECIPES))
def test_recipe_builds_what_readme_says(name):
    recipe = recipes.get(name)
    assert recipe.source, "every recipe states its source"
    assert render(recipe) == readme_table()[name]


def test_sizes_relative_to_resolution():
    tv, rsb, demo = recipes.get("torchvision_v2"), recipes.get("rsb_a2"), recipes.get("demo")
    assert (tv.train_size(224), tv.val_sizes(224)) == (176, (232, 224))
    assert (rsb.train_size(224), rsb.val_sizes(224)) == (224, (236, 224))
    for r in (demo, recipes.get("goyal")):
        for res in (16, 32, 224, 288):
            assert (r.train_size(res), r.val_sizes(res)) == (res, (round(res / 0.875), res))
    assert tv.train_size(160) == round(160 * 176 / 224) and tv.val_sizes(160)[1] == 160
    # the plain validation (no recipe) is the classic 0.875 crop
    resize, crop = transforms.val_transform("tensor", 32).transforms[:2]
    assert (resize.size[0], crop.size[0]) == (37, 32)


def test_recipe_rejects_inconsistent_fields():
    base = recipes.get("goyal")
    from dataclasses import replace

    for bad in ({"auto_augment": "autoaugment"}, {"ema_decay": 0.999},
                {"repeated_aug": 0}, {"val_crop_pct": 1.2}, {"interpolation": "lanczos"}):
        with pytest.raises(ValueError):
            replace(base, **bad)


def test_drop_path_model_is_torchvision_resnet_with_drop_path():
    """timm's ResNet has torchvision's parameter names and shapes, so its checkpoints load into
    the plain model (evaluation), and drop path is the identity at eval."""
    timm_net = recipes.build_model("resnet18", 7, drop_path=0.05)
    tv_net = recipes.build_model("resnet18", 7)
    state = timm_net.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape
                                                       for k, v in tv_net.state_dict().items()}
    tv_net.load_state_dict(state)
    timm_net.eval(), tv_net.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(timm_net(x), tv_net(x), atol=1e-5)


# --- repeated augmentation ------------------------------------------------------------------

def draws(n: int, world: int, reps: int, epoch: int = 0, seed: int = 0) -> list[list[int]]:
    out = []
    for rank in range(world):
        s = sampling.RepeatedAugSampler(list(range(n)), world, rank, seed=seed, reps=reps)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n,world,reps", [(48, 4, 3), (48, 4, 4), (60, 2, 3), (50, 4, 3)])
def test_repeated_aug_sampler(n, world, reps):
    per_rank = draws(n, world, reps)
    # an epoch stays len(dataset) / world draws per rank
    assert all(len(r) == math.ceil(n / world) for r in per_rank)
    assert all(len(sampling.RepeatedAugSampler(range(n), world, k, reps=reps)) == math.ceil(n / world)
               for k in range(world))
    # the ranks deal disjoint slices (positions rank::world) of one sequence in which each
    # image appears `reps` times in a row
    merged = [per_rank[k % world][k // world] for k in range(world * len(per_rank[0]))]
    runs = [merged[i:i + reps] for i in range(0, len(merged), reps)]
    assert all(len(set(run)) == 1 for run in runs)
    heads = [run[0] for run in runs]
    assert len(set(heads)) == len(heads)  # a new image each run
    counts = Counter(merged)
    full = len(merged) // reps
    assert sorted(counts.values()) == sorted([reps] * full + ([len(merged) % reps]
                                                              if len(merged) % reps else []))
    if reps <= world:  # the copies of an image go to different ranks
        owner = {}
        for k, i in enumerate(merged):
            owner.setdefault(i, set()).add(k % world)
        assert all(len(owner[i]) == counts[i] for i in owner)


def test_repeated_aug_sampler_epochs_and_seed():
    a, b = draws(40, 2, 3, epoch=0), draws(40, 2, 3, epoch=1)
    assert a != b and a == draws(40, 2, 3, epoch=0)
    assert draws(40, 2, 3, epoch=0, seed=1) != a
    s = sampling.RepeatedAugSampler(range(40), 2, 0, shuffle=False, reps=2)
    assert list(s) == list(range(20))  # [0, 0, 1, 1, ...] dealt to 2 ranks
    # a DistributedSampler: Lightning keeps it instead of wrapping it in its own
    assert isinstance(s, torch.utils.data.DistributedSampler)
    with pytest.raises(ValueError):
        sampling.RepeatedAugSampler(range(40), 2, 2)


# --- EMA of the weights ---------------------------------------------------------------------

def test_ema_decay_adjustment_matches_torchvision():
    from imgclf.train.ema import adjusted_decay

    # torchvision's ResNet-50 run: 8 GPUs x 128, --model-ema-steps 32, 600 epochs
    assert adjusted_decay(0.99998, 32, 8 * 128, 600) == pytest.approx(
        1 - 2e-5 * 8 * 128 * 32 / 600, abs=1e-12)
    assert adjusted_decay(0.9, 10, 1000, 1) == 0.0  # alpha capped at 1


def _ema_run(tmp_path, *, epochs, warmup_epochs=0, ckpt_path=None, record=None):
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from imgclf.train.ema import WeightEMA

    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(),
                                       nn.Linear(8, 3))
            self.seen_in_val = []

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)

        def validation_step(self, batch, batch_idx):
            if batch_idx == 0:
                self.seen_in_val.append(floats(self))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

        def train_dataloader(self):
            return DataLoader(TensorDataset(xs, ys), batch_size=8)

        def val_dataloader(self):
            return DataLoader(TensorDataset(xs, ys), batch_size=16)

    class Recorder(Callback):  # listed before the EMA: sees each step's live weights
        def on_train_batch_end(self, trainer, module, *args):
            record["live"].append(floats(module))

        def on_train_epoch_start(self, trainer, module):
            record["epoch_start"].append(floats(module))

    # decay 0.5 after torchvision's adjustment (1 image x 2 steps / 2 epochs), update every 2
    ema = WeightEMA(decay=0.5, ema_steps=2, global_batch=1, epochs=2, warmup_epochs=warmup_epochs)
    assert ema.effective_decay == 0.5
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="e{epoch}", save_top_k=-1,
                           auto_insert_metric_name=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[Recorder(), ema, ckpt])
    module = Tiny()
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, ema


def floats(module) -> dict[str, torch.Tensor]:
    """Parameters and float buffers (BatchNorm statistics), detached copies."""
    return {k: v.detach().clone() for k, v in module.state_dict().items() if v.is_floating_point()}


def hand_ema(live, steps, decay, warmup_steps=0):
    """The average torchvision keeps: updated after steps 1, 1 + steps, ...; the first update
    and every update that follows one made in warm-up copy the weights (n_averaged reset)."""
    avg, copy_next, out = None, True, []
    for i, w in enumerate(live):
        if i % steps == 0:
            avg = dict(w) if copy_next else {k: decay * avg[k] + (1 - decay) * w[k] for k in w}
            copy_next = i < warmup_steps
        out.append(avg)
    return out


def same(a, b):
    return all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.parametrize("warmup_epochs", [0, 1])
def test_weight_ema_tracks_validates_and_resumes(tmp_path, warmup_epochs):
    record = {"live": [], "epoch_start": []}
    module, ema = _ema_run(tmp_path / "a", epochs=2, warmup_epochs=warmup_epochs, record=record)
    live = record["live"]
    assert len(live) == 16  # 2 epochs x 8 steps
    expected = hand_ema(live, 2, 0.5, warmup_steps=8 * warmup_epochs)

    # validation (end of each epoch) sees the average, not the live weights
    assert len(module.seen_in_val) == 2
    for epoch, seen in enumerate(module.seen_in_val):
        step = 8 * (epoch + 1) - 1
        assert same(seen, expected[step])
        if not (warmup_epochs and epoch == 0):  # (in warm-up the average is the last copy)
            assert not same(seen, live[step])
    # ... and training goes on from the live weights
    assert same(record["epoch_start"][1], live[7])
    # the checkpoint holds the average as the model and the live weights beside it
    ck = torch.load(tmp_path / "a" / "e0.ckpt", map_location="cpu", weights_only=True)
    sd = {k: v for k, v in ck["state_dict"].items() if v.is_floating_point()}
    assert same(sd, expected[7])
    cur = {k: v for k, v in ck["current_model_state"].items() if v.is_floating_point()}
    assert same(cur, live[7])
    # the callback's own state travels along: the step of its latest update (the 4th of
    # epoch 0's 8 steps, one every 2 steps from the first) and the decay it averages with
    assert ck["callbacks"]["WeightEMA"] == {"latest_update_step": 7, "effective_decay": 0.5,
                                            "ema_steps": 2}
    # after fit the model holds the average
    assert same(floats(module), expected[-1])

    # resuming from the end of epoch 0 continues the same average
    record_b = {"live": [], "epoch_start": []}
    resumed, _ = _ema_run(tmp_path / "b", epochs=2, warmup_epochs=warmup_epochs,
                          ckpt_path=tmp_path / "a" / "e0.ckpt", record=record_b)
    assert same(record_b["epoch_start"][0], live[7])  # live weights restored, not the average
    assert len(record_b["live"]) == 8  # epoch 1 only
    assert all(same(x, y) for x, y in zip(record_b["live"], live[8:]))
    assert same(floats(resumed), expected[-1])
