"""``tiered-ckpt status`` on a fixed local + remote state, in process against
moto: the exact ``--json`` document and table rows, the time at risk equal to the sidecar's gauge,
and wrong targets failing with the words of the other commands (exit 1, one line)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from cli_lines import cli
from restore_util import publish, put
from s3_infra import S3Location, new_bucket

from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.layout import remote_save_prefix, step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.lineage import write_run_record
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.remote.at_risk import commit_time
from tiered_ckpt.remote.upload.metrics import UploadMetrics
from tiered_ckpt.remote.upload.uploader import Uploader

T0 = "2026-01-01T00:00:00.000000Z"
RUN = "0123456789abcdef0123456789abcdef"
GAUGE = "tiered_ckpt_upload_seconds_since_newest_remote"


def _s3(loc: S3Location) -> list[str]:
    return ["--endpoint-url", loc.endpoint_url, "--path-style"]


@pytest.fixture(scope="module")
def run_state(
    tmp_path_factory: pytest.TempPathFactory, moto_server: str
) -> tuple[Path, S3Location, UploadMetrics]:
    """Run ``RUN`` in attempt 2 (superseding steps >= 15 of attempt 1). Steps 5, 10, 15 of attempt 1
    (two ranks each), step 20 uncommitted (a directory without manifest). Step 15 uploaded in
    attempt 1, step 5 in attempt 2, by the real Uploader (the second one's metrics returned); step
    10 being uploaded: shards and manifest mirrored, rank 0's confirmation record only; a multipart
    upload of a save of step 25 that the root does not hold. Built once for the module's tests,
    which only read it."""
    root = tmp_path_factory.mktemp("status") / "run"
    s3_bucket = new_bucket(moto_server, prefix="t/status")
    lineage = RunLineage.first(RUN, T0)
    write_run_record(root, lineage)
    for s in (5, 10, 15):
        save_sharded(
            [{"x": np.full(256 * (r + 1), float(s + r), np.float32)} for r in range(2)], root, s
        )
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        up.upload_step(15)  # in attempt 1: superseded remotely too once attempt 2 starts
    write_run_record(root, lineage.new_attempt(supersedes_from=15, resumed_from=10, started_at=T0))
    (root / step_dir_name(20)).mkdir()
    metrics = UploadMetrics()
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client, metrics=metrics) as up:
        up.upload_step(5)
    c, b, p = s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix
    publish(c, b, p, root, 10, schema=2, upload_manifest=False, pointer=False)
    put(
        c,
        b,
        f"{remote_save_prefix(p, 10, read_manifest(root, 10).save_id)}/.confirm/rank_00000.json",
        b"{}",
    )
    c.create_multipart_upload(
        Bucket=b, Key=f"{remote_save_prefix(p, 25, 'feedface')}/rank_00000.safetensors"
    )
    return root, s3_bucket, metrics


def test_json_and_table_of_a_fixed_state(run_state, capsys: pytest.CaptureFixture) -> None:
    root, loc, metrics = run_state
    m5, m10, m15 = (read_manifest(root, s) for s in (5, 10, 15))
    rc, out, err = cli(capsys, "status", root, "--remote", loc.url, *_s3(loc), "--json")
    gauge = metrics.registry.get_sample_value(GAUGE)
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    risk = doc["runs"][0].pop("at_risk_s")
    assert doc == {
        "time": doc["time"],
        "remote_holds_run": True,
        "runs": [
            {
                "run_id": RUN,
                "attempt": 2,
                "newest_local_step": 10,
                "newest_remote_step": 5,
                "steps": [
                    {
                        "step": 5,
                        "local": "committed",
                        "remote": "committed",
                        "uploaded_bytes": m5.total_bytes,
                        "total_bytes": m5.total_bytes,
                        "marker": "uploaded",
                        "save_id": m5.save_id,
                        "note": "",
                    },
                    {
                        "step": 10,
                        "local": "committed",
                        "remote": "uploading",
                        "uploaded_bytes": m10.shards[0].size_bytes,
                        "total_bytes": m10.total_bytes,
                        "marker": None,
                        "save_id": m10.save_id,
                        "note": "",
                    },
                    {
                        "step": 15,
                        "local": "superseded",
                        "remote": "superseded",
                        "uploaded_bytes": m15.total_bytes,
                        "total_bytes": m15.total_bytes,
                        "marker": None,
                        "save_id": m15.save_id,
                        "note": "superseded by attempt 2 (from step 15)",
                    },
                    {
                        "step": 20,
                        "local": "uncommitted",
                        "remote": "absent",
                        "uploaded_bytes": 0,
                        "total_bytes": None,
                        "marker": None,
                        "save_id": None,
                        "note": "no manifest.json (an interrupted or in-progress save)",
                    },
                    {
                        "step": 25,
                        "local": "absent",
                        "remote": "uploading",
                        "uploaded_bytes": None,
                        "total_bytes": None,
                        "marker": None,
                        "save_id": "feedface",
                        "note": "",
                    },
                ],
            }
        ],
    }
    # the sidecar's gauge and status: one figure, now minus step 5's local commit time
    assert abs(risk - (doc["time"] - commit_time(m5.created_at))) < 1e-6
    assert abs(risk - gauge) < 2.0 and gauge > 0

    rc, out, err = cli(capsys, "status", root, "--remote", loc.url, *_s3(loc))
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"run {RUN}, attempt 2 ({root}, {loc.url})"
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in lines[1:7]]

    def full(m) -> str:
        return f"{m.total_bytes / 1024:.1f} KiB / {m.total_bytes / 1024:.1f} KiB (100%)"

    half = (
        f"{m10.shards[0].size_bytes / 1024:.1f} KiB / {m10.total_bytes / 1024:.1f} KiB "
        f"({100 * m10.shards[0].size_bytes // m10.total_bytes}%)"
    )
    assert rows == [
        ["step", "local", "remote", "uploaded", "marker", "note"],
        ["5", "committed", "committed", full(m5), "uploaded"],
        ["10", "committed", "uploading", half, "-"],
        [
            "15",
            "superseded",
            "superseded",
            full(m15),
            "-",
            "superseded by attempt 2 (from step 15)",
        ],
        [
            "20",
            "uncommitted",
            "absent",
            "0 B / ?",
            "-",
            "no manifest.json (an interrupted or in-progress save)",
        ],
        ["25", "absent", "uploading", "-", "-"],
    ]
    assert re.fullmatch(
        r"newest local step: 10; newest remote step: 5; at risk: [0-9]+\.[0-9] s", lines[7]
    )
    assert len(lines) == 8


def test_local_marks_alone_without_remote(run_state, capsys: pytest.CaptureFixture) -> None:
    """Without --remote the marks decide: step 5's uploaded.json makes it the newest remote step."""
    root, _loc, _ = run_state
    m5 = read_manifest(root, 5)
    rc, out, err = cli(capsys, "status", root, "--json")
    doc = json.loads(out)
    run = doc["runs"][0]
    assert (rc, err, run["newest_remote_step"], run["newest_local_step"]) == (0, "", 5, 10)
    assert [
        (s["step"], s["local"], s["remote"], s["uploaded_bytes"], s["marker"]) for s in run["steps"]
    ] == [
        (5, "committed", None, m5.total_bytes, "uploaded"),
        (10, "committed", None, None, None),
        (15, "superseded", None, None, None),
        (20, "uncommitted", None, None, None),
    ]
    assert abs(run["at_risk_s"] - (doc["time"] - commit_time(m5.created_at))) < 1e-6


def test_wrong_targets_fail_with_one_line(
    tmp_path: Path, s3_bucket: S3Location, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert cli(capsys, "status", tmp_path) == (
        1,
        "",
        (
            f"tiered-ckpt: error: {tmp_path} is not a checkpoint root (no run.json and no step_* directories); "
            "pass --allow-empty to accept an empty directory\n"
        ),
    )
    assert cli(capsys, "status", tmp_path / "typo") == (
        1,
        "",
        f"tiered-ckpt: error: {tmp_path / 'typo'}: directory does not exist\n",
    )
    url = s3_bucket.url + "typo"
    assert cli(capsys, "status", "--remote", url, *_s3(s3_bucket)) == (
        1,
        "",
        (
            f"tiered-ckpt: error: {url} is not a checkpoint prefix (no run.json and no step_* objects); pass "
            "--allow-empty to accept an empty prefix\n"
        ),
    )
    rc, out, err = cli(capsys, "status")
    assert (rc, out, err) == (
        2,
        "",
        "tiered-ckpt: error: status needs ROOT, --remote s3://bucket/prefix, or both\n",
    )
    rc, out, err = cli(capsys, "status", tmp_path, "--allow-empty", "--json")
    assert (rc, err, json.loads(out)["runs"]) == (
        0,
        "",
        [
            {
                "run_id": None,
                "attempt": None,
                "steps": [],
                "newest_local_step": None,
                "newest_remote_step": None,
                "at_risk_s": None,
            }
        ],
    )
    # beside a ROOT, an empty prefix is a run before its first upload: shown, and said
    rc, out, err = cli(
        capsys, "status", tmp_path, "--allow-empty", "--remote", url, *_s3(s3_bucket)
    )
    assert (rc, err) == (0, "")
    assert out.splitlines()[-1] == (
        f"{url} holds no run.json and no step: nothing uploaded yet, or not the sidecar's --remote"
    )


def test_watch_appends_frames_off_a_terminal_and_stops_on_ctrl_c(
    run_state, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off a terminal each refresh is appended under a time line (no screen clearing); Ctrl-C
    between two refreshes (here: raised by the second wait) ends the watch with exit 0 and nothing
    on stderr."""
    import tiered_ckpt.cli.status_cmd as status_cmd

    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(status_cmd.time, "sleep", sleep)
    root = run_state[0]
    rc, out, err = cli(capsys, "status", root, "--watch", "0.5")
    assert (rc, err, waits) == (0, "", [0.5, 0.5])
    frames = out.split("--- ")[1:]
    assert len(frames) == 2 and out.startswith("--- ") and status_cmd.CLEAR not in out
    assert all(f.splitlines()[1] == f"run {RUN}, attempt 2 ({root})" for f in frames)
