import json

import pytest

from tools.sim.frontier import compare, load, main, points, summary


def _results(eta: int, systems: dict[str, tuple[float, list[float]]], seeds=(0, 1)) -> dict:
    """A results.json as `libra sim` writes it: per system (token staleness, per-seed traj/s)."""
    return {
        "scenario": {"name": "paper-48gpu", "n_gpus": 48, "staleness": eta},
        "workload": "r2e_gym",
        "reported_seeds": list(seeds),
        "systems": {
            n: {
                "trained_token_staleness_mean": st,
                "trained_staleness_mean": st + 0.1,
                "trajectories_per_s": sum(tps) / len(tps),
                "trajectories_per_s_by_seed": tps,
                "settings": "x",
            }
            for n, (st, tps) in systems.items()
        },
    }


def _write(tmp_path, runs):
    dirs = []
    for r in runs:
        d = tmp_path / f"eta{r['scenario']['staleness']}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(r))
        dirs.append(d)
    return dirs


def test_each_baseline_meets_the_fastest_libra_run_that_is_no_staler():
    runs = [
        _results(1, {"libra": (0.8, [1.0, 1.2]), "areal": (0.9, [0.5, 0.6]), "verl": (0.0, [0.3, 0.3])}),
        _results(2, {"libra": (1.5, [1.4, 1.6]), "areal": (1.4, [0.7, 0.8]), "verl": (0.0, [0.3, 0.3])}),
        _results(4, {"libra": (3.3, [1.2, 1.3]), "areal": (2.4, [0.8, 0.8]), "verl": (0.0, [0.3, 0.3])}),
    ]
    rows = {(r["system"], r["staleness_bound"]): r for r in compare(points(runs))}
    # areal at eta=2 trains fresher tokens (1.4) than Libra at eta=2 (1.5): only Libra's eta=1 run counts.
    assert rows[("areal", 2)]["libra"]["staleness_bound"] == 1
    assert rows[("areal", 2)]["ratio"]["mean"] == pytest.approx((1.0 / 0.7 + 1.2 / 0.8) / 2)
    # At eta=4 areal's 2.4 admits Libra's eta=2 run (the fastest no staler), not its staler eta=4 one.
    assert rows[("areal", 4)]["libra"]["staleness_bound"] == 2
    # Within the tolerance counts as no staler; nothing Libra ran is as fresh as a synchronous system.
    loose = {(r["system"], r["staleness_bound"]): r for r in compare(points(runs), tolerance=0.1)}
    assert loose[("areal", 2)]["libra"]["staleness_bound"] == 2
    assert rows[("verl", 1)]["libra"] is None
    s = summary(list(rows.values()))
    assert s["worst"]["system"] == "areal" and ("verl", 1) in s["unmatched"]


def test_runs_that_cannot_be_compared_are_refused_and_nothing_is_written(tmp_path, capsys):
    a = _results(1, {"libra": (0.8, [1.0, 1.2]), "areal": (0.9, [0.5, 0.6])})
    b = _results(2, {"libra": (1.5, [1.4, 1.6]), "areal": (1.4, [0.7, 0.8])}, seeds=(0, 1, 2))
    dirs = _write(tmp_path, [a, b])
    with pytest.raises(ValueError, match="reported_seeds"):
        load(dirs)
    out = tmp_path / "out"
    assert main([*map(str, dirs), "--out", str(out)]) == 2
    assert "reported_seeds" in capsys.readouterr().err and not out.exists()
    assert main([str(dirs[0]), str(dirs[0]), "--out", str(out)]) == 2
    assert "repeat" in capsys.readouterr().err


def test_the_cli_writes_the_table_the_json_and_the_plot(tmp_path, capsys):
    runs = [
        _results(1, {"libra": (0.8, [1.0, 1.2]), "areal": (0.9, [0.5, 0.6])}),
        _results(2, {"libra": (1.5, [1.4, 1.6]), "areal": (1.6, [0.7, 0.8])}),
    ]
    out = tmp_path / "out"
    assert main([*map(str, _write(tmp_path, runs)), "--out", str(out)]) == 0
    data = json.loads((out / "frontier.json").read_text())
    assert data["staleness_bounds"] == [1, 2] and len(data["comparisons"]) == 2
    assert (out / "frontier.png").stat().st_size > 0
    assert "smallest lead" in capsys.readouterr().out
