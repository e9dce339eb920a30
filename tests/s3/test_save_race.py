"""Two saves of one step racing into one prefix: two real sidecar processes
(tests/_save_race_worker.py) start ``upload_step`` of the same step number at the same moment, each
from its own root holding its own save, against moto's S3 server (a real process). 20 trials of each
case:

- **two runs** (the roots' run.json name different runs, e.g. two jobs configured with one prefix):
  exactly one claims the prefix and commits; the other is refused with ``RunMismatchError`` and
  writes no ``uploaded.json``;
- **one run, two saves** (an old cluster's sidecar still alive next to the new cluster's, both saves
  of the step in the same attempt): each commits its own save under its own keys.

In every trial ``verify --remote`` finds every committed save intact, each commit names only its own
save's objects (keys, sha256, the mirrored manifest), and every ``uploaded.json`` written names the
local manifest it was written for. Before per-save keys and fencing, both saves wrote the same keys:
one side could exit 0 with its marker while the commit mixed the two saves.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest
import s3_infra
from _upload_util import make_step, remote_bytes
from spawn import TESTS_DIR, child_env, python_cmd

from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.layout import MANIFEST_NAME, RUN_RECORD_NAME, UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.remote.inspect.verify import scan_remote

pytestmark = pytest.mark.slow

TRIALS = 20
STEP = 100
T0 = "2026-01-01T00:00:00.000000Z"


def _root(path: Path, run_id: str, seed: int) -> Path:
    path.mkdir(parents=True)
    (path / RUN_RECORD_NAME).write_text(RunLineage.first(run_id, T0).to_json())
    make_step(path, STEP, shard_bytes=192 * 1024, seed=seed)
    return path


def _run_trials(tmp_path: Path, loc: s3_infra.S3Location, two_runs: bool) -> list[dict]:
    sync = tmp_path / "sync"
    sync.mkdir()
    plan = []
    for i in range(TRIALS):
        ra = _root(tmp_path / f"t{i}" / "a", "a" * 32, seed=2 * i + 1)
        rb = _root(tmp_path / f"t{i}" / "b", ("b" if two_runs else "a") * 32, seed=2 * i + 2)
        plan.append(
            {
                "trial": i,
                "roots": {"a": str(ra), "b": str(rb)},
                "step": STEP,
                "url": f"s3://{loc.bucket}/{loc.prefix}/trial{i:02d}",
            }
        )
    (sync / "plan.json").write_text(json.dumps(plan))
    env = child_env(helpers=True, **s3_infra.TEST_AWS_ENV)
    procs = [
        subprocess.Popen(
            python_cmd(TESTS_DIR / "_save_race_worker.py", sync, loc.endpoint_url, n), env=env
        )
        for n in "ab"
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((sync / f"ready_{n}").exists() for n in "ab"):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                "workers did not start"
            )
            time.sleep(0.01)
        for t in plan:
            (sync / f"go_{t['trial']}").write_text("")
            while not all((sync / f"res_{t['trial']}_{n}.json").exists() for n in "ab"):
                assert time.monotonic() < deadline + 300 and all(
                    p.poll() in (None, 0) for p in procs
                )
                time.sleep(0.005)
            t["res"] = {
                n: json.loads((sync / f"res_{t['trial']}_{n}.json").read_text()) for n in "ab"
            }
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return plan


def _check_trial(t: dict, loc: s3_infra.S3Location) -> dict[str, bool]:
    url = t["url"]
    rows = scan_remote(url, s3_client=loc.client)
    assert rows and all(r.state == "committed" for r in rows), (
        t["trial"],
        [(r.state, r.reason) for r in rows],
    )
    won = {}
    for n, root in t["roots"].items():
        root = Path(root)
        ok = t["res"][n]["ok"]
        won[n] = ok
        sdir = root / step_dir_name(STEP)
        mbytes = (sdir / MANIFEST_NAME).read_bytes()
        m = read_manifest(root, STEP)
        mk = sdir / UPLOADED_MARKER_NAME
        if not ok:
            assert not mk.exists(), (t["trial"], n, "a sidecar that lost wrote uploaded.json")
            continue
        marker = json.loads(mk.read_text())
        assert marker["manifest_sha256"] == hashlib.sha256(mbytes).hexdigest()
        sp = f"{url.split('/', 3)[3]}/{step_dir_name(STEP)}.{m.save_id}"
        um = UploadManifest.from_json(remote_bytes(loc, f"{sp}/upload_manifest.json"))
        assert um.save_id == m.save_id and um.manifest_sha256 == hashlib.sha256(mbytes).hexdigest()
        assert remote_bytes(loc, f"{sp}/{MANIFEST_NAME}") == mbytes
        assert [(s.key, s.sha256) for s in um.shards] == [
            (f"{sp}/{r.path}", r.sha256) for r in m.shards
        ]
        assert hashlib.sha256(remote_bytes(loc, um.shards[0].key)).hexdigest() == m.shards[0].sha256
    return won


def test_two_runs_racing_for_one_prefix(tmp_path: Path, s3_bucket: s3_infra.S3Location) -> None:
    plan = _run_trials(tmp_path, s3_bucket, two_runs=True)
    winners = []
    for t in plan:
        won = _check_trial(t, s3_bucket)
        assert sorted(won.values()) == [False, True], (t["trial"], t["res"])
        loser = next(n for n, ok in won.items() if not ok)
        assert t["res"][loser]["error"] == "RunMismatchError", t["res"][loser]
        assert "--adopt-prefix" in t["res"][loser]["message"]
        winners.append(next(n for n, ok in won.items() if ok))
    assert len(winners) == TRIALS


def test_two_saves_of_one_step_racing(tmp_path: Path, s3_bucket: s3_infra.S3Location) -> None:
    plan = _run_trials(tmp_path, s3_bucket, two_runs=False)
    for t in plan:
        won = _check_trial(t, s3_bucket)
        assert won == {"a": True, "b": True}, (t["trial"], t["res"])
        assert len(scan_remote(t["url"], s3_client=s3_bucket.client)) == 2  # each its own save
