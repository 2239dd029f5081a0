"""The suite's own process starter (warm_processes.py): a failing rank ends the job, a hung job ends at its timeout."""

from __future__ import annotations

import subprocess

import pytest
import warm_processes
from conftest import SCRIPTS


def test_a_failing_rank_stops_the_job_and_its_error_is_reported():
    proc = warm_processes.run(SCRIPTS / "fail_rank.py", [], nproc=2, timeout=60)
    assert proc.returncode == 1 and "ValueError: boom on rank 1" in proc.stderr


def test_a_job_that_hangs_is_killed_at_its_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import os, sys, time\nprint(os.environ['RANK'], sys.argv[1:], flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        warm_processes.run(script, ["x"], nproc=2, timeout=2)
    assert "[rank 1]\n1 ['x']" in caught.value.stdout
