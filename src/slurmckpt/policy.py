"""Site policy per partition and per QOS (docs/operations.md, "Policy"): whether checkpoints are allowed, the
default and the minimum interval, the longest interval `auto` may choose, and per-job values of config
settings (keep_epochs, compression, the inputs of `auto`).

The config's `policy:` section:

    policy:
      default:    {min_interval: 1m}
      partitions: {debug: {allowed: false}, low: {default_interval: 30m, min_interval: 10m, keep_epochs: 3}}
      qos:        {long: {min_interval: 1h}}

For a job in partition P with QOS Q: limits take the strictest of default, P and Q (`allowed: false`
anywhere wins, the largest `min_interval` and the smallest `max_interval` count); defaults and settings take the most specific entry (QOS,
then partition, then default), as a Slurm QOS's limits override its partition's.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping

from slurmckpt.duration import AUTO, MIN_INTERVAL_S, format_duration, format_interval, parse_duration, parse_interval
from slurmckpt.errors import ConfigError

RULE_DOCS = {
    "allowed": "false: no checkpoints for jobs here; an explicit --checkpoint-interval is refused at submission and "
               "a job wrapped by the plugin's default_interval= runs without them.",
    "default_interval": "The interval of jobs that give no --checkpoint-interval (replaces the plugin's "
                        "default_interval=, which must be on for the plugin to wrap such jobs); off turns it off, "
                        "auto lets slurmckpt choose it (see max_interval).",
    "min_interval": "The shortest interval: a shorter --checkpoint-interval is refused at submission, raised to it "
                    "in running jobs, and the agents refuse periodic captures that come sooner. auto never "
                    "chooses less.",
    "max_interval": "The longest interval --checkpoint-interval=auto chooses (default 1d); fixed intervals are the "
                    "user's to choose. auto picks Daly's interval from the median stall of the job's recent "
                    "captures and the partition's mean time between interruptions (docs/operations.md, "
                    "\"Automatic interval\"), within min_interval and max_interval.",
}
AUTO_MAX_DEFAULT_S = 86400                    # max_interval where no entry sets one
RULE_KEYS = tuple(RULE_DOCS)
# Config keys a policy entry may set for the jobs it covers (each only where Config has it).
SETTING_KEYS = ("keep_epochs", "compression", "auto_first_interval", "interruption_mtbi")

Coerce = Callable[[str, object], object]      # (config key, raw value) -> checked value; raises ConfigError


@dataclass(frozen=True)
class Rule:
    """One entry: `default`, `partition NAME` or `QOS NAME`. None: the entry does not say."""
    name: str
    allowed: bool | None = None
    default_interval: int | None = None       # seconds, 0 = off, duration.AUTO
    min_interval: int | None = None           # seconds
    max_interval: int | None = None           # seconds: the longest interval auto chooses
    settings: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def parse(cls, name: str, where: str, raw: object, coerce: Coerce, settings_known: Iterable[str]) -> Rule:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping of policy keys, got {raw!r}")
        known = set(RULE_KEYS) | set(settings_known)
        values: dict[str, object] = {}
        settings: dict[str, object] = {}
        for key, value in raw.items():
            if key not in known:
                raise ConfigError(f"{where}: unknown key '{key}' (known: {', '.join(sorted(known))})")
            if key == "allowed":
                if not isinstance(value, bool):
                    raise ConfigError(f"{where}.allowed: bad value {value!r}: want true or false")
                values[key] = value
            elif key in ("default_interval", "min_interval", "max_interval"):
                values[key] = _seconds(f"{where}.{key}", value, key == "default_interval")
            else:
                try:
                    settings[key] = coerce(key, value)
                except ConfigError as e:
                    raise ConfigError(f"{where}.{key}: {str(e).split(': ', 2)[-1]}") from e
        rule = cls(name, settings=settings, **values)  # type: ignore[arg-type]  # values were coerced per key above
        for key in ("min_interval", "max_interval"):
            if getattr(rule, key) == 0:
                raise ConfigError(f"{where}.{key}: 'off' is no {key[:3]}imum; leave the key out instead")
        if rule.min_interval and rule.max_interval and rule.max_interval < rule.min_interval:
            raise ConfigError(f"{where}: max_interval {format_duration(rule.max_interval)} is below its own "
                              f"min_interval {format_duration(rule.min_interval)}")
        if rule.default_interval and rule.default_interval != AUTO and rule.min_interval and \
                rule.default_interval < rule.min_interval:
            raise ConfigError(f"{where}: default_interval {format_duration(rule.default_interval)} is below its "
                              f"own min_interval {format_duration(rule.min_interval)}")
        return rule


def _seconds(where: str, value: object, auto: bool = False) -> int:
    """A duration; with `auto`, also auto (an interval: duration.parse_interval)."""
    if value is False:              # YAML reads a bare `off` as false
        return 0
    try:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ValueError("x: want a duration: off, N (minutes), 90s, 30m, 1h30m, MM:SS or HH:MM:SS")
        return (parse_interval if auto else parse_duration)(str(value).strip())
    except ValueError as e:
        reason = str(e).split(": ", 1)[-1]
        raise ConfigError(f"{where}: bad value {value!r}: {reason}") from e


@dataclass(frozen=True)
class JobPolicy:
    """What the policy says for one job (or, at submission, for every partition it may run in)."""
    allowed: bool = True
    denied_by: str = ""                   # the entry that forbids checkpoints
    denied_why: str = ""                  # set by what the node forbids (refused_by); "": the site policy's words
    min_interval: int = 0                 # seconds; 0: only the plugin's own minimum (10 s)
    min_from: str = ""
    max_interval: int = AUTO_MAX_DEFAULT_S   # seconds: the longest interval auto chooses
    max_from: str = ""                    # "": the built-in AUTO_MAX_DEFAULT_S
    default_interval: int | None = None   # for jobs that gave no --checkpoint-interval; None: the plugin's
    default_from: str = ""
    settings: Mapping[str, object] = field(default_factory=dict)

    def refused_by(self, rule: str, why: str) -> JobPolicy:
        """This policy with every capture refused for a reason the node sets, not the site policy (a job's own
        namespaces: slurm/namespaces.py): the task runs without checkpoints and says why."""
        return replace(self, allowed=False, denied_by=rule, denied_why=why)

    def refusal(self, seconds: int) -> str | None:
        """Why an explicit `--checkpoint-interval` of `seconds` is refused here, naming the option; None if
        it is fine (0, i.e. off, always is)."""
        if seconds == 0:
            return None
        if not self.allowed:
            return (f"--checkpoint-interval={format_interval(seconds)}: checkpoints are not allowed in "
                    f"{self.denied_by} (site policy)")
        if seconds != AUTO and seconds < self.min_interval:
            return (f"--checkpoint-interval={format_duration(seconds)}: below the minimum "
                    f"{format_duration(self.min_interval)} of {self.min_from} (site policy)")
        return None

    def interval(self, seconds: int, explicit: bool) -> int:
        """The interval a running task uses: the policy's default where the user gave none, never below
        the minimum, 0 where checkpoints are not allowed; AUTO stays AUTO (auto_bounds bound it)."""
        if not self.allowed:
            return 0
        if not explicit and self.default_interval is not None:
            seconds = self.default_interval
        if seconds == AUTO:
            return AUTO
        return max(seconds, self.min_interval) if seconds else 0

    def auto_bounds(self) -> tuple[int, int]:
        """(shortest, longest) interval auto may choose: min_interval (at least the plugin's 10 s) and
        max_interval, never below the shortest (the agents enforce the minimum)."""
        low = max(MIN_INTERVAL_S, self.min_interval)
        return low, max(low, self.max_interval)

    def capture_refusal(self, final: bool, since_last_s: float | None) -> tuple[str, str] | None:
        """(rule, why) when the agent refuses a capture: any capture of a job whose partition or QOS forbids
        checkpoints; a periodic one less than `min_interval` (1 s tolerance for the schedule's jitter)
        after the previous periodic capture's PREPARE. Final captures are never refused for their timing."""
        if not self.allowed:
            return self.denied_by, self.denied_why or f"checkpoints are not allowed in {self.denied_by} (site policy)"
        if not final and since_last_s is not None and since_last_s < self.min_interval - 1.0:
            return self.min_from, (f"a capture {since_last_s:.0f}s after the previous one is below the minimum "
                                   f"interval {format_duration(self.min_interval)} of {self.min_from} (site policy)")
        return None

    def describe(self) -> dict[str, object]:
        return {"allowed": self.allowed, "denied_by": self.denied_by or None,
                "min_interval_s": self.min_interval, "min_interval_from": self.min_from or None,
                "max_interval_s": self.max_interval, "max_interval_from": self.max_from or None,
                "default_interval_s": self.default_interval, "default_interval_from": self.default_from or None,
                "settings": dict(self.settings)}


@dataclass(frozen=True)
class Policy:
    default: Rule = field(default_factory=lambda: Rule("the site default"))
    partitions: Mapping[str, Rule] = field(default_factory=dict)
    qos: Mapping[str, Rule] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: object, source: str, coerce: Coerce, settings_known: Iterable[str]) -> Policy:
        where = f"{source}: policy"
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping with default, partitions, qos")
        extra = set(raw) - {"default", "partitions", "qos"}
        if extra:
            raise ConfigError(f"{where}: unknown key '{sorted(extra)[0]}' (known: default, partitions, qos)")
        known = [k for k in SETTING_KEYS if k in set(settings_known)]
        groups: dict[str, dict[str, Rule]] = {}
        for group, label in (("partitions", "partition"), ("qos", "QOS")):
            entries = raw.get(group) or {}
            if not isinstance(entries, dict):
                raise ConfigError(f"{where}.{group}: expected a mapping of {label} names to entries")
            groups[group] = {str(name): Rule.parse(f"{label} {name}", f"{where}.{group}.{name}", entry, coerce,
                                                   known) for name, entry in entries.items()}
        return cls(Rule.parse("the site default", f"{where}.default", raw.get("default"), coerce, known),
                   groups["partitions"], groups["qos"])

    def for_job(self, partitions: Iterable[str], qos: str | None) -> JobPolicy:
        """`partitions`: the job's partition, or at submission every partition it names (the strictest
        applies: the job may run in any of them)."""
        parts = [self.partitions[p] for p in partitions if p in self.partitions]
        qos_rule = [self.qos[qos]] if qos and qos in self.qos else []
        rules = [self.default, *parts, *qos_rule]          # most specific last
        denied = next((r for r in rules if r.allowed is False), None)
        mins = [r for r in rules if r.min_interval]
        strictest = max(mins, key=lambda r: r.min_interval or 0, default=None)
        maxes = [r for r in rules if r.max_interval]
        shortest = min(maxes, key=lambda r: r.max_interval or 0, default=None)
        default = next((r for r in reversed(rules) if r.default_interval is not None), None)
        settings: dict[str, object] = {}
        for rule in rules:
            settings.update(rule.settings)
        return JobPolicy(allowed=denied is None, denied_by=denied.name if denied else "",
                         min_interval=strictest.min_interval or 0 if strictest else 0,
                         min_from=strictest.name if strictest else "",
                         max_interval=shortest.max_interval or 0 if shortest else AUTO_MAX_DEFAULT_S,
                         max_from=shortest.name if shortest else "",
                         default_interval=default.default_interval if default else None,
                         default_from=default.name if default else "", settings=settings)

    def __bool__(self) -> bool:
        empty = Rule(self.default.name)
        return bool(self.partitions or self.qos or self.default != empty)
