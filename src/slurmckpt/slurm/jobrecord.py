"""What the root side takes from slurmctld about a job, read from Slurm's structured answer (`squeue --json`,
run by slurm/control.py) by the trusted job id, never from text the job's user wrote.

The one-line `scontrol show job -d -o` holds the job's name, directories, output paths and command as the
user typed them, unquoted: a job named `x Partition=open QOS=free Restarts=7` run from a directory named
`x Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:8(IDX:0-7)` made a regex over that line read the partition, QOS,
restart count and GPUs the user chose. In JSON every value is its own typed field; the strings read here
(partition, QOS, node names, GRES details) are written by slurmctld from the admin's configuration.

Shapes, read in SchedMD's source (tags slurm-22-05-8-1, slurm-24-11-7-1, slurm-26-05-3-1) and on the
clusters (docs/slurm-versions.md, "Job facts"):
- 22.05 (openapi/v0.0.38): `job_state` a string; `submit_time` an integer; `job_resources` =
  {"nodes": "node[1-2]", "allocated_nodes": [{"nodename": "node1", ...}, ...]}.
- 24.11 (data_parser v0.0.42), 25.11 and 26.05 (v0.0.44, v0.0.45): `job_state` a list (base state first,
  then flags); `submit_time` = {"set": true, "infinite": false, "number": N}; `job_resources` =
  {"nodes": {"count": 2, "list": "node[1-2]", "allocation": [{"index": 0, "name": "node1", ...}, ...]}}.
- All: `gres_detail` one string per allocated node, in the order of the job's node list (the i-th string
  is the i-th node of `job_resources`, as `scontrol show job -d` pairs them): `gpu:1(IDX:0)`,
  `gpu:a100:2(IDX:0-1)`, `gpu:a100:1(IDX:0),gpu:v100:1(IDX:2)`; `restart_cnt`, `user_id`, `group_id`
  integers; `partition`, `qos` strings.
Anything of another type or out of bounds is an error (SlurmError), not a guess.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from slurmckpt.errors import SlurmError

MAX_ID = 0xFFFFFFFD            # uid, gid, job ids: below Slurm's NO_VAL/INFINITE markers
MAX_RESTARTS = 0xFFFF          # restart_cnt is a uint16 in every release
MAX_GPU_INDEX = 4095           # a node's GRES bitmap index; far above any real node
MAX_NODES = 100000


@dataclass(frozen=True)
class JobRecord:
    """The job as slurmctld knows it. `submit_time`: Slurm's SubmitTime (reset by every requeue) in local
    time as `scontrol` prints it (ISO 8601, sorts as text; instance.py compares bindings written before the
    JSON reading with it). `gpus`: node name -> the GPU indices (gres.conf File= order) allocated to the job
    there, every node of the job listed (no GPU: []). `nodes`: the job's nodes in Slurm's order."""
    job: int
    uid: int
    gid: int
    submit_time: str
    restarts: int
    state: str
    gpus: dict[str, list[int]]
    partition: str = ""         # where the job runs: the site policy's key (policy.py)
    qos: str = ""
    nodes: tuple[str, ...] = field(default=())


def _int(value: object, what: str, hi: int, job: int | None = None) -> int:
    if type(value) is not int or not 0 <= value <= hi:        # bool is not an int here
        raise SlurmError(f"Slurm's JSON has no valid {what} ({value!r:.40})", job=job)
    return value


def _text(value: object, what: str, job: int | None = None) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > 4096:
        raise SlurmError(f"Slurm's JSON has no valid {what} ({value!r:.40})", job=job)
    return value


def jobs_of(doc: object) -> list[dict[str, Any]]:
    """The `jobs` of a `squeue --json` / `scontrol show job --json` answer. Slurm 22.05's squeue exits 0
    when slurmctld did not answer and says so only in `errors`: any error there fails the call."""
    if not isinstance(doc, dict):
        raise SlurmError("Slurm's JSON answer is not an object")
    errors = doc.get("errors") or []
    if errors:
        first = errors[0] if isinstance(errors, list) else errors
        raise SlurmError(f"Slurm answered with errors: {str(first)[:300]}")
    jobs = doc.get("jobs")
    if not isinstance(jobs, list) or not all(isinstance(j, dict) for j in jobs):
        raise SlurmError("Slurm's JSON answer has no list of jobs")
    return jobs


def job_entry(doc: object, job_id: int) -> dict[str, Any]:
    """The one entry of `doc` for `job_id` (22.05's squeue --json lists every job, whatever -j says)."""
    found = [j for j in jobs_of(doc) if type(j.get("job_id")) is int and j["job_id"] == job_id]
    if len(found) != 1:
        raise SlurmError(f"Slurm's answer holds {len(found)} records of the job", job=job_id)
    return found[0]


def state_words(value: object) -> tuple[str, ...]:
    """22.05: "RUNNING"; 23.02 and later: ["PENDING", "REQUEUED"] (the base state, then its flags)."""
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.isupper() for w in words):
        raise SlurmError(f"Slurm's JSON has no valid job state ({value!r:.60})")
    return tuple(words)


def _timestamp(value: object, job: int) -> int:
    if isinstance(value, dict):              # 23.02+: {"set": true, "infinite": false, "number": N}
        if value.get("set") is not True or value.get("infinite") is not False:
            raise SlurmError("Slurm's JSON has no submit time", job=job)
        value = value.get("number")
    return _int(value, "submit time", 2**40, job)


def preempted(entry: dict[str, Any]) -> bool:
    """slurmctld set the job's preempt_time (22.05: an integer; 23.02+: {"set", "infinite", "number"}) at or
    after its current run's start: the run is being preempted. A malformed field reads as not preempted (the
    shorter window)."""
    def stamp(value: object) -> int:
        if isinstance(value, dict):
            value = value.get("number") if value.get("set") is True and value.get("infinite") is not True else 0
        return value if type(value) is int and 0 <= value < 2**40 else 0
    when = stamp(entry.get("preempt_time"))
    return when > 0 and when >= stamp(entry.get("start_time"))


def iso_local(stamp: int) -> str:
    """A UNIX time as `scontrol` prints it (local time, %Y-%m-%dT%H:%M:%S: its default without
    SLURM_TIME_FORMAT, which the agent's fixed environment never has)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(stamp))


_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _node_names(resources: object, job: int) -> list[str]:
    """The job's nodes in Slurm's order: the per-node list where Slurm gives one, else its hostlist."""
    if resources is None or resources == {}:
        return []                       # pending: nothing allocated yet
    if not isinstance(resources, dict):
        raise SlurmError("Slurm's JSON has no valid job_resources", job=job)
    nodes = resources.get("nodes")
    if isinstance(nodes, dict):                                     # 23.02+
        listed = nodes.get("allocation") or []
        if not isinstance(listed, list) or not all(isinstance(n, dict) for n in listed):
            raise SlurmError("Slurm's JSON has no valid node allocation", job=job)
        names = [n.get("name") for n in sorted(listed, key=lambda n: _int(n.get("index"), "node index",
                                                                          MAX_NODES, job))]
        hostlist = nodes.get("list")
    else:                                                           # 22.05
        listed = resources.get("allocated_nodes") or []
        if not isinstance(listed, list) or not all(isinstance(n, dict) for n in listed):
            raise SlurmError("Slurm's JSON has no valid allocated_nodes", job=job)
        names = [n.get("nodename") for n in listed]
        hostlist = nodes
    if not names and hostlist:
        names = expand_hostlist(_text(hostlist, "node list", job))
    if len(names) > MAX_NODES or not all(isinstance(n, str) and _NODE_NAME.fullmatch(n) for n in names):
        raise SlurmError(f"Slurm's JSON names a node that is not a node name ({names!r:.80})", job=job)
    if len(set(names)) != len(names):
        raise SlurmError("Slurm's JSON lists a node twice", job=job)
    return names


# A node's GRES detail as slurmctld writes it (gres_ctld_job_build_details / gres_stepmgr_job_build_details):
# entries `name[:type]:count(IDX:bitmap)` joined by ','; shared GRES (shard, mps) carry other text in the
# parentheses, GRES without device files none at all. Only slurmctld and gres.conf write any of it.
_ENTRY = re.compile(r"([A-Za-z0-9_]+)((?::[A-Za-z0-9_.-]+)*):(\d+)(?:\(([^()]*)\))?(?:,|$)")
_INDICES = re.compile(r"\d{1,4}(?:-\d{1,4})?(?:,\d{1,4}(?:-\d{1,4})?)*")


def gpu_indices(detail: str, job: int | None = None) -> list[int]:
    """`gpu:a100:1(IDX:0),gpu:v100:2(IDX:2-3)` -> [0, 2, 3]; "" -> []. A detail that does not parse, or a
    GPU entry without numeric indices (`IDX:N/A`), is an error: the node's GPUs cannot be told."""
    out: set[int] = set()
    pos = 0
    while pos < len(detail):
        m = _ENTRY.match(detail, pos)
        if not m or m.end() == pos:
            raise SlurmError(f"GRES detail {detail[:80]!r} does not parse", job=job)
        pos = m.end()
        if m.group(1) != "gpu":
            continue
        idx = (m.group(4) or "").removeprefix("IDX:") if (m.group(4) or "").startswith("IDX:") else None
        if idx is None or not _INDICES.fullmatch(idx):
            raise SlurmError(f"GRES detail {detail[:80]!r} has no GPU indices", job=job)
        out.update(parse_indices(idx))
    if any(i > MAX_GPU_INDEX for i in out) or detail.endswith(","):
        raise SlurmError(f"GRES detail {detail[:80]!r} does not parse", job=job)
    return sorted(out)


def node_gpus(entry: dict[str, Any], job: int) -> tuple[list[str], dict[str, list[int]]]:
    nodes = _node_names(entry.get("job_resources"), job)
    details = entry.get("gres_detail") or []
    if not isinstance(details, list) or not all(isinstance(d, str) for d in details):
        raise SlurmError("Slurm's JSON has no valid gres_detail", job=job)
    if details and len(details) != len(nodes):
        raise SlurmError(f"Slurm's JSON pairs {len(details)} GRES details with {len(nodes)} nodes", job=job)
    return nodes, {node: gpu_indices(details[i], job) if details else [] for i, node in enumerate(nodes)}


def parse_record(entry: dict[str, Any], job_id: int) -> JobRecord:
    """One job of a `--json` answer (job_entry) -> its record; SlurmError if any field is missing, of
    another type or out of bounds."""
    if type(entry.get("job_id")) is not int or entry["job_id"] != job_id:
        raise SlurmError(f"Slurm answered for job {entry.get('job_id')!r:.20}", job=job_id)
    nodes, gpus = node_gpus(entry, job_id)
    return JobRecord(job_id, _int(entry.get("user_id"), "user_id", MAX_ID, job_id),
                     _int(entry.get("group_id"), "group_id", MAX_ID, job_id),
                     iso_local(_timestamp(entry.get("submit_time"), job_id)),
                     _int(entry.get("restart_cnt"), "restart_cnt", MAX_RESTARTS, job_id),
                     state_words(entry.get("job_state"))[0], gpus,
                     _text(entry.get("partition"), "partition", job_id), _text(entry.get("qos"), "qos", job_id),
                     tuple(nodes))


def expand_hostlist(expr: str) -> list[str]:
    """node[1-3,5],gpu7 -> node1 node2 node3 node5 gpu7 (Slurm's hostlist syntax, one bracket per name)."""
    out: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)", expr):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not prefix:
            continue
        if ranges is None:
            out.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{i:0{width}d}{suffix}")
    return out


def parse_indices(text: str) -> list[int]:
    """0-1,3 -> [0, 1, 3]"""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out
