"""One sidecar process of the two-saves race (tests/s3/test_save_race.py): uploads one step per
trial.

``python tests/_save_race_worker.py SYNC_DIR ENDPOINT NAME`` reads ``SYNC_DIR/plan.json`` (a list of
``{"trial": i, "roots": {NAME: root}, "url": s3_url, "step": S}``); for each trial it waits for the
file ``SYNC_DIR/go_<i>`` (both workers start together), runs ``Uploader(root, url).upload_step(S)``
once and writes ``SYNC_DIR/res_<i>_<NAME>.json``: ``{"ok": true}`` or ``{"ok": false, "error":
<type>, "message": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from s3_infra import make_test_client

from tiered_ckpt import Uploader
from tiered_ckpt.retry import RetryPolicy


def main() -> None:
    sync, endpoint, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    plan = json.loads((sync / "plan.json").read_text())
    client = make_test_client(endpoint)
    retry = RetryPolicy(max_attempts=4, initial_wait_s=0.02, max_wait_s=0.1)
    (sync / f"ready_{name}").write_text("")
    for t in plan:
        go = sync / f"go_{t['trial']}"
        deadline = time.monotonic() + 120
        while not go.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: no go for trial {t['trial']}")
            time.sleep(0.001)
        res: dict[str, object]
        try:
            with Uploader(t["roots"][name], t["url"], s3_client=client, retry=retry) as up:
                up.upload_step(t["step"])
            res = {"ok": True}
        except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
            res = {"ok": False, "error": type(e).__name__, "message": str(e)}
        tmp = sync / f".res_{t['trial']}_{name}.tmp"
        tmp.write_text(json.dumps(res))
        os.replace(
            tmp, sync / f"res_{t['trial']}_{name}.json"
        )  # the test never reads a partial file


if __name__ == "__main__":
    main()
