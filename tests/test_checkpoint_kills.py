"""20 SIGKILLs of a training process at random moments, about half of them inside a save (issue 18, item 3): every
time, the checkpoint the next run resumes is the newest on disk, its save had finished, and what it loads equals, bit
for bit, what was saved there; the run that finishes ends with the weights of an uninterrupted run
(tests/scripts/kill_chain.py forks the runs, kills them and reports)."""

from __future__ import annotations

from helpers import run_report

KILLS = 20


def test_twenty_kills_every_resume_loads_what_was_saved(tmp_path):
    report = run_report("kill_chain.py", tmp_path / "report.json", ["--kills", str(KILLS), "--seed", "18"],
                        timeout=240)
    kills = report["kills"]
    assert len(kills) == KILLS and all(k["status"] == -9 for k in kills), [k["status"] for k in kills]
    assert kills[0]["chosen"] is None  # the first run starts fresh
    resumes = [*kills[1:], report["final_resumed"]]
    for previous, resumed in zip(kills, resumes):
        assert resumed["chosen"] is not None and resumed["chosen"] == resumed["newest_on_disk"], resumed
        assert resumed["equal_to_saved"], resumed
        # its save had finished: recorded so, or it is the save the kill interrupted after its rename
        assert resumed["save_recorded_finished"] or (
            previous["saving"] == resumed["chosen"] and previous["killed"] != "training"), (previous, resumed)
    inside = sum(k["killed"] == "inside save_state" for k in kills)
    assert inside >= 5, [k["killed"] for k in kills]
    assert report["final_status"] == 0 and report["final_equal"]
