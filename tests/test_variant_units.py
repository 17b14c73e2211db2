"""A weight variant built unit by unit (``importer.add_variant(units=...)``), sized before it is built
(``estimated_weight_bytes``), counted against the disk budget (``cluster.variants``), and the planner
giving a tab only what its memory holds in the variant it runs (``ClusterProfile``).

The bundled package is hard-linked into a directory of its own without any fp32 unit, so what a
build adds is measured in bytes on disk."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from edgepipe.cluster.rules import variant_rules as V
from edgepipe.cluster.rules.profiling import ClusterProfile
from edgepipe.cluster.state.worker_info import WorkerInfo
from edgepipe.model.config import ModelConfig
from edgepipe.model.importer import add_variant, estimated_weight_bytes
from edgepipe.model.manifest import UnitVariant
from edgepipe.model.package import Package
from edgepipe.net.messages import Hello
from edgepipe.plan import PlanRequest, plan


def bare_copy(pkg: Package, dest: Path) -> Package:
    """``pkg`` without its fp32 units, its blobs hard-linked under ``dest`` (nothing copied)."""
    m = pkg.manifest
    units = tuple(dataclasses.replace(u, variants={p: v for p, v in u.variants.items() if p != "fp32"}) for u in m.units)
    bare = dataclasses.replace(m, units=units, shared_files={p: f for p, f in m.shared_files.items() if p != "fp32"})
    keep = {bare.tokenizer} | {s for files in bare.shared_files.values() for s in files}
    keep |= {s for u in units for v in u.variants.values() for s in (v.graph, *v.files)}
    (dest / "blobs").mkdir(parents=True)
    for sha in keep:
        os.link(pkg.blob(sha), dest / "blobs" / sha)
    (dest / "manifest.json").write_text(bare.to_json())
    return Package(dest)


def disk_bytes(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / "blobs").iterdir()}


@pytest.fixture()
def bare(native_pkg, tmp_path) -> Package:
    return bare_copy(native_pkg, tmp_path / native_pkg.root.name)


def test_a_variant_built_for_some_units_adds_only_their_files(bare):
    before = disk_bytes(bare.root)
    add_variant(bare.root, "fp32", units=[1, 2])
    bare.reload()
    m = bare.manifest
    assert [u.index for u in m.units if "fp32" in u.variants] == [1, 2]
    added = {sha: n for sha, n in disk_bytes(bare.root).items() if sha not in before}
    weights = {sha for u in (1, 2) for sha in m.variant(u, "fp32").files}
    graphs = {m.variant(u, "fp32").graph for u in (1, 2)}
    # the two layers' files and graphs, nothing else (their norms are the native form's files already)
    assert set(added) == (weights | graphs) - set(before)
    assert sum(added.values()) < 1.01 * sum(m.variant(u, "fp32").weight_bytes for u in (1, 2)) + sum(added[g] for g in graphs)
    estimate = estimated_weight_bytes(ModelConfig.from_dict(m.config), "fp32")
    assert [m.variant(u, "fp32").weight_bytes for u in (1, 2)] == [estimate[1], estimate[2]]
    # a later build adds the next units beside them (the first ones kept, the rotary tables listed once)
    add_variant(bare.root, "fp32", units=[2, 3])
    bare.reload()
    assert [u.index for u in bare.manifest.units if "fp32" in u.variants] == [1, 2, 3]
    assert bare.manifest.variant(1, "fp32") == m.variant(1, "fp32")
    assert bare.manifest.shared_files["fp32"] == m.shared_files["fp32"] and m.shared_files["fp32"]
    # and those units run: a stage over them
    runner = bare.runner(1, 4, "fp32", threads=1)
    assert runner is not None


@pytest.mark.pure
def test_the_disk_budget_counts_what_the_variants_add(native_pkg):
    m = native_pkg.manifest
    own = dataclasses.replace(m, units=tuple(dataclasses.replace(u, variants={p: v for p, v in u.variants.items() if p != "fp32"})
                                             for u in m.units))
    layer = V.unit_sizes(own, "fp32")[1]
    assert V.added_bytes(own) == 0 and V.missing_units(own, "fp32", 1, 5) == (1, 2, 3, 4) and V.missing_units(own, None, 0, 5) == ()
    assert V.budget_problem(own, "fp32", (1, 2, 3, 4), 4 * layer, None) is None
    refused = V.budget_problem(own, "fp32", (1, 2, 3, 4), 4 * layer - 1, None)
    assert refused.startswith("the fp32 variant of 4 units (units [1, 5)) needs ~") and "serve --variant-disk" in refused
    assert "only 1 MB is free" in V.budget_problem(own, "fp32", (1,), 1 << 40, 10 ** 6)
    # units built already count against it; the forms of the file's own model never do
    built = UnitVariant("fp32", "graph", ("weights",), layer)
    one = dataclasses.replace(own, units=tuple(dataclasses.replace(u, variants={**u.variants, "fp32": built}) if u.index == 1 else u
                                               for u in own.units))
    assert V.added_bytes(one) == layer
    assert V.budget_problem(one, "fp32", (2, 3, 4), 4 * layer - 1, None) is not None
    assert V.budget_problem(one, "fp32", (2, 3), 3 * layer, None) is None
    assert V.budget_problem(own, "gguf", (1, 2), 0, None) is None


@pytest.mark.pure
def test_the_planner_gives_a_tab_what_its_memory_holds_in_fp32(native_pkg):
    """A tab asking for fp32 is sized in fp32, its units not built yet estimated. Memory for half the
    model in fp32 (sized in the package's own 4-bit form, it held the whole model: the planner gave
    it every unit, a build of the whole fp32 copy and a LOAD its memory could not take)."""
    m = native_pkg.manifest
    bare = dataclasses.replace(m, units=tuple(dataclasses.replace(u, variants={p: v for p, v in u.variants.items() if p != "fp32"})
                                              for u in m.units))
    context = 256
    profile = ClusterProfile(bare, context_tokens=context)
    fp32, own = V.unit_sizes(bare, "fp32"), [bare.variant(u.index).weight_bytes for u in bare.units]
    kv, half = bare.units[1].kv_bytes_per_token * context, len(own) // 2
    overhead = profile.model_profile().runtime_overhead_bytes
    native_memory = sum(own[:half]) + overhead + half * kv
    tab_memory = sum(fp32[half:]) + overhead + half * kv + (8 << 20)
    workers = [WorkerInfo("w1-native", "native", Hello.from_fields({"name": "native", "memory_bytes": native_memory, "data_url": "tcp://a:1"}), 0.0, 0.0),
               WorkerInfo("w2-tab", "tab", Hello.from_fields({"name": "tab", "kind": "browser", "memory_bytes": tab_memory, "precision": "fp32"}), 1.0, 1.0)]
    model = profile.model_profile(context_tokens=context)
    devices = profile.device_profiles(workers)
    assert {d.id: d.precision for d in devices} == {"w1-native": None, "w2-tab": "fp32"}
    best = plan(model, devices, profile.network_profile(workers), PlanRequest()).best
    assert best.complete, best.reason
    tab = next(s for s in best.stages if "w2-tab" in s.device_ids)
    assert model.stage_bytes(tab.start, tab.end, 1, "fp32") <= tab_memory
    assert sum(fp32[tab.start:tab.end]) + overhead <= tab_memory < sum(fp32)
    assert len(best.stages) == 2 and tab.end - tab.start < len(own)


@pytest.mark.pure
def test_the_planner_gives_a_tab_no_more_than_the_disk_budget_lets_be_built(native_pkg):
    """With a budget for eight fp32 layers, a tab with memory for the whole model is planned eight
    layers at most (a plan beyond it would only be refused at its deploy, again at every re-plan)."""
    m = native_pkg.manifest
    bare = dataclasses.replace(m, units=tuple(dataclasses.replace(u, variants={p: v for p, v in u.variants.items() if p != "fp32"})
                                              for u in m.units))
    fp32 = V.unit_sizes(bare, "fp32")
    profile = ClusterProfile(bare, context_tokens=256, variant_disk_bytes=8 * fp32[1])
    tab = WorkerInfo("w2-tab", "tab", Hello.from_fields({"name": "tab", "kind": "browser", "memory_bytes": 64 << 30, "precision": "fp32"}), 1.0, 1.0)
    native = WorkerInfo("w1-native", "native", Hello.from_fields({"name": "native", "memory_bytes": 64 << 30, "data_url": "tcp://a:1"}), 0.0, 0.0)
    devices = {d.id: d for d in profile.device_profiles([native, tab])}
    assert devices["w1-native"].memory_bytes == 64 << 30
    model = profile.model_profile(context_tokens=256)
    assert model.stage_bytes(1, 9, 1, "fp32") <= devices["w2-tab"].memory_bytes < model.stage_bytes(1, 10, 1, "fp32")
    # without a budget, its declared memory
    assert ClusterProfile(bare, context_tokens=256).device_profiles([tab])[0].memory_bytes == 64 << 30
