"""The suite's own process starter (warm_processes.py): a failing rank ends the job, a hung job ends at its timeout."""

from __future__ import annotations

import subprocess
import time

import pytest
import warm_processes


def test_a_failing_rank_stops_the_others_and_its_error_is_reported(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, time\n"
                      "if os.environ['RANK'] == '1':\n    raise ValueError('boom on rank 1')\n"
                      "time.sleep(60)  # rank 0 waits on nothing that would notice its peer is gone\n")
    start = time.monotonic()
    proc = warm_processes.run(script, [], nproc=2, timeout=60)
    assert proc.returncodes == [-9, 1] and proc.returncode == 1  # rank 0 was killed for rank 1's failure
    assert "ValueError: boom on rank 1" in proc.stderr and time.monotonic() - start < 30


def test_a_job_that_hangs_is_killed_at_its_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import os, sys, time\nprint(os.environ['RANK'], sys.argv[1:], flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        warm_processes.run(script, ["x"], nproc=2, timeout=2)
    assert "[rank 1]\n1 ['x']" in caught.value.stdout
