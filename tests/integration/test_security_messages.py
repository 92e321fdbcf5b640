"""Messages and exposure: a job's own (malicious) wrapper sends the real root agent non-finite, huge and
malformed values; another user (ckptuser2) attacks a running job's coordinator from the same node; the CLI
is given array-task ids and another user's job. Each test asserts the effect that must not happen."""
from __future__ import annotations

import json
import pwd
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.slurmjob import WORK_ROOT, job_field, run, site_config, submit, workdir
from tests.integration.test_security import _agent_and_attacker

STORE = Path("/var/lib/slurmckpt/images")
SLURMCKPT = "/opt/slurmckpt/venv/bin/slurmckpt"
PY = sys.executable

# Attack-side helpers (run as the attacking user, inside _agent_and_attacker's code): a raw frame, written
# byte for byte (Channel.send itself refuses NaN), and the time the agent took to answer it.
RAW = """
import struct, time
ch.sock.settimeout(10)     # an agent that waits on a hostile value fails the test, not hangs it
def raw(name, body):
    t0 = time.monotonic()
    try:
        ch.sock.sendall(struct.pack("!I", len(body)) + body)
        reply, fds = ch.recv()
        results.append([name, reply.get("error_type", "ok"), round(time.monotonic() - t0, 2)])
    except Exception as e:
        results.append([name, type(e).__name__, round(time.monotonic() - t0, 2)])
"""


def test_agent_refuses_non_finite_huge_and_malformed_values() -> None:
    attack = RAW + """
attempt("plan before", "plan")
t0 = time.monotonic()
attempt("huge wait_s", "lookup_coordinator", scope="job", wait_s=1e300)
attempt("negative wait_s", "lookup_coordinator", scope="job", wait_s=-1e300)
attempt("string wait_s", "lookup_coordinator", scope="job", wait_s="NaN")
attempt("bool wait_s", "lookup_coordinator", scope="job", wait_s=True)
results.append(["lookups took", "ok", round(time.monotonic() - t0, 2)])
attempt("traversal rank name", "commit", epoch=1, ranks={"../../../../../../tmp/x.0": {"kind": "completed",
        "exit_code": 0}}, reason="interval")
attempt("slash in rank name", "commit", epoch=1, ranks={"batch.0/../../x": {"kind": "completed", "exit_code": 0}},
        reason="interval")
attempt("leading zero rank", "commit", epoch=1, ranks={"batch.00": {"kind": "completed", "exit_code": 0}},
        reason="interval")
attempt("record overrides epoch", "commit", epoch=1, ranks={"batch.0": {"kind": "completed", "exit_code": 0,
        "epoch": 999}}, reason="interval")
attempt("escape in reason", "commit", epoch=1, ranks={"batch.0": {"kind": "completed", "exit_code": 0}},
        reason="\\x1b]0;pwned\\x07")
attempt("float epoch", "prepare", epoch=1.0)
attempt("huge epoch", "prepare", epoch=10**30)
attempt("string final", "capture", epoch=1, final="no")
attempt("reject huge reason", "reject_epoch", epoch=1, reason="x" * 100000)
attempt("publish wildcard host", "publish_coordinator", scope="job", host="0.0.0.0", port=1, token="ab" * 32)
attempt("publish float port", "publish_coordinator", scope="job", host="127.0.0.1", port=22.5, token="ab" * 32)
attempt("publish bad token", "publish_coordinator", scope="job", host="127.0.0.1", port=22, token="../x")
attempt("batch scope", "lookup_coordinator", scope="batch")
attempt("plan after", "plan")
raw("NaN wait_s frame", b'{"op":"lookup_coordinator","scope":"job","wait_s":NaN}')
"""
    results = {name: (kind, detail) for name, kind, detail in
               _agent_and_attacker("ckptuser1", "ckptuser1", attack)}
    assert results["plan before"][0] == "ok"
    for name in ("huge wait_s", "negative wait_s", "string wait_s", "bool wait_s"):
        assert results[name][0] == "ProtocolError" and "wait_s" in results[name][1], (name, results[name])
    assert results["lookups took"][1] < 5, "the agent waited on a value it should have refused"
    for name in ("traversal rank name", "slash in rank name", "leading zero rank", "record overrides epoch",
                 "escape in reason", "float epoch", "huge epoch", "string final", "reject huge reason",
                 "publish wildcard host", "publish float port", "publish bad token", "batch scope"):
        assert results[name][0] == "ProtocolError", (name, results[name])
    assert results["plan after"][0] == "ok"
    assert results["plan after"][1].get("newest") == results["plan before"][1].get("newest"), "an attack committed"
    # the old parse, min(float(NaN), 120), is a deadline never reached: the agent must answer at once
    kind, seconds = results["NaN wait_s frame"]
    assert kind == "ProtocolError" and seconds < 5, results["NaN wait_s frame"]


def test_agent_answers_infinity_and_deep_nesting_frames_at_once() -> None:
    frames = [r"""b'{"op":"lookup_coordinator","scope":"job","wait_s":Infinity}'""",   # built there:
              r"""b'[' * 1_000_000""",                                                # argv is bounded
              r"""b'{"op":"prepare","epoch":' + b'9' * 100_000 + b'}'"""]
    for body in frames:
        # hello first: the agent is up (its start-up is not what is timed)
        code = RAW + f"attempt('up', 'hello')\nraw('frame', {body})"
        results = _agent_and_attacker("ckptuser1", "ckptuser1", code)
        assert results[0][1] == "ok", results
        assert results[1][1] == "ProtocolError" and results[1][2] < 5, (body[:40], results)


def test_a_final_prepare_does_not_license_a_periodic_capture() -> None:
    """Under a site minimum interval of 1 h the job's own (malicious) wrapper, after one periodic capture,
    is refused a second periodic PREPARE; it then sends a "final" PREPARE (final captures are never refused
    for their timing) and a periodic CAPTURE, which the old agent ran: a periodic capture, the tree running
    on, as often as it liked. The real agent refuses that CAPTURE."""
    attack = """
import tempfile
out, _ = tempfile.mkstemp()      # the wrapper's stdout, which a capture snapshots, is a file of the user's
os.dup2(out, 1)
os.dup2(out, 2)
r, w = os.pipe()
attempt("launch", "launch", [0, w, w], argv=["sleep", "120"], env={"PATH": "/usr/bin:/bin"}, cwd="/tmp")
os.close(w)
e = [ch.call("allocate_epoch")["epoch"] for _ in range(2)]
attempt("prepare periodic", "prepare", epoch=e[0], final=False, trigger="interval")
attempt("capture periodic", "capture", epoch=e[0], final=False)
attempt("resume", "resume", epoch=e[0])
attempt("second periodic prepare", "prepare", epoch=e[1], final=False, trigger="manual")
attempt("final prepare", "prepare", epoch=e[1], final=True, trigger="sigterm")
attempt("periodic capture after it", "capture", epoch=e[1], final=False)
attempt("abort", "abort", epoch=e[1])
"""
    with site_config("policy:\n  default: {min_interval: 1h}\n"):
        results = {name: (kind, detail) for name, kind, detail in
                   _agent_and_attacker("ckptuser1", "ckptuser1", attack)}
    assert results["launch"][0] == "ok" and results["capture periodic"][0] == "ok", results
    assert results["second periodic prepare"][0] == "PermissionDenied", results      # the policy holds
    assert results["final prepare"][0] == "ok", results
    kind, detail = results["periodic capture after it"]
    assert kind == "ProtocolError" and "its PREPARE said final=True" in detail, \
        f"a final PREPARE let a periodic capture through: {results['periodic capture after it']}"


# ---- another user against a running job's coordinator ------------------------------------------------------
COORDINATOR_ATTACK = r"""
import hashlib, hmac, json, os, secrets, socket, sys, time
host, port, node_addr = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out = {"uid": os.getuid()}

def conn():
    s = socket.create_connection((host, port), timeout=15)
    f = s.makefile("rb")
    first = json.loads(f.readline())
    return s, f, first["nonce"]

def answered(s, f):
    # what the coordinator sends after our attempt: b"" (closed) is the only acceptable answer
    try:
        s.settimeout(15)
        return f.readline().decode(errors="replace")
    except OSError as e:
        return "error:" + type(e).__name__

def mac(key, nonce, data):
    return hmac.new(key, nonce.encode() + data, hashlib.sha256).hexdigest().encode()

def attempt(name, line_of_nonce):
    s, f, nonce = conn()
    try:
        s.sendall(line_of_nonce(nonce))
    except OSError:
        pass
    out[name] = answered(s, f)
    s.close()

hello = lambda **kw: json.dumps({"type": "hello", "rank": "batch.0", "node": "x", "interval": 1, "v": 1,
                                 "seq": 1, **kw}, separators=(",", ":")).encode()
forged = secrets.token_bytes(32)
attempt("garbage", lambda n: b"hello coordinator\n")
attempt("forged hmac hello", lambda n: mac(forged, n, hello()) + b" " + hello() + b"\n")
attempt("zero mac hello", lambda n: b"0" * 64 + b" " + hello() + b"\n")
attempt("nan hello", lambda n: b"0" * 64 + b' {"type":"hello","interval":NaN,"v":1,"seq":1}\n')
attempt("deep nesting", lambda n: b"[" * 60000 + b"\n")
attempt("oversized line", lambda n: b"x" * 200000 + b"\n")
for kind in ("trigger", "capture", "commit", "abort", "exited"):
    body = json.dumps({"type": kind, "reason": "pwned-by-ckptuser2", "final": True, "epoch": 1, "v": 1,
                       "seq": 1}).encode()
    attempt("forged " + kind, lambda n, body=body: mac(forged, n, body) + b" " + body + b"\n")
# the node's own address: a single-node job's coordinator listens on loopback only
try:
    socket.create_connection((node_addr, port), timeout=5).close()
    out["node address"] = "connected"
except OSError as e:
    out["node address"] = type(e).__name__
# many idle connections: each is closed within a few seconds without ever being welcomed
idle = []
for _ in range(300):
    try:
        idle.append(conn())
    except OSError as e:
        out.setdefault("idle connect errors", []).append(type(e).__name__)
t0 = time.monotonic()
closed, welcomed = 0, 0
for s, f, _ in idle:
    line = answered(s, f)
    closed += line == ""
    welcomed += "welcome" in line
out["idle"] = {"opened": len(idle), "closed": closed, "welcomed": welcomed,
               "seconds": round(time.monotonic() - t0, 1)}
for s, f, _ in idle:
    s.close()
print(json.dumps(out))
"""


def _coordinator_address(job_id: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in STORE.glob(f"*/{job_id}/coordinator-job.json"):
            return json.loads(path.read_text())
        time.sleep(1)
    raise AssertionError(f"job {job_id}: no coordinator file in the store")


def _commits(job) -> int:
    return len(re.findall(r"committed \(interval\)", job.text()))


def test_another_user_cannot_join_drive_or_crash_a_jobs_coordinator() -> None:
    wd = workdir("ckptuser1", "coord-attack")
    job = submit("ckptuser1", wd, "#!/bin/bash\nsleep 400\n", "--checkpoint-interval=10s")
    try:
        job.wait_output(r"committed \(interval\)", timeout=120)
        address = _coordinator_address(job.id)               # read as root: ckptuser2 cannot read the store
        node = job_field(job.id, "BatchHost") or job_field(job.id, "NodeList")
        node_addr = run("scontrol", "show", "node", node).stdout.split("NodeAddr=")[1].split()[0]
        assert address["host"] == "127.0.0.1", address         # a one-node job: loopback
        listening = run("ip", "netns", "exec", node, "ss", "-Hltn", f"sport = :{address['port']}").stdout
        local = [line.split()[3] for line in listening.splitlines() if line.strip()]
        assert local == [f"127.0.0.1:{address['port']}"], listening        # not 0.0.0.0 / [::]
        before = _commits(job)
        attack = WORK_ROOT / "ckptuser2" / "coord_attack.py"
        attack.write_text(COORDINATOR_ATTACK)
        attack.chmod(0o644)
        p = run("ip", "netns", "exec", node, "runuser", "-u", "ckptuser2", "--", PY, str(attack),
                address["host"], str(address["port"]), node_addr, timeout=120)
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["uid"] != 0
        for name, answer in out.items():
            if name.startswith(("garbage", "forged", "zero", "nan", "deep", "oversized")):
                assert answer == "", f"{name}: the coordinator answered {answer!r} instead of closing"
        assert out["node address"] != "connected", "the coordinator listens beyond loopback"
        idle = out["idle"]
        assert idle["opened"] >= 250 and idle["welcomed"] == 0
        assert idle["closed"] == idle["opened"], f"idle connections were kept open: {idle}"
        assert idle["seconds"] < 15, f"idle connections were held too long: {idle}"
        # the job runs on and still commits its next interval checkpoint, with the same coordinator
        job.wait_for(lambda: _commits(job) > before + 1, "an interval commit after the attack", timeout=90)
        assert job.state() == "RUNNING"
        text = job.text()
        assert "coordinator died" not in text and "pwned" not in text, text[-2000:]
        manifest = json.loads(next(STORE.glob(f"*/{job.id}/manifest.json")).read_text())
        assert all(e["reason"] == "interval" for e in manifest["epochs"]), manifest["epochs"]
        assert _coordinator_address(job.id)["port"] == address["port"], "the coordinator was restarted"
    finally:
        run("scancel", str(job.id), check=False)


RELAY_ATTACK = r"""
import json, os, socket, sys, time
from slurmckpt.channel import Channel
name, marker = sys.argv[1], sys.argv[2]
out = {"uid": os.getuid()}
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(name)
    out["connected"] = True
except OSError as e:
    out["connected"] = str(e)
if out["connected"] is True:
    mine, _ = socket.socketpair()
    t0 = time.monotonic()
    try:
        # a well-formed request, as the stand-in sends it: run `touch MARKER` as a step of the job, with our
        # stdio; a relay that closes first makes the send fail (EPIPE), one that closes after it the recv
        Channel(s).send({"argv": ["srun", "touch", marker], "env": {"PATH": "/usr/bin:/bin"}, "cwd": "/tmp"},
                        [0, 1, 2, mine.fileno()])
        out["answer"] = s.recv(4096).decode(errors="replace") or "closed"
    except (BrokenPipeError, ConnectionResetError):
        out["answer"] = "closed"
    except OSError as e:
        out["answer"] = type(e).__name__
    out["seconds"] = round(time.monotonic() - t0, 2)
print(json.dumps(out))
"""


def _relay_attack(node: str, user: str, name: str, marker: Path) -> dict:
    attack = WORK_ROOT / user / "relay_attack.py"
    attack.write_text(RELAY_ATTACK)
    attack.chmod(0o644)
    p = run("ip", "netns", "exec", node, "runuser", "-u", user, "--", PY, str(attack), name, str(marker),
            timeout=60)
    return json.loads(p.stdout.strip().splitlines()[-1])


# ckptuser2 takes, before ckptuser1's next jobs start, every name their relays could have: the abstract names
# the relays used to have (anyone in the node's network namespace may bind a free one) and the socket paths
# they have now; then holds them while those jobs run.
SQUAT = r"""
import json, os, socket, sys, time
out, held = {"uid": os.getuid(), "abstract": [], "paths": []}, []
for name in json.loads(sys.argv[1]):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind("\0" + name); s.listen(1); held.append(s); out["abstract"].append("bound")
    except OSError as e:
        out["abstract"].append(type(e).__name__)
for path in json.loads(sys.argv[2]):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        s.bind(path); s.listen(1); held.append(s); out["paths"].append("bound")
    except OSError as e:
        out["paths"].append(type(e).__name__)
print(json.dumps(out), flush=True)
time.sleep(300)
"""
RELAY_CHECK = r"""
import os, sys
from slurmckpt.task.srun_standin import connect
path = os.environ.get("SLURMCKPT_SRUN_RELAY", "")
try:
    connect(path).close()
    print(f"relay-check {sys.argv[1]} served at {path}", flush=True)
except Exception as e:
    print(f"relay-check {sys.argv[1]} FAILED at {path!r}: {e}", flush=True)
"""


def test_another_user_can_neither_take_nor_reach_a_jobs_srun_relay() -> None:
    """ckptuser2 squats, before ckptuser1's job starts, the relay names of its next job ids: the old
    abstract names (which it gets: anyone may bind them; the job's relay then could not start and a
    requeued MPI job started from the beginning) and the socket paths (refused: the directory is
    ckptuser1's, 0700, in root's). The job's relay is served, by ckptuser1, at the same path before and
    after a requeue (the restored batch script's environment names it); ckptuser2 cannot connect there,
    so its well-formed request runs no step, while the same request from the job's own user does."""
    uid = pwd.getpwnam("ckptuser1").pw_uid
    node = "node1"
    nxt = int(re.search(r"NEXT_JOB_ID\s*=\s*(\d+)", run("scontrol", "show", "config").stdout).group(1))
    ids = range(nxt, nxt + 3)
    squat_py = WORK_ROOT / "ckptuser2" / "relay_squat.py"
    squat_py.parent.mkdir(parents=True, exist_ok=True)
    squat_py.write_text(SQUAT)
    squat_py.chmod(0o644)
    squatter = subprocess.Popen(
        ["ip", "netns", "exec", node, "runuser", "-u", "ckptuser2", "--", PY, str(squat_py),
         json.dumps([f"slurmckpt-srun-{i}-{uid}" for i in ids]),
         json.dumps([f"/run/slurmckpt/srun-relay/{uid}/{i}" for i in ids])], stdout=subprocess.PIPE, text=True)
    wd = workdir("ckptuser1", "relay-attack")
    (wd / "relay_check.py").write_text(RELAY_CHECK)
    job = None
    try:
        squatted = json.loads(squatter.stdout.readline())
        assert squatted["uid"] == pwd.getpwnam("ckptuser2").pw_uid
        assert squatted["abstract"] == ["bound"] * 3, f"the old names could not be squatted: {squatted}"
        assert squatted["paths"] == ["PermissionError"] * 3, f"another user took a relay path: {squatted}"
        job = submit("ckptuser1", wd, "#!/bin/bash\nfor i in $(seq 1 300); do\n"
                     f"  {PY} relay_check.py $i\n  sleep 1\ndone\n", "-w", node, "--checkpoint-interval=10s")
        assert job.id in ids, f"job {job.id} is not one of the squatted ids {list(ids)}"
        path = f"/run/slurmckpt/srun-relay/{uid}/{job.id}"
        job.wait_output(r"relay-check \d+ served", timeout=120)
        assert f"served at {path}" in job.text(), job.text()
        marker = wd / "relay-attack-marker"          # ckptuser1's directory: only a step of the job writes it
        out = _relay_attack(node, "ckptuser2", path, marker)
        assert out["uid"] == pwd.getpwnam("ckptuser2").pw_uid
        assert "Permission denied" in str(out["connected"]), f"another user reached the relay: {out}"
        job.wait_output(r"committed \(interval\)", timeout=120)
        # the control: the job's own user is served (its step runs), so the refusal above was the directory
        own = _relay_attack(node, "ckptuser1", path, marker)
        assert own["connected"] is True and own["answer"] not in ("closed", "TimeoutError"), own
        job.wait_for(marker.exists, "the job's own user's srun step", timeout=60)
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", timeout=180)

        def after() -> str:
            return job.text().split("restored from checkpoint epoch", 1)[1]
        job.wait_for(lambda: re.search(r"relay-check \d+ (served|FAILED)", after()), "a relay check after the "
                     "restore", timeout=60)
        assert "FAILED" not in job.text() and f"served at {path}" in after(), job.text()
    finally:
        squatter.kill()
        squatter.wait()
        if job is not None:
            run("scancel", str(job.id), check=False)


# ---- the CLI -----------------------------------------------------------------------------------------------
def test_cli_resolves_array_tasks_and_refuses_bad_ids_and_other_users_jobs() -> None:
    wd = workdir("ckptuser1", "cli-array")
    array = submit("ckptuser1", wd, "#!/bin/bash\nsleep 600\n", "--array=0-3")
    own = submit("ckptuser1", wd, "#!/bin/bash\nsleep 120\n", "--checkpoint-interval=1h")
    try:
        task_id = index = None
        deadline = time.monotonic() + 120
        while task_id is None and time.monotonic() < deadline:   # a split-off task: its own id is not N
            for line in run("squeue", "-h", "-j", str(array.id), "-o", "%A|%K|%T", check=False).stdout.split():
                jid, k, state = (line.split("|") + ["", ""])[:3]
                if jid.isdigit() and k.isdigit() and jid != str(array.id) and state == "RUNNING":
                    task_id, index = int(jid), int(k)
                    break
            time.sleep(1)
        assert task_id is not None, "no array task started"
        spec = f"{array.id}_{index}"
        wrong = int(spec)                      # the job the old int() parse named
        assert wrong != task_id
        # the array task's own job id is named (it was not submitted with --checkpoint-interval: refused)
        p = run(SLURMCKPT, "checkpoint", spec, user="ckptuser1", check=False)
        assert p.returncode != 0 and f"job {task_id} " in p.stderr and str(wrong) not in p.stderr, p.stderr
        for bad in (f"{spec}_2", f"{array.id}x", f"{array.id}_", "-1", f" {own.id}"):
            p = run(SLURMCKPT, "checkpoint", "--", bad, user="ckptuser1", check=False)
            assert p.returncode == 2 and "is not a job id" in p.stderr, (bad, p.stderr)
        # another user's job: refused before any signal, even with --force
        own.wait_running()
        for args in (["checkpoint", str(own.id)], ["checkpoint", "--force", str(own.id)],
                     ["checkpoint", "--force", spec]):
            p = run(SLURMCKPT, *args, user="ckptuser2", check=False)
            assert p.returncode != 0 and "belongs to uid" in p.stderr, (args, p.stderr)
        time.sleep(2)
        assert "committed (manual" not in own.text(), own.text()
        assert own.state() == "RUNNING" and job_field(task_id, "JobState") == "RUNNING"
    finally:
        run("scancel", str(array.id), str(own.id), check=False)


def test_inspect_escapes_what_the_user_wrote() -> None:
    wd = workdir("ckptuser1", "inspect-escape")
    evil = "out-\x1b[2J\x1b]0;pwned\x07.txt"
    script = ("#!/bin/bash\n" f"exec 3>>'{wd}/{evil}'\n" "sleep 300\n")
    job = submit("ckptuser1", wd, script, "--checkpoint-interval=10s")
    try:
        job.wait_output(r"committed \(interval\)", timeout=120)
        p = run(SLURMCKPT, "inspect", str(job.id))
        assert "\x1b" not in p.stdout and "\x07" not in p.stdout, repr(p.stdout)
        assert "out-\\x1b[2J\\x1b]0;pwned\\x07.txt" in p.stdout, p.stdout      # shown, escaped
    finally:
        run("scancel", str(job.id), check=False)
