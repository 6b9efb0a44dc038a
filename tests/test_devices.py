"""Device profiles: bundled data files, the measured host profile, and scaling a chain to a device."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from edgetrain.devices import (
    NUMERIC_FIELDS, SCHEMA_VERSION, DeviceProfile, list_profiles, load_profile, measure_host, scale_chain,
)
from edgetrain.errors import ProfileError
from edgetrain.graph import CostChain, Linear, StageCost
from edgetrain.planners.paging_model import simulate_paged

REQUIRED = {"arduino-mkr1000", "nrf52840", "rpi4", "jetson-nano", "jetson-tx2", "phone-2024"}


def test_bundled_profiles_are_complete_and_cited():
    names = list_profiles()
    assert REQUIRED <= set(names) and names[-1] == "host"
    for name in names[:-1]:
        p = load_profile(name)
        assert p.name == name and p.schema_version == SCHEMA_VERSION
        for f in NUMERIC_FIELDS:
            assert getattr(p, f) > 0
            assert len(p.sources[f]) > 10
            assert p.provenance[f] in ("datasheet", "paper", "measured", "estimate")
        assert p.page_in_s(1e6) > p.page_in_latency_s


def test_profiles_are_ordered_as_the_hardware():
    mkr, nrf, pi, tx2 = (load_profile(n) for n in ("arduino-mkr1000", "nrf52840", "rpi4", "jetson-tx2"))
    assert mkr.ram_bytes < nrf.ram_bytes < pi.ram_bytes <= tx2.ram_bytes
    assert mkr.compute_flops_per_s < nrf.compute_flops_per_s < pi.compute_flops_per_s < tx2.compute_flops_per_s
    assert load_profile("RPI4") == load_profile("rpi4") and load_profile("jetson_tx2") == tx2


def test_unknown_and_invalid_profiles(tmp_path):
    with pytest.raises(ProfileError, match="known: .*rpi4"):
        load_profile("pdp-11")
    d = load_profile("rpi4").to_dict()
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(d))
    assert load_profile(path) == load_profile("rpi4")
    for broken, pattern in ((dict(d, schema_version=2), "schema_version"),
                            (dict(d, ram_bytes=-1), "positive"),
                            (dict(d, sources={k: v for k, v in d["sources"].items() if k != "ram_bytes"}),
                             "sources"),
                            (dict(d, provenance=dict(d["provenance"], ram_bytes="guess")), "provenance"),
                            ({k: v for k, v in d.items() if k != "page_in_bytes_per_s"}, "missing")):
        path.write_text(json.dumps(broken))
        with pytest.raises(ProfileError, match=pattern):
            load_profile(path)


def test_measure_host_labels_every_field(tmp_path):
    p = measure_host(tmp_path, storage_bytes=1 << 20, min_time_s=0.05)
    assert p.name == "host"
    for f in NUMERIC_FIELDS:
        assert getattr(p, f) > 0
        assert p.provenance[f] in ("measured", "estimate")
        assert p.sources[f].startswith(p.provenance[f])
    for f in ("compute_flops_per_s", "page_in_bytes_per_s", "page_out_bytes_per_s", "ram_bytes"):
        assert p.provenance[f] == "measured"
    assert p.compute_flops_per_s > 1e7                  # any CPU that runs torch does this much
    assert list(tmp_path.iterdir()) == []               # the probe file is removed
    assert DeviceProfile.from_dict(p.to_dict()) == p    # a measured profile is a valid data file


def _chain() -> CostChain:
    stages = tuple(StageCost(f"s{i}", fwd_s=Linear(1e-3, 1e-4), bwd_s=Linear(2e-3, 2e-4),
                             saved_bytes=Linear(0, 1000), out_bytes=Linear(0, 500),
                             flops=Linear(0, 2e6 * (i + 1))) for i in range(3))
    return CostChain(stages, 4, Linear(0, 100), 10_000, loss_s=Linear(0, 1e-5), step_fixed_s=1e-3, name="c")


def test_scale_chain_by_rate_and_by_flops():
    chain = _chain()
    pi, tx2 = load_profile("rpi4"), load_profile("jetson-tx2")
    scaled = scale_chain(chain, pi, tx2)
    f = pi.compute_flops_per_s / tx2.compute_flops_per_s
    for a, b in zip(chain.stages, scaled.stages):
        assert b.fwd_s.at(3) == pytest.approx(a.fwd_s.at(3) * f)
        assert b.bwd_s.at(3) == pytest.approx(a.bwd_s.at(3) * f)
        assert b.saved_bytes == a.saved_bytes and b.out_bytes == a.out_bytes
    assert scaled.step_fixed_s == pytest.approx(chain.step_fixed_s * f)
    assert scaled.name == "c@jetson-tx2"
    by_flops = scale_chain(chain, None, pi)
    for a, b in zip(chain.stages, by_flops.stages):
        assert b.fwd_s.at(2) == pytest.approx(a.flops.at(2) / pi.compute_flops_per_s)
        assert b.bwd_s.at(2) == pytest.approx(2 * a.flops.at(2) / pi.compute_flops_per_s)
    no_flops = CostChain((replace(chain.stages[0], flops=Linear()),) + chain.stages[1:], 4, Linear(0, 100), 0)
    with pytest.raises(ProfileError, match="from_profile"):
        scale_chain(no_flops, None, pi)


def test_energy_is_time_times_power_on_each_device():
    chain = _chain()
    keep = ["keep"] * chain.n
    for name in ("arduino-mkr1000", "rpi4", "phone-2024"):
        dev = load_profile(name)
        on_dev = scale_chain(chain, None, dev)
        c = simulate_paged(on_dev, dev, 4, keep)
        assert c.energy_j == pytest.approx(c.step_time_s * dev.active_power_w)
        paged = simulate_paged(on_dev, dev, 4, ["page", "keep", "keep"])
        assert paged.energy_j == pytest.approx(paged.compute_time_s * dev.active_power_w
                                               + paged.transfer_time_s * dev.memory_power_w)
        assert paged.transfer_time_s == pytest.approx(dev.page_out_s(4 * 1500) + dev.page_in_s(4 * 1500))
