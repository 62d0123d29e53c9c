"""benchmark_loader: the real rule on the demo data, the grid, the choice and its RAM budget."""

from __future__ import annotations

import csv
import json

import pytest

from conftest import one_sentence
from imgclf import hardware, settings
from imgclf.loader_bench import bench as loader_bench
from imgclf.errors import UserError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_rule_on_demo_data_writes_a_choice_that_fits_the_ram_budget(through_memory):
    report = json.loads((through_memory / "results/loader/local.json").read_text())
    choice = report["choice"]
    assert set(choice) == {"decoder", "num_workers", "prefetch_factor", "images_per_s", "why"}
    assert choice["decoder"] in ("pil", "tensor") and choice["images_per_s"] > 0
    # demo recipe: global batch 128 over this machine's devices (its GPUs, else FAST_YAML's
    # one CPU rank)
    hw = report["provenance"]["hardware"]
    devices = len(hw["gpus"]) or 1
    assert report["batch_size"] == -(-128 // devices)
    # the local entry is this machine: its own figures, no warning about a bigger cluster
    assert report["this_machine"]["cpus"] == hw["cpus"]
    assert report["cluster_cpus_exceed_this_machine"] is False and report["note"] is None

    rows = report["rows"]
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1
    row = chosen[0]
    assert (row["decoder"], row["num_workers"], row["prefetch_factor"]) == \
        (choice["decoder"], choice["num_workers"], choice["prefetch_factor"])
    # the RAM budget: host RAM x margin / devices, and the chosen configuration within it
    budget = report["ram_budget_bytes_per_device"]
    assert budget == pytest.approx(hw["ram_gb"] * 1e9 * report["ram_margin"] / devices,
                                   rel=0.01)
    assert row["measured"] and row["peak_bytes"] > 0
    assert row["ram_bytes"] >= row["peak_bytes"] and row["ram_bytes"] <= budget
    # the cheapest within the tolerance of its decode path's best
    same = [r for r in rows if r["decoder"] == row["decoder"] and r["role"] == "grid"]
    best = max(r["images_per_s"] for r in same)
    assert row["images_per_s"] >= (1 - report["tolerance"]) * best
    near = [r for r in same if r["images_per_s"] >= (1 - report["tolerance"]) * best]
    assert (row["num_workers"], row["prefetch_factor"]) == \
        min((r["num_workers"], r["prefetch_factor"]) for r in near)
    # both decode paths measured; the faster one chosen
    assert set(report["decoders"]) == {"pil", "tensor"}
    fastest = max(d["images_per_s"] for d in report["decoders"].values())
    assert choice["images_per_s"] >= (1 - report["tolerance"]) * fastest
    # every grid row has a predicted buffer of workers x prefetch x batch bytes
    for r in rows:
        assert r["predicted_buffer_bytes"] == \
            r["num_workers"] * r["prefetch_factor"] * report["batch_bytes"]
        assert r["measured"] and r["batches_timed"] >= 3

    baseline = report["baseline"]
    assert (baseline["decoder"], baseline["num_workers"], baseline["prefetch_factor"]) == \
        ("pil", 12, 3)
    assert baseline["measured"] is True and baseline["images_per_s"] > 0
    assert baseline["choice_over_baseline"] == pytest.approx(
        choice["images_per_s"] / baseline["images_per_s"], rel=1e-2)
    assert [r["role"] for r in rows if r["is_baseline"]] == ["baseline"]

    with open(through_memory / "results/loader/local.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert sum(r["chosen"] == "True" for r in table) == 1
    assert (through_memory / "results/loader/local.png").read_bytes()[:8] == PNG_MAGIC
    assert (through_memory / "logs/benchmarks/loader/local.tsv").exists()
    assert "choice:" in (through_memory / "logs/loader/local.log").read_text()
    prov = report["provenance"]
    assert prov["config_digest"] and "results/hydration/local.verdict.json" in prov["inputs"]


def test_default_worker_grid_follows_the_cpus_per_device():
    assert loader_bench.default_workers(1, 2) == [0, 1]
    assert loader_bench.default_workers(12, 48) == [0, 1, 2, 4, 8, 12]
    assert loader_bench.default_workers(12, 2) == [0, 1, 2]  # capped at this machine
    hw = {"cpus_per_node": 48, "devices_per_node": 4}
    assert hardware.device_cpus(hw) == 12


def test_grid_has_no_prefetch_without_workers():
    cfg = {"decoders": ["pil", "tensor"], "prefetch_factors": [2, 4]}
    assert loader_bench.grid(cfg, [0, 2]) == [
        ("pil", 0, 0), ("pil", 2, 2), ("pil", 2, 4),
        ("tensor", 0, 0), ("tensor", 2, 2), ("tensor", 2, 4)]


def row(decoder, w, p, ips, ram, budget=10e9):
    return {"decoder": decoder, "num_workers": w, "prefetch_factor": p, "images_per_s": ips,
            "ram_bytes": ram, "fits_budget": ram <= budget, "measured": True, "role": "grid"}


def test_choice_is_the_cheapest_near_the_best_that_fits():
    rows = [row("pil", 2, 2, 900, 1e9), row("pil", 4, 2, 1000, 2e9),
            row("tensor", 2, 2, 1180, 1e9), row("tensor", 4, 2, 1200, 2e9),
            row("tensor", 8, 4, 1500, 20e9),  # fastest, but over the budget
            row("tensor", 4, 4, 1150, 3e9)]
    pick = loader_bench.choose(rows, tolerance=0.05, budget=10e9)
    assert (pick["row"]["decoder"], pick["row"]["num_workers"]) == ("tensor", 2)
    assert "within 5%" in pick["why"] and "pil's best was 1000" in pick["why"]
    pick = loader_bench.choose(rows, tolerance=0.0, budget=10e9)
    assert (pick["row"]["num_workers"], pick["row"]["prefetch_factor"]) == (4, 2)


def test_no_configuration_fitting_is_one_sentence():
    with pytest.raises(UserError, match=r"^No loader configuration fits the RAM budget") as err:
        loader_bench.choose([row("pil", 2, 2, 900, 5e9, budget=1e9)], tolerance=0.05,
                            budget=1e9)
    assert one_sentence(str(err.value))


def test_planning_a_bigger_cluster_measures_what_this_machine_has(demo_root, claims_undone):
    """A cluster with more CPUs per device than this machine: only measurable worker counts,
    marked as this machine's figures, and the baseline skipped when it is switched off."""
    here = hardware.usable_cpus()
    hw = {"name": "big", "cpus_per_node": 4 * (here + 4), "devices_per_node": 4, "nodes": 1,
          "ram_gb": 64, "accelerator": "gpu", "gpus_per_node": 4}
    cfg = settings.load()["loader"] | {"decoders": ["pil"], "seconds_per_config": 0.2,
                                       "windows": 1, "warmup_batches": 1,
                                       "measure_baseline": False, "prefetch_factors": [2]}
    report = loader_bench.benchmark(str(demo_root), cfg, {"recipe": "demo", "resolution": 32},
                                    hw, show_progress=False)
    assert report["cluster_cpus_exceed_this_machine"] is True
    assert "were not measured" in report["note"] and "big node" in report["note"]
    assert max(r["num_workers"] for r in report["rows"]) == here
    assert report["batch_size"] == 32  # 128 over 4 GPUs
    assert report["baseline"]["measured"] is False
    assert "measure_baseline" in report["baseline"]["reason"]


@pytest.mark.parametrize("override, needle", [
    ({"loader": {"windows": 0}}, "`loader.windows` is 0 but must be positive"),
    ({"loader": {"decoders": ["turbo"]}}, "loader.decoders.0"),
    ({"memory": {"safety_margin": 1.5}}, "memory.safety_margin"),
    ({"memory": {"round_to": 0}}, "`memory.round_to` is 0 but must be positive"),
    ({"loader": {"workerz": 4}}, "unknown key 'workerz' in `loader`"),
])
def test_bad_loader_and_memory_config_is_one_sentence(override, needle):
    with pytest.raises(UserError) as err:
        settings.load(overrides=override)
    assert needle in str(err.value) and one_sentence(str(err.value))


def test_every_loader_and_memory_key_is_documented():
    import yaml

    schema = yaml.safe_load(settings.SCHEMA.read_text())["properties"]
    readme = (settings.REPO / "config" / "README.md").read_text()
    for section in ("loader", "memory"):
        body = readme.split(f"## `{section}`", 1)[1].split("\n## ", 1)[0]
        for key, spec in schema[section]["properties"].items():
            assert f"| `{key}` |" in body, (section, key)
        defaults = settings.load()[section]
        assert set(defaults) == set(schema[section]["properties"])
