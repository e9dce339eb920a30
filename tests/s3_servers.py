"""Which S3 servers a test runs against (the ``s3_server`` fixture in ``conftest.py``).

``@both_servers`` runs a test on moto and on SeaweedFS; ``s3_bucket`` and ``fault_proxy`` follow.
The SeaweedFS runs are all marked slow, so that the quick tier starts no SeaweedFS (its start and
stop alone cost seconds; the quick tier must stay under 3 minutes). ``@both_servers_quick`` and
``@seaweedfs_only`` are kept as names for the tests that show SeaweedFS-only behaviour; CI's full
run runs them all.
"""

from __future__ import annotations

import pytest

#: ``s3_server`` parameters: moto in the quick tier, SeaweedFS in the full run.
SERVERS = ("moto", pytest.param("seaweedfs", marks=pytest.mark.slow))
both_servers = pytest.mark.parametrize("s3_server", SERVERS, indirect=True)
both_servers_quick = pytest.mark.parametrize(
    "s3_server", ("moto", pytest.param("seaweedfs", marks=pytest.mark.slow)), indirect=True
)
seaweedfs_only = pytest.mark.parametrize(
    "s3_server", (pytest.param("seaweedfs", marks=pytest.mark.slow),), indirect=True
)
