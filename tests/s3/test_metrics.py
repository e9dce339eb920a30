"""The sidecar's Prometheus endpoint, scraped over HTTP."""

from __future__ import annotations

import math
import urllib.request
from pathlib import Path

import pytest
import s3_infra
from _upload_util import SMALL, make_step
from prometheus_client.parser import text_string_to_metric_families

from tiered_ckpt import Uploader
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.remote.upload.daemon import UploadLoop
from tiered_ckpt.remote.upload.metrics import UploadMetrics
from tiered_ckpt.retry import RetryPolicy


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_metrics_endpoint(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    root = tmp_path / "node"
    for s in (1, 2):
        make_step(root, s, shard_bytes=3 * 1024 * 1024)
    metrics = UploadMetrics()
    port = metrics.serve(0, addr="127.0.0.1")
    client = s3_infra.make_test_client(fault_proxy.url)
    try:
        with Uploader(
            root,
            s3_bucket.url,
            s3_client=client,
            metrics=metrics,
            retry=RetryPolicy(max_attempts=2, initial_wait_s=0.01, max_wait_s=0.02),
            **SMALL,
        ) as up:
            m0 = _scrape(port)
            assert m0["tiered_ckpt_upload_bytes_total"] == 0
            assert math.isnan(m0["tiered_ckpt_upload_seconds_since_newest_remote"])
            UploadLoop(up, poll_interval_s=0.01).run(once=True)
            m1 = _scrape(port)
            total = sum(read_manifest(root, s).total_bytes for s in (1, 2))
            assert m1["tiered_ckpt_upload_bytes_total"] == total
            assert m1["tiered_ckpt_upload_steps_total"] == 2
            assert m1["tiered_ckpt_upload_failures_total"] == 0
            assert m1["tiered_ckpt_upload_newest_remote_step"] == 2
            assert 0 <= m1["tiered_ckpt_upload_seconds_since_newest_remote"] < 120
            # A new step that cannot be uploaded: queue depth 1, one failure.
            make_step(root, 3, shard_bytes=3 * 1024 * 1024)
            fault_proxy.fail_all(status=500, code="InternalError")
            UploadLoop(up, poll_interval_s=0.01).run(once=True)
            m2 = _scrape(port)
            assert m2["tiered_ckpt_upload_failures_total"] == 1
            assert m2["tiered_ckpt_upload_queue_depth"] == 1
            assert m2["tiered_ckpt_upload_bytes_total"] == total
            assert m2["tiered_ckpt_upload_newest_remote_step"] == 2
    finally:
        metrics.close()
