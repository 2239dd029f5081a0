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
    interrupted = set()  # saves a kill landed in (after their SAVE_BEGIN): the record cannot say they finished
    for previous, resumed in zip(kills, resumes):
        if previous["killed"] in ("inside save_state", "after save_state, before its record"):
            interrupted.add(previous["saving"])
        assert resumed["chosen"] is not None and resumed["chosen"] == resumed["newest_on_disk"], resumed
        assert resumed["equal_to_saved"], resumed
        # its save had finished: recorded so, or a kill interrupted it after its rename (it is on disk, and loads
        # exactly what was being saved)
        assert resumed["save_recorded_finished"] or resumed["chosen"] in interrupted, (previous, resumed)
    inside = sum(k["killed"] == "inside save_state" for k in kills)
    assert inside >= 5, [k["killed"] for k in kills]
    assert report["final_status"] == 0 and report["final_equal"]
