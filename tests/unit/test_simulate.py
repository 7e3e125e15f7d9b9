"""orchestrator/simulate: the failure process, the strategies, stalwart's answers through
the supervisor's own policy code, the published figures it is checked against, bad input."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from stalwart.health import policy
from stalwart.orchestrator.cli import main
from stalwart.orchestrator.simulate import strategies
from stalwart.orchestrator.simulate.analytic import kokolis_ettr, restart_storage_estimate
from stalwart.orchestrator.simulate.baselines import optimal_interval, restart_storage
from stalwart.orchestrator.simulate.failures import draw, mtbf_s
from stalwart.orchestrator.simulate.presets import LLAMA3
from stalwart.orchestrator.simulate.run import report, simulate
from stalwart.orchestrator.simulate.scenario import Scenario
from stalwart.orchestrator.simulate.strategies import straggler_found_s

pytestmark = pytest.mark.timeout(120)

# Llama 3's checkpointing, as this model needs it (the paper gives none of these figures; it
# says job start-up and checkpointing were made faster): failures noticed within a minute,
# the world restarted in 3 and the checkpoint read in 1, a save stalling training 20 s.
META = {"detect_s": 60, "restart_s": 180, "load_s": 60, "save_stall_s": 20}


def _one(sc: Scenario, name: str) -> dict:
    [s] = [s for s in report(sc, simulate(sc))["strategies"] if s["strategy"] == name]
    return s


def test_the_llama3_preset_reproduces_its_interruptions_and_effective_training_time():
    assert LLAMA3.total == 419
    sc = Scenario(
        job={"days": 54},
        seeds=10,
        strategies=["restart-storage"],
        costs={"restart_storage": META},
    )
    s = _one(sc, "restart-storage")
    # 419 in 54 days, the Poisson spread of ten runs' mean (one run's sd: ~20).
    assert 419 - 20 <= s["interruptions"] <= 419 + 20
    assert s["ettr"] > 0.90  # "more than 90 % effective training time"


def test_stalwart_with_the_gpus_measured_step_overhead_meets_98_percent_at_16k():
    """Issue 25's goal, with the simulator's defaults (a snapshot's 1 % of the step as one
    H200 measured it); the 2-core CPU's 1.07x would not meet it."""
    sc = Scenario(job={"days": 54}, seeds=3, strategies=["stalwart"])
    assert sc.cluster.gpus == 16_384 and sc.failures.preset == "llama3"
    assert _one(sc, "stalwart")["ettr"] >= 0.98
    cpu = sc.model_copy(
        update={"costs": Scenario(costs={"stalwart": {"step_overhead": 0.07}}).costs}
    )
    assert _one(cpu, "stalwart")["ettr"] < 0.98


def test_young_s_interval_beats_saving_four_times_more_or_less_often():
    sc = Scenario(job={"days": 54}, seeds=1, costs={"restart_storage": META})
    failures = draw(sc, 0)
    best = optimal_interval(sc)
    assert best == pytest.approx((2 * 54 * 86_400 / 419 * 20) ** 0.5, rel=0.01)

    def ettr(interval):
        costs = {"restart_storage": {**META, "interval_s": interval}}
        return restart_storage(
            sc.model_copy(update={"costs": Scenario(costs=costs).costs}), 0, failures, []
        ).ettr

    assert ettr(best) > ettr(best / 4) and ettr(best) > ettr(best * 4)


def test_every_stalwart_failure_is_decided_by_the_supervisors_policy(monkeypatch):
    calls = []

    def spy(failures, budget, now, config, history):
        calls.append(failures[0].kind)
        return policy.decide(failures, budget, now, config, history)

    monkeypatch.setattr(strategies, "decide", spy)
    sc = Scenario(cluster={"gpus": 4096}, job={"days": 20}, seeds=1, strategies=["stalwart"])
    s = _one(sc, "stalwart")
    assert len(calls) == s["interruptions"] > 20
    assert {k.value for k in calls} >= {"gpu_fatal", "node_lost", "worker_died"}


def test_a_policy_setting_moves_the_simulated_outcome():
    """health.loss_guard.max_rollbacks: at 0, the policy fails the job at the first loss
    that is not finite (silent data corruption), and it is restarted by hand from storage."""
    base = {
        "cluster": {"gpus": 16_384},
        "job": {"days": 54},
        "seeds": 3,
        "strategies": ["stalwart"],
    }
    rolled = _one(Scenario(**base), "stalwart")
    strict = _one(Scenario(**base, costs={"stalwart": {"loss_rollbacks": 0}}), "stalwart")
    assert strict["jobs_failed"] > rolled["jobs_failed"]
    assert strict["lost_hours"]["manual"] > rolled["lost_hours"]["manual"]
    assert strict["ettr"] < rolled["ettr"]
    # The flapping rule: one failure on a node cordons it, so a process death takes a
    # spare node (and, with none left, a cold one) instead of a restart in place.
    flappy = _one(
        Scenario(**base, costs={"stalwart": {"flap_failures": 1, "spares": 0}}), "stalwart"
    )
    calm = _one(Scenario(**base, costs={"stalwart": {"spares": 0}}), "stalwart")
    assert flappy["lost_hours"]["cold_start"] > calm["lost_hours"]["cold_start"]


def test_one_copy_sends_every_lost_node_to_storage_and_two_keep_it_in_memory():
    base = {"cluster": {"gpus": 4096}, "job": {"days": 30}, "seeds": 2, "strategies": ["stalwart"]}
    one = _one(Scenario(**base, costs={"stalwart": {"replicas": 1}}), "stalwart")
    two = _one(Scenario(**base), "stalwart")
    assert one["storage_fallbacks"] > 0 and two["storage_fallbacks"] == 0
    assert one["lost_hours"]["redone"] > 10 * two["lost_hours"]["redone"]


def test_the_derived_hang_timeout_is_the_supervisors():
    sc = Scenario(job={"step_time_s": 10.0})
    assert strategies.hang_timeouts(sc).step_s == 50.0  # 5 x the step, over the 20 s floor
    fixed = Scenario(costs={"stalwart": {"hang_timeout_s": 600}})
    assert strategies.hang_timeouts(fixed).step_s == 600


def test_100k_gpus_for_30_days_runs_and_every_strategy_meets_the_same_failures():
    sc = Scenario(cluster={"gpus": 100_000}, job={"days": 30}, seeds=1)
    out = report(sc, simulate(sc))
    counts = {s["interruptions"] for s in out["strategies"]}
    assert len(counts) == 1 and counts.pop() > 1000
    assert all(0 <= s["ettr"] <= 1 for s in out["strategies"])


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        (
            ["failures.causes=[{name: x, kind: gpu, per_gpu_day: -1}]"],
            "failures.causes.0.per_gpu_day: must be >= 0.0, got -1",
        ),
        (["costs.stalwart.spares=4096"], "costs.stalwart.spares (4096) must be fewer"),
        (["job.step_time_s=0"], "job.step_time_s: must be > 0.0, got 0"),
        (["strategies=[magic]"], "strategies.0"),
        (["cluster.gpus=12"], "gpus (12) must be a multiple of gpus_per_node (8)"),
    ],
)
def test_impossible_values_are_refused_naming_the_field(tmp_path, sets, named):
    path = tmp_path / "s.yaml"
    path.write_text("name: t\ncluster: {gpus: 1024}\n")
    args = ["simulate", str(path)]
    for s in sets:
        args += ["--set", s]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    assert named in res.output and "Traceback" not in res.output


def test_the_cli_prints_the_table_json_and_the_schema(tmp_path):
    res = _example("--seeds", "1", "-o", "json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [s["strategy"] for s in out["strategies"]] == list(strategies_order())
    text = _example("--seeds", "1")
    assert text.exit_code == 0 and "ETTR" in text.output and "stalwart" in text.output
    schema = json.loads(CliRunner().invoke(main, ["simulate", "--schema"]).output)
    assert "failures" in schema["properties"]


def _example(*args: str):
    """`stalwart simulate` of examples/simulate/llama3-16k.yaml with `args`."""
    return CliRunner().invoke(main, ["simulate", "examples/simulate/llama3-16k.yaml", *args])


def strategies_order():
    from stalwart.orchestrator.simulate.scenario import STRATEGIES

    return STRATEGIES


def test_ft_hsdp_s_shift_at_100k_gpus_is_reproduced_in_direction_and_size():
    """FT-HSDP reports the effective training time of a ~100K-GPU job going from 44 % to
    80 % when the stall of a replica group's failure drops from 10 to 3 minutes. One
    calibration (the failure rate: 1.5x Llama 3's per GPU, which gives the 44 % at 10
    minutes here) and the 3-minute figure follows from the model."""
    base = {
        "cluster": {"gpus": 100_000},
        "job": {"days": 10},
        "seeds": 2,
        "strategies": ["replica-group"],
        "failures": {"scale": 1.5},
    }
    slow = _one(Scenario(**base, costs={"replica_group": {"stall_s": 600}}), "replica-group")
    fast = _one(Scenario(**base, costs={"replica_group": {"stall_s": 180}}), "replica-group")
    assert slow["ettr"] == pytest.approx(0.44, abs=0.04)
    assert fast["ettr"] == pytest.approx(0.80, abs=0.04)


def test_a_sweep_names_the_best_setting_for_stalwart_and_bad_sweeps_are_refused():
    res = _example(
        "--seeds",
        "1",
        "-o",
        "json",
        "--set",
        "strategies=[stalwart]",
        "--sweep",
        "costs.stalwart.replicas=1,2",
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    ettr = {
        s["setting"]["costs.stalwart.replicas"]: s["strategies"][0]["ettr"] for s in out["sweep"]
    }
    assert ettr["2"] > ettr["1"]
    assert out["best"] == {
        "setting": {"costs.stalwart.replicas": "2"},
        "ettr": ettr["2"],
        "highest": ettr["2"],
    }
    for bad, said in (
        ("costs.stalwart.replicas", "--sweep: expected key.path=v1,v2,..."),
        ("costs.stalwart.replicas=1,0", "costs.stalwart.replicas: must be >= 1, got 0"),
    ):
        res = _example("--sweep", bad)
        assert res.exit_code == 2 and said in res.output, res.output


def test_restart_storage_agrees_with_the_first_order_analytic_ettr():
    """Where failures are rare against the time each one costs, the lost share is the
    failure rate times what a failure costs (noticed, restarted, loaded, half an interval
    redone) plus a save's stall per interval: 1 - lam (d + r + l + tau/2) - C/(tau + C)."""
    sc = Scenario(
        cluster={"gpus": 4096},
        job={"days": 54},
        seeds=20,
        strategies=["restart-storage"],
        costs={"restart_storage": META},
    )
    lam = 419 / (54 * 86_400) * 4096 / 16_384
    tau, c = optimal_interval(sc), META["save_stall_s"]
    per_failure = META["detect_s"] + META["restart_s"] + META["load_s"] + tau / 2
    analytic = 1 - lam * per_failure - c / (tau + c)
    assert _one(sc, "restart-storage")["ettr"] == pytest.approx(analytic, abs=0.005)


def test_the_research_clusters_presets_give_the_published_mttf_projections():
    """Kokolis et al. project RSC-1's rate to an MTTF of about 1.8 h for 16,384 GPUs and
    about 14 minutes for 131,072; RSC-2 fails 2.34 / 6.50 as often."""

    def mttf_h(preset: str, gpus: int) -> float:
        return mtbf_s(Scenario(cluster={"gpus": gpus}, failures={"preset": preset})) / 3600

    assert mttf_h("rsc1", 16_384) == pytest.approx(1.8, abs=0.05)
    assert mttf_h("rsc1", 131_072) * 60 == pytest.approx(14, abs=0.5)
    assert mttf_h("rsc2", 16_384) / mttf_h("rsc1", 16_384) == pytest.approx(6.50 / 2.34)


def test_kokolis_estimate_agrees_with_the_simulator_where_its_assumptions_hold():
    """RSC-1's rate at 2,048 GPUs (MTTF 14.4 h), a restart overhead of 5 minutes, saves
    every 30 minutes that stall nothing: 1 - (u0 + interval/2) / MTTF. Where failures come
    every few minutes instead (131,072 GPUs), the report says the estimate does not hold."""
    costs = {**META, "save_stall_s": 0, "interval_s": 1800}
    sc = Scenario(
        cluster={"gpus": 2048},
        job={"days": 54},
        failures={"preset": "rsc1"},
        seeds=20,
        strategies=["restart-storage"],
        costs={"restart_storage": costs},
    )
    u0 = META["detect_s"] + META["restart_s"] + META["load_s"]
    expected = kokolis_ettr(mtbf_s(sc), u0, 1800)
    assert expected == pytest.approx(1 - 1200 / (86_400 / (256 * 6.5e-3)))
    out = report(sc, simulate(sc))
    est = out["kokolis_estimate"]["restart-storage"]
    assert est["assumptions_hold"] and est["ettr"] == pytest.approx(expected, abs=1e-5)
    assert _one(sc, "restart-storage")["ettr"] == pytest.approx(expected, abs=0.005)

    big = sc.model_copy(update={"cluster": sc.cluster.model_copy(update={"gpus": 131_072})})
    est = restart_storage_estimate(big, 1800)
    assert not est["assumptions_hold"] and "MTTF" in est["outside_assumptions"][0]


def _stragglers(**stalwart) -> Scenario:
    return Scenario(
        cluster={"gpus": 1024},
        job={"days": 10},
        failures={"stragglers": {"per_gpu_day": 0.002, "slowdown": 2.5, "duration_s": 3600}},
        seeds=3,
        costs={"stalwart": stalwart},
    )


def test_a_slow_gpu_is_found_by_the_supervisors_monitor_and_moved_only_when_told():
    """The straggler detector is the supervisor's HealthMonitor (its windows, warm-up and
    min_duration_s); health.straggler.policy alert leaves the slow GPU pacing the job as
    every baseline does; replace moves it to a spare, as straggler_decision says."""
    sc = _stragglers()
    step = sc.job.step_time_s * 2.5
    found = straggler_found_s(sc, random.Random(0))
    span = 5 * 2  # health.straggler's window_steps x consecutive_windows
    assert found is not None and span * step <= found <= (span + 2) * step

    alert = {s["strategy"]: s for s in report(sc, simulate(sc))["strategies"]}
    assert alert["stalwart"]["stragglers"] > 10 and alert["stalwart"]["stragglers_moved"] == 0
    lost = alert["stalwart"]["lost_hours"]["straggler"]
    assert lost == alert["restart-storage"]["lost_hours"]["straggler"] > 0

    moved = _one(_stragglers(straggler={"policy": "replace"}), "stalwart")
    assert moved["stragglers_moved"] == moved["stragglers"] == alert["stalwart"]["stragglers"]
    assert moved["lost_hours"]["straggler"] < lost / 10
    assert moved["ettr"] > alert["stalwart"]["ettr"] + 0.03

    # Without a spare there is nowhere to move it: straggler_decision's alert.
    stuck = _one(_stragglers(straggler={"policy": "replace"}, spares=0), "stalwart")
    assert stuck["stragglers_moved"] == 0


def test_a_slowdown_under_the_detectors_threshold_is_never_flagged_until_it_is_lowered():
    mild = {"stragglers": {"per_gpu_day": 0.002, "slowdown": 1.5}}
    sc = _stragglers().model_copy(update={"failures": Scenario(failures=mild).failures})
    assert straggler_found_s(sc, random.Random(0)) is None
    lower = Scenario(costs={"stalwart": {"straggler": {"threshold": 1.3}}}).costs
    assert straggler_found_s(sc.model_copy(update={"costs": lower}), random.Random(0))


def test_spares_and_standbys_count_as_gpus_held_that_do_not_train():
    sc = Scenario(cluster={"gpus": 64, "gpus_per_node": 8}, job={"days": 5}, seeds=2)
    out = {s["strategy"]: s for s in report(sc, simulate(sc))["strategies"]}
    assert out["stalwart"]["idle_gpus"] == 8 and out["standby-switch"]["idle_gpus"] == 8
    assert out["stalwart"]["ettr_per_gpu_held"] == pytest.approx(
        out["stalwart"]["ettr"] * 64 / 72, abs=1e-4
    )
    assert out["gemini"]["ettr_per_gpu_held"] == out["gemini"]["ettr"]


def test_the_figure_draws_ettr_against_the_gpu_count(tmp_path):
    png = tmp_path / "ettr.png"
    res = _example(
        "--seeds",
        "1",
        "--set",
        "job.days=5",
        "--figure",
        str(png),
        "--sweep",
        "cluster.gpus=1024,16384",
    )
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = _example(
        "--figure",
        str(png),
        "--sweep",
        "costs.stalwart.spares=0,1",
    )
    assert res.exit_code == 2 and "no other --sweep beside it" in res.output


def test_a_seed_gives_the_same_run_and_another_seed_another():
    sc = Scenario(cluster={"gpus": 2048}, job={"days": 10}, seeds=1, seed=11)
    first, again = report(sc, simulate(sc)), report(sc, simulate(sc))
    assert first == again
    other = report(sc.model_copy(update={"seed": 12}), simulate(sc.model_copy(update={"seed": 12})))
    assert [s["ettr"] for s in other["strategies"]] != [s["ettr"] for s in first["strategies"]]


def test_the_spare_taken_is_the_supervisors_choice(monkeypatch):
    from stalwart.health.cordon import first_usable

    asked = []

    def spy(nodes, bad):
        asked.append((list(nodes), set(bad)))
        return first_usable(nodes, bad)

    monkeypatch.setattr(strategies, "first_usable", spy)
    sc = Scenario(cluster={"gpus": 4096}, job={"days": 20}, seeds=1, strategies=["stalwart"])
    _one(sc, "stalwart")
    assert asked and all(n.startswith("spare-") for nodes, _ in asked for n in nodes)
    assert any(bad for _, bad in asked)  # the cordoned nodes it was told of
    assert first_usable(["a", "b", "c"], {"a"}) == 1 and first_usable(["a"], {"a"}) is None
