"""simulate: one seed of the deterministic simulator; the same seed gives the same report."""

import pytest

from rustytorch import ConfigError, simulate


def test_same_seed_same_report(repo, data_dir):
    # Goal: a run is a function of its seed. Method: seed 3 twice gives equal reports (trace hash
    # of every event, final parameter checksum); seed 4 gives another trace.
    scenario = repo / "sim/scenarios/elastic_dp.toml"
    first = simulate(scenario, seed=3, data_dir=data_dir)
    again = simulate(scenario, seed=3, data_dir=data_dir)
    assert first == again
    assert first["ok"], first["violation"]
    assert first["seed"] == 3 and first["committed"] == first["total_steps"] == 40
    assert first["faults"] > 0 and first["checks"] > 0
    other = simulate(scenario, seed=4, data_dir=data_dir)
    assert other["trace"] != first["trace"]


def test_a_missing_scenario_raises(tmp_path, data_dir):
    with pytest.raises(ConfigError, match="absent.toml"):
        simulate(tmp_path / "absent.toml", seed=1, data_dir=data_dir)


def test_a_malformed_scenario_raises(tmp_path, data_dir):
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = \"four\"\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        simulate(bad, seed=1, data_dir=data_dir)
