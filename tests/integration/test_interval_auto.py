"""--checkpoint-interval=auto on the real cluster (docs/operations.md, "Automatic interval"): the job starts with
auto_first_interval, re-chooses from the stall of its measured captures within the site's bounds, hears the
partition's history from accounting (the root agent's sacct), and `slurmckpt status` shows the choice and
its inputs to the job's user."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tests.integration.slurmjob import run, site_config, submit, workdir

CLI = "/opt/slurmckpt/venv/bin/slurmckpt"
USER = "ckptuser1"
NODE_CACHE = Path("/run/slurmckpt/interruptions")      # run_dir's default; every node of the cluster shares it
# M of the site 30 s until accounting answers: Daly's interval for any stall below ~3 s is then under the
# partition's minimum of 15 s, so the first measured choice is the minimum, named
SITE = ("auto_first_interval: 20s\ninterruption_mtbi: 30s\n"
        "policy:\n  partitions:\n    debug: {min_interval: 15s, max_interval: 40s}\n")


def test_auto_starts_with_the_first_interval_re_chooses_from_measured_captures_within_the_bounds() -> None:
    shutil.rmtree(NODE_CACHE, ignore_errors=True)     # no answer of an earlier run: accounting is asked anew
    wd = workdir(USER, "auto-interval")
    with site_config(SITE):
        job = submit(USER, wd, "#!/bin/bash\npython3 zdtm.py --steps 600 --sleep 0.2 --tag auto --data d.txt\n",
                     "-p", "debug", "-w", "node1", "--checkpoint-interval=auto")
        try:
            job.wait_output(r"checkpoint interval auto: 20s \(no capture measured yet\)", timeout=120)
            job.wait_output(r"committed \(interval\)", timeout=60)
            job.wait_output(r"checkpoint interval auto: 15s \(Daly: stall [\d.]+s \(median of 1 capture\(s\)\), "
                            r"MTBI 30s \(the site's interruption_mtbi until accounting answers\); min_interval 15s "
                            r"of partition debug\)", timeout=30)
            job.wait_output(r"committed \(interval\)", count=2, timeout=60)

            seen: dict = {}

            def heard_accounting() -> bool:
                rows = json.loads(run(CLI, "status", "--json", str(job.id), user=USER).stdout)
                seen["rec"] = (rows[0].get("summary") or {}).get("interval") or {}
                return seen["rec"].get("interruptions", {}).get("source") == "accounting"
            job.wait_for(heard_accounting, "the root agent's accounting answer in the job's status", timeout=60)
            rec = seen["rec"]
            told = rec["interruptions"]
            assert rec["basis"] == "daly" and (rec["min_s"], rec["max_s"]) == (15, 40), rec
            assert 15 <= rec["interval_s"] <= 40 and rec["stalls"] and all(0 < s < 15 for s in rec["stalls"]), rec
            assert told["partition"] == "debug" and told["runs"] >= 1 and told["prior_s"] == 30, told
            # M: the partition's node time and interruptions weighed with the site's 30 s
            assert abs(rec["mtbi_s"] - (told["node_s"] + 30) / (told["interruptions"] + 1)) < 1e-6 * rec["mtbi_s"]
            chosen = [int(n) for n in re.findall(r"checkpoint interval auto: (\d+)s", job.text())]
            assert chosen[:2] == [20, 15] and all(15 <= n <= 40 for n in chosen), chosen
            text = run(CLI, "status", str(job.id), user=USER).stdout
            assert re.search(r"Interval: auto \S+ chosen \S+: Daly \d+s \(Young \d+s\) for a stall of [\d.]+s", text) \
                and "bounds 15s..40s" in text and "MTBI:" in text and "accounting:" in text, text
            assert "below the minimum interval" not in job.text() and job.state() == "RUNNING"
        finally:
            run("scancel", str(job.id), check=False)
