"""bench/device_queue.sh, the GPU machine's job queue that outlives a call, run here with shell jobs: the first call
starts it and returns, a later call does not start it again and waits for it, each job runs alone in order under its
own limit, and every log comes back in one archive; and the standing queue bench/device_jobs.txt names what exists."""

import os
import pathlib
import re
import subprocess
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "device_queue.sh")


def _call(tmp_path, jobs, wait):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PORTEP_QUEUE_DIR=str(tmp_path / "queue"))
    return subprocess.run(["bash", SCRIPT, str(jobs), str(wait)], env=env, capture_output=True, text=True, timeout=60)


def test_jobs_run_alone_in_order_across_calls_and_come_back_in_one_archive(tmp_path):
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(
        "# a comment\n\n   \n  # an indented comment\n"
        "sleep 1; echo first; pwd; ls bench/device_queue.sh\n"
        "1:sleep 20\n"  # past its limit: 124
        "echo third >&2; ls $PORTEP_QUEUE_DIR/job-2.log; exit 3"  # no newline at the end
    )
    first = _call(tmp_path, jobs, 0)
    assert first.returncode == 0 and "started (3 jobs)" in first.stdout, first.stdout + first.stderr
    second = _call(tmp_path, jobs, 30)
    assert second.returncode == 0 and "already running" in second.stdout, second.stdout + second.stderr
    progress = (tmp_path / "out" / "progress.txt").read_text()
    lines = [line.split(" ", 1)[1] for line in progress.splitlines()]
    assert lines[0].startswith("job 1 start: sleep 1; echo first; pwd"), progress
    assert [line.split(" after ")[0] for line in lines if " rc=" in line] == [
        "job 1 rc=0",
        "job 2 rc=124",
        "job 3 rc=3",
    ], progress
    assert lines[-1] == "queue done" and sum("job 1 start" in line for line in lines) == 1, progress
    # each job starts after the one before ended
    starts = [i for i, line in enumerate(lines) if " start: " in line]
    ends = [i for i, line in enumerate(lines) if " rc=" in line]
    assert all(e < s for e, s in zip(ends, starts[1:])), progress
    with tarfile.open(tmp_path / "out" / "queue.tgz") as archive:
        logs = {m.name.lstrip("./"): archive.extractfile(m).read().decode() for m in archive if m.isfile()}
    # run from the queue's copy of the repository (a later call's copy of the working tree cannot pull a running
    # job's folder from under it)
    assert logs["job-1.log"] == f"first\n{tmp_path / 'queue' / 'tree'}\nbench/device_queue.sh\n", logs
    assert not any(name.startswith("tree/") for name in logs), sorted(logs)  # the copy stays out of the archive
    assert logs["job-3.log"].startswith("third\n") and "job-2.log" in logs["job-3.log"], logs
    assert "queue done" in logs["progress.txt"]


def test_marked_jobs_share_the_gpu_until_a_wait(tmp_path):
    """Jobs marked "&" run side by side; "wait" and a job without "&" start only after every job before them ended."""
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(
        "&sleep 2; echo a\n"
        "&5:sleep 1; exit 4\n"
        "&1:sleep 20\n"  # past its limit: 124, beside the others
        "wait\n"
        "&echo d\n"
        "echo e; cat $PORTEP_QUEUE_DIR/job-4.log\n"  # job 4 ended before this started
    )
    call = _call(tmp_path, jobs, 40)
    assert call.returncode == 0 and "started (5 jobs)" in call.stdout, call.stdout + call.stderr
    progress = (tmp_path / "out" / "progress.txt").read_text()
    lines = [line.split(" ", 1)[1] for line in progress.splitlines()]
    events = [(line.split(" ")[1], "start" if " start: " in line else line.split(" ")[2]) for line in lines[:-1]]
    # jobs 1 to 3 all started before any ended
    assert {e[0] for e in events[:3]} == {"1", "2", "3"} and all(e[1] == "start" for e in events[:3]), progress
    rcs = {job: state for job, state in events if state != "start"}
    assert rcs == {"1": "rc=0", "2": "rc=4", "3": "rc=124", "4": "rc=0", "5": "rc=0"}, progress
    pos = {e: i for i, e in enumerate(events)}
    assert min(pos[(j, rcs[j])] for j in "123") > 2, progress
    assert pos[("4", "start")] > max(pos[(j, rcs[j])] for j in "123"), progress  # "wait" waited for all three
    assert pos[("5", "start")] > pos[("4", "rc=0")], progress  # a job without "&" waits for the "&" jobs
    assert lines[-1] == "queue done"
    job5 = (tmp_path / "queue" / "job-5.log").read_text()
    assert job5 == "e\nd\n", job5
    assert (tmp_path / "queue" / "job-1.log").read_text() == "a\n"


def test_a_missing_jobs_file_is_named():
    r = subprocess.run(["bash", SCRIPT, "/nonexistent/jobs.txt", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "no jobs file '/nonexistent/jobs.txt'" in r.stderr


@pytest.fixture(autouse=True)
def _no_stray_queue(tmp_path):
    yield
    pid = tmp_path / "queue" / "pid"
    if pid.exists():  # a failed test leaves no queue running
        deadline = time.time() + 5
        while time.time() < deadline and subprocess.run(["kill", "-0", pid.read_text().strip()]).returncode == 0:
            time.sleep(0.2)
        subprocess.run(["kill", "-9", "--", "-" + pid.read_text().strip()], capture_output=True)


def test_the_standing_queue_names_files_that_exist():
    """bench/device_jobs*.txt: each job has a limit, and the GPU test files and scripts of
    this tree it names exist (the conformance scripts come from ../shared at run time)."""
    root = pathlib.Path(ROOT)
    jobs = []
    for name, least in (
        ("device_jobs.txt", 5),
        ("device_jobs_h200.txt", 2),
        ("device_jobs_h200_int16.txt", 2),
        ("device_jobs_h200_int32.txt", 2),
    ):
        lines = (root / "bench" / name).read_text().splitlines()
        # a device session beside other jobs must not kill their processes when it ends
        shared = [line for line in lines if line.startswith("&") and "device_session.sh" in line]
        assert all("PORTEP_DEVICE_PKILL=0" in line for line in shared), shared
        named = [line.removeprefix("&") for line in lines if line and line[0] != "#" and line.strip() != "wait"]
        assert len(named) >= least, name
        jobs += named
    for job in jobs:
        secs, _, cmd = job.partition(":")
        assert secs.isdigit() and int(secs) > 0 and cmd, job
        for files in re.findall(r'PORTEP_GPU_TEST_FILES=("[^"]*"|\S+)', cmd):
            for name in files.strip('"').split():
                assert (root / "tests" / "gpu" / name).is_file(), f"{name} (in {job!r})"
        for script in re.findall(r"bash (bench/\S+)", cmd):
            assert (root / script).is_file(), script
