"""Which S3 servers a test runs against (the ``s3_server`` fixture in ``conftest.py``).

``@both_servers`` runs a test on moto and on SeaweedFS; ``s3_bucket`` and ``fault_proxy`` follow. The
SeaweedFS runs are marked slow where the quick tier would otherwise grow (``@both_servers_quick`` keeps
both in the quick tier, for the few cheap tests that show SeaweedFS-only behaviour).
"""

from __future__ import annotations

import pytest

#: ``s3_server`` parameters: moto in the quick tier, SeaweedFS in the full run.
SERVERS = ("moto", pytest.param("seaweedfs", marks=pytest.mark.slow))
both_servers = pytest.mark.parametrize("s3_server", SERVERS, indirect=True)
both_servers_quick = pytest.mark.parametrize("s3_server", ("moto", "seaweedfs"), indirect=True)
seaweedfs_only = pytest.mark.parametrize("s3_server", ("seaweedfs",), indirect=True)
