"""``ClusterProfile.model_profile`` is cached per manifest and arguments (every plan and status
view asks for it; each answer builds a UnitProfile per unit and estimates the fp32 sizes from the
config), and a variant unit built since is reflected."""

from __future__ import annotations

from dataclasses import replace

import pytest

from edgepipe.cluster.rules import variant_rules
from edgepipe.cluster.rules.profiling import ClusterProfile
from edgepipe.model.manifest import UnitVariant


def counting_unit_sizes(monkeypatch) -> list:
    calls = []
    real = variant_rules.unit_sizes

    def counted(manifest, precision):
        calls.append(precision)
        return real(manifest, precision)

    monkeypatch.setattr(variant_rules, "unit_sizes", counted)
    return calls


def test_the_same_question_is_answered_from_the_cache(native_pkg, monkeypatch):
    calls = counting_unit_sizes(monkeypatch)
    profile = ClusterProfile(native_pkg.manifest, context_tokens=256)
    first = profile.model_profile(context_tokens=64, forms=("gguf", "native"))
    assert calls and "fp32" in calls
    n = len(calls)
    assert profile.model_profile(context_tokens=64, forms=["native", "gguf", None]) is first  # same forms, any order
    assert len(calls) == n  # nothing estimated again
    other = profile.model_profile(context_tokens=128, forms=("gguf", "native"))
    assert other.context_tokens == 128 and len(calls) > n  # another question: answered afresh


def fp32_unit(unit, weight_bytes: int):
    return replace(unit, variants={**unit.variants, "fp32": UnitVariant("fp32", "g" * 64, (), weight_bytes)})


def test_a_unit_built_since_is_reflected(native_pkg):
    m = native_pkg.manifest  # the session's package: other tests may have built fp32 units already
    m = replace(m, units=tuple(replace(u, variants={k: v for k, v in u.variants.items() if k != "fp32"}) for u in m.units))
    profile = ClusterProfile(m, context_tokens=256)
    before = dict(profile.model_profile(forms=("native",)).variant_weight_bytes)["fp32"]
    assert "fp32" not in m.units[1].variants  # the fp32 size of unit 1 is the config's estimate
    # as ``Variants`` does after a build: the package reloaded, the profile given the new manifest
    built = replace(m, units=tuple(fp32_unit(u, 12345) if u.index == 1 else u for u in m.units))
    profile.manifest = built
    after = dict(profile.model_profile(forms=("native",)).variant_weight_bytes)["fp32"]
    assert after[1] == 12345 and after[1] != before[1] and after[2:] == before[2:]
    # a unit's variants changed in place (a manifest kept while a unit is added to it) count too
    mutable = replace(m, units=tuple(replace(u, variants=dict(u.variants)) for u in m.units))
    profile.manifest = mutable
    assert dict(profile.model_profile(forms=("native",)).variant_weight_bytes)["fp32"] == before
    mutable.units[2].variants["fp32"] = UnitVariant("fp32", "g" * 64, (), 777)
    assert dict(profile.model_profile(forms=("native",)).variant_weight_bytes)["fp32"][2] == 777
    assert profile.model_profile(forms=("native",)).units == profile.model_profile(forms=("native",)).units
