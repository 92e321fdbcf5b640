"""The site policy (policy.py, `policy:` in slurmckpt.yaml): parsed with errors that name the key, resolved for a
job's partition and QOS (limits: the strictest; defaults and settings: the most specific), checked at submission
(`slurmckpt policy check`, what cli_filter.lua runs) and applied by the agent (interval, refused captures)."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from fake_slurm import FakeSlurm
from slurmckpt.cli import cli
from slurmckpt.config import Config
from slurmckpt.errors import ConfigError
from slurmckpt.policy import JobPolicy
from fake_runner import fake_runner

POLICY = {"default": {"min_interval": "1m"},
          "partitions": {"debug": {"allowed": False}, "low": {"default_interval": "30m", "min_interval": "10m",
                                                            "keep_epochs": 3},
                         "auto": {"default_interval": "auto", "min_interval": "2m", "max_interval": "1h",
                                  "interruption_mtbi": "6h"}},
          "qos": {"long": {"min_interval": "1h", "keep_epochs": 5}, "fast": {"default_interval": "off"}}}


def policy():
    return Config.from_mapping({"policy": POLICY}).policy


def test_resolution_limits_take_the_strictest_defaults_and_settings_the_most_specific():
    p = policy()
    low = p.for_job(["low"], None)
    assert (low.allowed, low.min_interval, low.min_from, low.default_interval) == (True, 600, "partition low", 1800)
    assert dict(low.settings) == {"keep_epochs": 3}
    low_long = p.for_job(["low"], "long")
    assert (low_long.min_interval, low_long.min_from) == (3600, "QOS long")
    assert dict(low_long.settings) == {"keep_epochs": 5}                     # the QOS's, more specific
    assert low_long.interval(0, explicit=False) == 3600                      # default 30m raised to the QOS min
    assert p.for_job(["low"], "fast").interval(1800, explicit=False) == 0      # the QOS default: off
    other = p.for_job(["other"], None)
    assert (other.min_interval, other.default_interval, other.min_from) == (60, None, "the site default")
    assert other.interval(900, explicit=False) == 900                       # no policy default: the plugin's
    denied = p.for_job(["low", "debug"], "long")                            # at submission: every partition named
    assert not denied.allowed and denied.denied_by == "partition debug"


@pytest.mark.parametrize("partitions, qos, seconds, want", [
    (["debug"], None, 600, "--checkpoint-interval=10m: checkpoints are not allowed in partition debug (site policy)"),
    (["low"], None, 300, "--checkpoint-interval=5m: below the minimum 10m of partition low (site policy)"),
    (["low"], "long", 1800, "--checkpoint-interval=30m: below the minimum 1h of QOS long (site policy)"),
    (["low"], None, 600, None), (["debug"], None, 0, None), (["other"], None, 30, "below the minimum 1m"),
])
def test_refusals_name_the_option_the_value_and_the_rule(partitions, qos, seconds, want):
    got = policy().for_job(partitions, qos).refusal(seconds)
    assert got == want if want is None or want.startswith("--") else want in got


def test_the_agent_refuses_periodic_captures_closer_than_the_minimum_never_a_final_one():
    job = policy().for_job(["low"], None)
    assert job.capture_refusal(final=False, since_last_s=None) is None        # the first capture
    assert job.capture_refusal(final=False, since_last_s=599.5) is None       # 1 s tolerance for jitter
    rule, why = job.capture_refusal(final=False, since_last_s=120)
    assert rule == "partition low" and "120s after the previous one" in why and "minimum interval 10m" in why
    assert job.capture_refusal(final=True, since_last_s=1) is None
    rule, why = policy().for_job(["debug"], None).capture_refusal(final=True, since_last_s=None)
    assert rule == "partition debug" and "not allowed" in why
    assert JobPolicy().capture_refusal(final=False, since_last_s=0.1) is None   # no policy, no refusal


@pytest.mark.parametrize("raw, message", [
    ({"partitions": {"low": {"min_intervl": "1m"}}}, "policy.partitions.low: unknown key 'min_intervl'"),
    ({"partitions": {"low": {"min_interval": "5x"}}}, "policy.partitions.low.min_interval: bad value '5x'"),
    ({"partitions": {"low": {"min_interval": "off"}}}, "'off' is no minimum"),
    ({"partitions": {"low": {"min_interval": "5s"}}}, "policy.partitions.low.min_interval: bad value '5s': below "
                                                      "the minimum of 10 seconds"),
    ({"partitions": {"low": {"allowed": "no"}}}, "policy.partitions.low.allowed: bad value 'no': want true or false"),
    ({"partitions": {"low": {"keep_epochs": -1}}}, "policy.partitions.low.keep_epochs: bad value -1: must be >= 0"),
    ({"qos": {"a": {"default_interval": "1m", "min_interval": "5m"}}}, "default_interval 1m is below its own"),
    ({"qos": {"a": {"storage_root": "/tmp"}}}, "policy.qos.a: unknown key 'storage_root'"),
    ({"partition": {}}, "policy: unknown key 'partition'"),
    ({"partitions": ["low"]}, "policy.partitions: expected a mapping"),
    ("strict", "expected a mapping with default, partitions, qos"),
])
def test_bad_policy_entries_name_the_key(raw, message):
    with pytest.raises(ConfigError) as e:
        Config.from_mapping({"policy": raw}, source="/etc/slurmckpt/slurmckpt.yaml")
    assert str(e.value).startswith("/etc/slurmckpt/slurmckpt.yaml: policy") and message in str(e.value), str(e.value)


def test_auto_is_an_interval_bounded_by_the_minimum_and_the_maximum():
    """auto passes the minimum at submission (it never chooses below it) and stays auto in the running task;
    its bounds are the largest min_interval and the smallest max_interval, never below the plugin's 10 s."""
    p = policy()
    assert p.for_job(["low"], None).refusal(-1) is None
    assert p.for_job(["low"], None).interval(-1, explicit=True) == -1
    job = p.for_job(["auto", "low"], "long")
    assert (job.auto_bounds(), job.min_from, job.max_from) == ((3600, 3600), "QOS long", "partition auto")
    assert p.for_job(["auto"], None).auto_bounds() == (120, 3600)
    assert p.for_job(["other"], None).auto_bounds() == (60, 86400)            # the built-in maximum
    assert JobPolicy().auto_bounds() == (10, 86400)
    rule = Config.from_mapping({"policy": {"default": {"default_interval": "auto", "min_interval": "5m"}}}).policy
    job = rule.for_job([], None)
    assert job.default_interval == -1 and job.interval(600, explicit=False) == -1    # the policy's default: auto
    assert job.interval(600, explicit=True) == 600


@pytest.mark.parametrize("raw, message", [
    ({"default": {"max_interval": "off"}}, "'off' is no maximum"),
    ({"default": {"max_interval": "auto"}}, "policy.default.max_interval: bad value 'auto'"),
    ({"default": {"min_interval": "auto"}}, "policy.default.min_interval: bad value 'auto'"),
    ({"default": {"max_interval": "1m", "min_interval": "5m"}}, "max_interval 1m is below its own min_interval 5m"),
])
def test_bad_auto_bounds_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_mapping({"policy": raw})


def test_a_bare_number_is_minutes_as_on_the_command_line():
    assert Config.from_mapping({"policy": {"default": {"min_interval": 5}}}).policy.default.min_interval == 300


def test_yaml_off_and_settings_apply_to_the_agents_config(tmp_path: Path):
    (tmp_path / "c.yaml").write_text("keep_epochs: 2\npolicy:\n  partitions:\n    low: {default_interval: off, "
                                     "keep_epochs: 4}\n")
    config = Config.load(tmp_path / "c.yaml")
    job = config.policy.for_job(["low"], None)
    assert job.default_interval == 0
    assert config.with_settings(dict(job.settings)).keep_epochs == 4 and config.keep_epochs == 2
    assert not Config().policy and config.policy


# ---- at submission: `slurmckpt policy check` (etc/cli_filter.lua runs it) -----------------------------------
@pytest.fixture
def site(tmp_path: Path, monkeypatch):
    import yaml
    (tmp_path / "slurmckpt.yaml").write_text(yaml.safe_dump({"policy": POLICY}))
    monkeypatch.setenv("SLURMCKPT_CONFIG", str(tmp_path / "slurmckpt.yaml"))
    return FakeSlurm(scontrol="PartitionName=debug Default=YES State=UP\nPartitionName=low Default=NO\n"
                     ).install(monkeypatch)


@pytest.mark.parametrize("args, code, out", [
    (["--interval", "30m", "--partition", "low"], 0, "ok"),
    (["--interval", "5m", "--partition", "low"], 1, "refused: slurmckpt: --checkpoint-interval=5m: below the "
                                                    "minimum 10m of partition low (site policy)"),
    (["--interval", "30m", "--partition", "low", "--qos", "long"], 1, "below the minimum 1h of QOS long"),
    (["--interval", "30m", "--partition", "low,debug"], 1, "not allowed in partition debug"),
    (["--interval", "30m"], 1, "not allowed in partition debug"),          # Slurm's default partition
    (["--interval", "off", "--partition", "debug"], 0, "ok"),
    (["--interval", "5x", "--partition", "low"], 1, "refused: invalid --checkpoint-interval value '5x'"),
    (["--interval", "auto", "--partition", "low"], 0, "ok"),                     # auto chooses within the bounds
    (["--interval", "AUTO", "--partition", "debug"], 1, "--checkpoint-interval=auto: checkpoints are not allowed "
                                                        "in partition debug"),
])
def test_policy_check_prints_ok_or_the_refusal(site, args, code, out):
    r = CliRunner().invoke(cli, ["policy", "check", *args])
    assert r.exit_code == code and out in r.output, r.output
    assert r.output.count("\n") == 1


def test_policy_check_speaks_json_too(site):
    import json
    r = CliRunner().invoke(cli, ["policy", "check", "--json", "--interval", "5m", "--partition", "low"])
    assert r.exit_code == 1 and json.loads(r.output) == {
        "ok": False, "message": "slurmckpt: --checkpoint-interval=5m: below the minimum 10m of partition low (site "
                                "policy); see `slurmckpt policy show`"}
    r = CliRunner().invoke(cli, ["policy", "check", "-P", "-n", "--interval", "30m", "--partition", "low"])
    assert r.exit_code == 0 and r.output == "ok|\n"


def test_policy_show_lists_entries_and_resolves(site):
    r = CliRunner().invoke(cli, ["policy", "show", "-P"])
    assert r.exit_code == 0
    lines = r.output.splitlines()
    assert lines[0] == "SCOPE|ALLOWED|DEFAULT_INTERVAL|MIN_INTERVAL|MAX_INTERVAL|SETTINGS"
    assert "partition debug|False||||" in lines and "partition low|True|30m|10m||keep_epochs=3" not in lines
    assert "partition low||30m|10m||keep_epochs=3" in lines
    assert "partition auto||auto|2m|1h|interruption_mtbi=21600" in lines
    r = CliRunner().invoke(cli, ["policy", "show", "--partition", "low", "--qos", "long", "--json"])
    import json
    doc = json.loads(r.output)
    assert doc["min_interval_s"] == 3600 and doc["min_interval_from"] == "QOS long" and doc["settings"] == {"keep_epochs": 5}
    assert (doc["max_interval_s"], doc["max_interval_from"]) == (86400, None)             # the built-in 1d
    doc = json.loads(CliRunner().invoke(cli, ["policy", "show", "--partition", "auto", "--json"]).output)
    assert (doc["default_interval_s"], doc["max_interval_s"], doc["max_interval_from"]) == (-1, 3600, "partition auto")


# ---- in the agent ----------------------------------------------------------------------------------------------
def test_the_agent_plan_and_prepare_follow_the_policy(tmp_path: Path):
    from test_agent_logic import make_agent
    from slurmckpt.errors import PermissionDenied
    from slurmckpt.store.fresh_start import FailureReporter
    a = make_agent(tmp_path)
    a.facts.reporter = FailureReporter(a.facts.store, 43, "0.0", "n", annotate=lambda j, t: "none", background=False)
    a.facts.policy, a.plan.interval_s = policy().for_job(["debug"], None), 0
    a.tree.runner = fake_runner(root_pid=None, prepare=lambda epoch: {"prepared": epoch}, killed_for="")
    plan = a.plan.plan({}, [])
    assert plan["disabled"] == "checkpoints are not allowed in partition debug (site policy)"
    with pytest.raises(PermissionDenied, match="not allowed in partition debug"):
        a.epochs.prepare({"epoch": 1, "final": True, "trigger": "sigterm"}, [])
    a.facts.policy = policy().for_job(["low"], None)
    a.plan.interval_s = a.facts.policy.interval(60, explicit=True)
    assert a.plan.plan({}, [])["interval_s"] == 600 and "disabled" not in a.plan.plan({}, [])
    assert a.epochs.prepare({"epoch": 2, "final": False, "trigger": "interval"}, []) == {"prepared": 2}
    import time
    a.epochs.last_periodic = time.monotonic() - 30
    with pytest.raises(PermissionDenied, match="below the minimum interval 10m of partition low"):
        a.epochs.prepare({"epoch": 3, "final": False, "trigger": "manual"}, [])
    assert a.epochs.prepare({"epoch": 4, "final": True, "trigger": "sigterm"}, []) == {"prepared": 4}
