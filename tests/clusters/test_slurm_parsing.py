"""Slurm's answers mapped to Orrery's terms, on output recorded from a real Slurm 22.05
(slurmrestd v0.0.38, via scripts/slurm-dev-cluster.sh)."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from clusters.adapters.base import Phase, Share, Work
from clusters.adapters.slurm.accounts import (
    Account,
    NoAccount,
    account_for,
    check_output_dir,
    output_path,
    read_tail,
)
from clusters.adapters.slurm.adapter import (
    batch_script,
    lanes,
    parse_squeue_line,
    remote_state,
    sbatch_argv,
    work_gres,
)
from clusters.adapters.slurm.api import (
    SlurmError,
    decode_exit,
    job_state,
    node_state,
    parse_gres,
    parse_nodes,
)
from clusters.adapters.slurm.tags import claim, submitted_job
from clusters.choices import NodeState

RECORDINGS = Path(__file__).parent / "recordings"


def recorded(name: str) -> dict:
    return json.loads((RECORDINGS / f"slurm-22.05-{name}.json").read_text())


@pytest.mark.parametrize(
    "gres, expected",
    [
        ("gpu:a100:4", ("a100", 4)),
        ("gpu:4", (None, 4)),
        ("", (None, 0)),
        (None, (None, 0)),
        ("gpu:h100:8(S:0-1)", ("h100", 8)),
        ("tmpdisk:100,gpu:l40s:2", ("l40s", 2)),
    ],
)
def test_gres(gres, expected):
    assert parse_gres(gres) == expected


@pytest.mark.parametrize(
    "state, flags, expected",
    [
        ("idle", [], NodeState.READY),
        ("mixed", [], NodeState.READY),
        ("allocated", [], NodeState.READY),
        ("down", [], NodeState.DOWN),
        ("idle", ["DRAIN"], NodeState.DRAINED),
        ("mixed", ["DRAIN"], NodeState.DRAINING),
        ("idle", ["NOT_RESPONDING"], NodeState.NOT_READY),
        ("down", ["NOT_RESPONDING"], NodeState.DOWN),
        ("future", [], NodeState.NOT_READY),
        (["IDLE", "DRAIN"], None, NodeState.DRAINED),
        ("weird", [], NodeState.NOT_READY),
    ],
)
def test_node_states(state, flags, expected):
    assert node_state(state, flags)[0] == expected


@pytest.mark.parametrize(
    "state, expected",
    [
        ("PENDING", "PENDING"),
        ("RUNNING", "RUNNING"),
        ("COMPLETING", "COMPLETING"),
        ("COMPLETED", "SUCCEEDED"),
        ("FAILED", "FAILED"),
        ("NODE_FAIL", "FAILED"),
        ("TIMEOUT", "TIMEOUT"),
        ("CANCELLED", "CANCELLED"),
        ("PREEMPTED", "PREEMPTED"),
        ("REQUEUE_HOLD", "HELD"),
        (["CANCELLED"], "CANCELLED"),
        ("NEW_STATE", "FAILED"),
    ],
)
def test_job_states(state, expected):
    assert job_state(state) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [(0, (0, None)), (768, (3, None)), (15, (None, 15)), (9, (None, 9)), (None, (None, None))],
)
def test_exit_status_is_a_raw_wait_status(raw, expected):
    assert decode_exit(raw) == expected


def test_recorded_nodes():
    nodes = {n.name: n for n in parse_nodes(recorded("nodes"))}
    assert set(nodes) == {"n1", "n2", "n3", "n4"}
    assert (nodes["n1"].gpu_type, nodes["n1"].gpus, nodes["n1"].cpus, nodes["n1"].memory_mb) == (
        "a100",
        4,
        8,
        64000,
    )
    assert nodes["n1"].partitions == ("gpu",)
    assert (nodes["n4"].state, nodes["n4"].reason) == (NodeState.DRAINED, "maintenance")


def test_recorded_jobs():
    jobs = {j["name"]: j for j in recorded("jobs")["jobs"]}
    assert job_state(jobs["rec-exit3"]["job_state"]) == "FAILED"
    assert decode_exit(jobs["rec-exit3"]["exit_code"]) == (3, None)
    assert job_state(jobs["rec-sleep"]["job_state"]) == "CANCELLED"
    assert decode_exit(jobs["rec-sleep"]["exit_code"]) == (None, 15)


def test_an_answer_that_is_not_slurmrestd_json_is_a_clear_error():
    import http.server
    import threading

    from clusters.adapters.slurm.api import SlurmClient, SlurmError

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # a catch-all web app: 200 with HTML on every path
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>welcome</html>")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SlurmError, match="is this the slurmrestd URL") as caught:
            SlurmClient(f"http://127.0.0.1:{server.server_port}", "jwt").connect()
        assert caught.value.field == "url"
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    "state, expected",
    [("RUNNING", True), ("COMPLETING", False), ("SUSPENDED", False), (["RUNNING"], True)],
)
def test_only_a_running_job_can_pass_its_time_limit(state, expected):
    import time

    from scheduling.dispatch.remote import past_time_limit

    ran_61 = remote_state("a", {"job_state": state, "start_time": time.time() - 61, "job_id": 9})
    ran_59 = remote_state("a", {"job_state": state, "start_time": time.time() - 59, "job_id": 9})
    assert past_time_limit(ran_61, 60) is expected
    assert past_time_limit(ran_59, 60) is False


@pytest.mark.parametrize(
    ("job", "phase", "exit_code", "message"),
    [
        ({"job_state": "COMPLETED", "exit_code": 0}, Phase.SUCCEEDED, 0, "succeeded in Slurm (COMPLETED)"),
        # Slurm says "None" for no reason: it is not repeated as if it were one
        (
            {"job_state": "COMPLETED", "exit_code": 0, "state_reason": "None"},
            Phase.SUCCEEDED,
            0,
            "succeeded in Slurm (COMPLETED)",
        ),
        ({"job_state": "RUNNING"}, Phase.RUNNING, None, "running in Slurm"),
        (
            {"job_state": "FAILED", "exit_code": 3 << 8, "state_reason": "NonZeroExitCode"},
            Phase.FAILED,
            3,
            "failed in Slurm (NonZeroExitCode, exit code 3)",
        ),
        (
            {"job_state": "CANCELLED", "exit_code": 15},
            Phase.CANCELLED,
            None,
            "cancelled in Slurm (signal 15)",
        ),
        (
            {"job_state": "PENDING", "state_reason": "Resources"},
            Phase.QUEUED,
            None,
            "pending in Slurm: waiting for resources in Slurm",
        ),
        ({"job_state": "PENDING", "state_reason": "None"}, Phase.QUEUED, None, ""),
        (
            {"job_state": "REQUEUE_HOLD", "state_reason": "JobHeldAdmin"},
            Phase.HELD,
            None,
            "pending in Slurm: held by a Slurm administrator (scontrol release)",
        ),
        ({"job_state": "COMPLETING", "nodes": "n1"}, Phase.RUNNING, None, "running on n1"),
        ({"job_state": "BOOT_FAIL"}, Phase.FAILED, None, "failed in Slurm (BOOT_FAIL)"),
    ],
)
def test_slurm_jobs_in_neutral_terms(job, phase, exit_code, message):
    state = remote_state("a", {"job_id": 7, **job})
    assert (state.phase, state.exit_code, state.message, state.remote_id) == (phase, exit_code, message, "7")


def test_squeue_lines_read_as_slurmrestd_gives_the_job():
    """Sync reads ``squeue``; each line becomes the job as slurmrestd would give it, so the same
    mapping applies. Separators typed into the comment or the name shift no other field."""
    sep = "\x1f"

    def line(*fields: str) -> str:
        return "".join(f"{f}{sep}" for f in fields)

    ended = parse_squeue_line(
        line("42", "FAILED", "768", "2026-12-02T13:18:37", "NonZeroExitCode", "n1", "orrery:t", "0b7c")
    )
    assert ended == {
        "job_id": 42,
        "job_state": "FAILED",
        "exit_code": 768,
        "start_time": int(time.mktime((2026, 12, 2, 13, 18, 37, 0, 0, -1))),  # squeue prints local time
        "state_reason": "NonZeroExitCode",
        "nodes": "n1",
        "comment": "orrery:t",
        "name": "0b7c",
    }
    assert remote_state("0b7c", ended).message == "failed in Slurm (NonZeroExitCode, exit code 3)"
    pending = parse_squeue_line(line("43", "PENDING", "0", "N/A", "Resources", "", "(null)", "x"))
    assert (pending["start_time"], pending["comment"], pending["nodes"]) == (0, "", "")
    tricky = parse_squeue_line(line("44", "RUNNING", "0", "N/A", "None", "n2", f"a{sep}b", "0b7c"))
    assert (tricky["comment"], tricky["name"], tricky["nodes"]) == (f"a{sep}b", "0b7c", "n2")
    assert parse_squeue_line("slurm_load_jobs error: Unable to contact slurm controller") is None
    mine = line("45", "RUNNING", "0", "N/A", "None", "n2", "orrery:t", "other")
    assert parse_squeue_line(mine, lambda name, text: name == "0b7c") is None
    assert parse_squeue_line(mine, lambda name, text: text == "orrery:t")["job_id"] == 45


def test_works_sharing_a_node_are_submitted_in_one_lane_in_order():
    """Slurm gives a job on a node the GPUs in submission order: works that share a node (even
    through a gang on a third) stay in one lane, in placement order; the others may go apart."""

    def on(name: str, *nodes: str):
        shares = tuple(Share(i, node, (0,)) for i, node in enumerate(nodes))
        return (_work(attempt_id=name, shares=shares), None, "")

    ready = [on("a", "n1"), on("b", "n2"), on("gang", "n3", "n1"), on("c", "n3"), on("d", "n4")]
    ready.append(on("e", "n1"))
    split = [[w.attempt_id for w, _, _ in lane] for lane in lanes(ready)]
    assert sorted(split) == [["a", "gang", "c", "e"], ["b"], ["d"]]


def _work(**fields) -> Work:
    return Work(
        attempt_id=fields.pop("attempt_id", "0b7c"),
        job_id=5,
        number=2,
        epoch=9,
        script=fields.pop("script", "cd /w && python train.py"),
        env=fields.pop("env", {"LR": "0.1"}),
        shares=fields.pop("shares", (Share(1, "n1", (0, 1)), Share(2, "n2", (2, 3)))),
        time_limit_s=61,
        **fields,
    )


ALICE = Account("orrt-alice", 1001, 1001, "/home/orrt-alice")
SERVICE = Account("orrery", 990, 990, "/var/lib/orrery", shared=True)


def test_the_sbatch_command_line_pins_the_chosen_nodes_and_gpus():
    gres = work_gres(_work(), {"slurm.io/gres-type": "a100"}, {})
    argv = sbatch_argv(_work(), gres, account=ALICE, output="/home/orrt-alice/o.out", tag="t1")
    assert argv[:3] == ["sbatch", "--parsable", "--job-name=0b7c"]
    assert "--nodelist=n1,n2" in argv and "--nodes=2" in argv and "--no-requeue" in argv
    assert "--gres=gpu:a100:2" in argv and "--time=2" in argv
    assert "--export=NONE" in argv  # nothing of the control plane's environment
    assert not any(a.startswith("--wrap") or ("=" in a and "LR" in a) for a in argv)
    script = batch_script(_work())
    assert script.startswith("#!/bin/sh\n") and script.endswith("cd /w && python train.py'\n")
    assert "export ORRERY_ATTEMPT=2\n" in script and "export ORRERY_NNODES=2\n" in script
    assert "\nexec srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --whole --kill-on-bad-exit=1 " in script
    alone = batch_script(_work(shares=(Share(1, "n1", (0, 1)),)))
    assert "srun" not in alone and alone.endswith("\ncd /w && python train.py\n")  # one node: as it is


@pytest.mark.parametrize(
    "account, expected, absent",
    [
        (
            ALICE,
            ["--uid=orrt-alice", "--gid=1001", "--chdir=/home/orrt-alice", "--comment=orrery:t1"],
            [],
        ),
        (SERVICE, ["--chdir=/var/lib/orrery", "--comment=orrery:t1"], ["--uid", "--gid"]),
    ],
    ids=["a-users-account", "the-shared-service-account"],
)
def test_the_sbatch_command_line_says_whose_job_it_is(account, expected, absent):
    argv = sbatch_argv(_work(), "", account=account, output="/x/o.out", tag="t1")
    assert set(expected) <= set(argv) and "--output=/x/o.out" in argv
    assert not any(a.startswith(option) for option in absent for a in argv)


@pytest.mark.parametrize(
    "account", [Account("toor", 0, 5, "/root"), Account("wheel", 1002, 0, "/home/w")], ids=["uid-0", "gid-0"]
)
def test_a_users_job_is_never_submitted_as_root(account):
    with pytest.raises(NoAccount, match="refusing to run a user's work as root"):
        sbatch_argv(_work(), "", account=account, output="/x/o.out", tag="t1")


def test_the_submit_host_resolves_accounts_and_refuses_root_and_strangers():
    with pytest.raises(NoAccount, match="refusing to run a user's work as root"):
        account_for("root", "hpc")
    with pytest.raises(NoAccount, match="no user 'orrt-nobody' on the Orrery host"):
        account_for("orrt-nobody", "hpc")
    with pytest.raises(NoAccount, match="has no POSIX account on cluster 'hpc'"):
        account_for(None, "hpc")
    # The shared identity is the service account itself, unless that is root (as here).
    assert os.geteuid() == 0
    with pytest.raises(NoAccount, match="shared identity and the Orrery host submits as root"):
        account_for("", "hpc")


@pytest.mark.parametrize(
    "config, account, expected",
    [
        ({}, ALICE, "/home/orrt-alice/.orrery/slurm/orrery-0b7c.out"),
        ({"output_dir": "/scratch/{user}/jobs"}, ALICE, "/scratch/orrt-alice/jobs/orrery-0b7c.out"),
        (
            {"output_dir": "{home}/out"},
            Account("u", 7, 7, "/home/{user}"),
            "/home/{user}/out/orrery-0b7c.out",
        ),
        ({}, SERVICE, "/srv/orrery-out/orrery-0b7c.out"),
        ({"output_dir": "{home}/o"}, SERVICE, "/var/lib/orrery/o/orrery-0b7c.out"),
    ],
    ids=["default", "a-template", "placeholders-replaced-once", "shared", "shared-with-a-template"],
)
def test_output_paths(config, account, expected, monkeypatch):
    monkeypatch.setenv("ORRERY_SLURM_OUTPUT_DIR", "/srv/orrery-out")
    assert str(output_path(config, account, "0b7c")) == expected


@pytest.mark.parametrize(
    "template",
    ["scratch/{user}", "{user}/out", "/scratch/{uid}", "/scratch/{home.__class__}", "{home}/../x", "/a\n/b"],
)
def test_output_directory_templates_that_are_refused(template):
    with pytest.raises(SlurmError, match="output directory") as caught:
        check_output_dir(template)
    assert caught.value.field == "output_dir"


def _job(name: str, job_id: int, comment: str = "", state: str = "RUNNING") -> dict:
    return {"name": name, "job_id": job_id, "comment": comment, "job_state": state}


A, B, C = (str(uuid.UUID(int=i)) for i in (1, 2, 3))


def test_a_cluster_claims_only_the_jobs_carrying_its_tag():
    """What one cluster's sync makes of a job list shared with another Orrery cluster (tag
    ``other``) and with people submitting by hand."""
    works = [_work_for(A), _work_for(B, remote_id="21")]
    jobs = [
        _job(A, 10, "orrery:other"),  # another cluster's job under an attempt name we ask about
        _job(A, 11, "orrery:mine"),  # ours, not yet recorded: found
        _job(A, 12, "orrery:mine"),  # a second job of ours under that name: an orphan
        _job(B, 20, "orrery:mine"),  # ours, but not the recorded one: an orphan
        _job(B, 21, ""),  # the recorded one, its comment rewritten (or from before tags): found
        _job(C, 30, "orrery:other"),  # another cluster's live job: not ours to touch
        _job(C, 31, "orrery:mine", "COMPLETED"),  # ours, ended: nothing to cancel
        _job("train.sh", 40, "orrery:mine"),  # not an attempt name
    ]
    found, orphans = claim(jobs, works, "mine")
    assert {name: j["job_id"] for name, j in found.items()} == {A: 11, B: 21}
    assert [(o.attempt_id, o.remote_id) for o in orphans] == [(A, "12"), (B, "20")]
    assert claim(jobs, [], "third") == ({}, [])


@pytest.mark.parametrize(
    "output, expected",
    [
        ("77|orrery:other\n78|orrery:mine\n", "78"),
        ("77|orrery:other\n", ""),
        ("79|\n", ""),
        ("", ""),
        ("80|orrery:mine|x\n", ""),
    ],
    ids=["ours-after-anothers", "anothers-only", "untagged", "none", "a-comment-that-only-starts-alike"],
)
def test_a_retried_dispatch_finds_only_its_own_job(output, expected):
    assert submitted_job(output, "mine") == expected


def test_output_is_read_back_only_from_the_owners_own_regular_file(tmp_path):
    """The control plane reads output as root: a link, a FIFO or someone else's file planted at
    the output path is never read (nor waited on)."""
    me = os.geteuid()
    real = tmp_path / "real.out"
    real.write_bytes(b"x" * 10 + b"tail")
    assert read_tail(real, me, 4) == (10, b"tail")
    assert read_tail(real, me + 1, 4) is None  # owned by someone else
    (tmp_path / "link.out").symlink_to(real)
    assert read_tail(tmp_path / "link.out", me, 4) is None
    os.mkfifo(tmp_path / "fifo.out")
    assert read_tail(tmp_path / "fifo.out", me, 4) is None
    assert read_tail(tmp_path / "missing.out", me, 4) is None


def _work_for(attempt_id: str, remote_id: str = "") -> Work:
    return Work(attempt_id, 1, 1, 1, "true", {}, (Share(1, "n1", (0,)),), remote_id=remote_id)


def test_env_values_cannot_inject_variables_or_commands(tmp_path):
    import subprocess

    hostile = {
        "A": "x,ORRERY_INJECTED=1",  # a comma once split --export into two variables
        "B": "'; touch " + str(tmp_path / "pwned") + "; echo '",
        "C": "$(touch " + str(tmp_path / "pwned2") + ")`id`",
        "D": "line one\nline two",
    }
    script = batch_script(_work(env=hostile, script="env", shares=(Share(1, "n1", (0,)),)))
    ran = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env={}, check=True)
    seen = dict(line.split("=", 1) for line in ran.stdout.split("\n") if "=" in line and line[:1].isupper())
    assert seen["A"] == hostile["A"] and "ORRERY_INJECTED" not in seen
    assert seen["B"] == hostile["B"] and seen["C"] == hostile["C"]
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    assert seen["PATH"].startswith("/usr/local/sbin") and seen["ORRERY_JOB_ID"] == "5"
    with pytest.raises(SlurmError, match="not an environment variable name"):
        batch_script(_work(env={"X;rm -rf /": "1"}))


# Stand-ins for Slurm's own commands, to run a batch script here for real (no Slurm runs where
# these tests do; tests/clusters/test_slurm_live.py runs the same on a real one): ``scontrol show
# hostnames`` expands the node list, ``srun`` runs its task once per node with that node's
# SLURM_NODEID and SLURMD_NODENAME, as slurmd would, and records its options.
FAKE_SCONTROL = '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "n1\\nn2\\n"\n'
FAKE_SRUN = """#!/bin/sh
echo "$@" > "$SRUN_ARGS"
n=1; for a in "$@"; do case $a in --nodes=*) n=${a#--nodes=};; esac; done
while [ $# -gt 0 ] && [ "$1" != /bin/sh ]; do shift; done
i=0; while [ $i -lt $n ]; do SLURM_NODEID=$i SLURMD_NODENAME=n$((i + 1)) "$@" || exit $?; i=$((i + 1)); done
"""
PRINT_ENV = (
    'echo "$SLURMD_NODENAME $MASTER_ADDR:$MASTER_PORT nodes=$NNODES node=$NODE_RANK rank=$RANK '
    "world=$WORLD_SIZE local=$LOCAL_WORLD_SIZE head=$ORRERY_HEAD_ADDR port=$ORRERY_MASTER_PORT "
    'o=$ORRERY_NNODES/$ORRERY_NODE_RANK/$ORRERY_WORLD_SIZE/$ORRERY_LOCAL_WORLD_SIZE lr=$LR"'
)


@pytest.mark.parametrize(
    ("shares", "expected"),
    [
        (
            (Share(1, "n1", (0, 1, 2, 3)),),
            ["n1 n1:29507 nodes=1 node=0 rank=0 world=4 local=4 head=n1 port=29507 o=1/0/4/4 lr=0.1"],
        ),
        (
            (Share(1, "n1", ()),),
            ["n1 n1:29507 nodes=1 node=0 rank=0 world=1 local=1 head=n1 port=29507 o=1/0/1/1 lr=0.1"],
        ),
        (
            (Share(1, "n1", (0, 1)), Share(2, "n2", (2, 3))),
            [
                "n1 n1:29507 nodes=2 node=0 rank=0 world=4 local=2 head=n1 port=29507 o=2/0/4/2 lr=0.1",
                "n2 n1:29507 nodes=2 node=1 rank=2 world=4 local=2 head=n1 port=29507 o=2/1/4/2 lr=0.1",
            ],
        ),
    ],
    ids=["one-node-4-gpus", "one-node-cpu", "gang-2x2"],
)
def test_every_node_of_a_slurm_job_gets_the_launch_environment(tmp_path, shares, expected):
    import subprocess

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    # the job's own values for the platform's names are dropped: a rank of its own splits the gang
    mine = {"LR": "0.1", "MASTER_PORT": "1", "RANK": "9", "NODE_RANK": "9", "ORRERY_NNODES": "9"}
    script = batch_script(_work(env=mine, script=PRINT_ENV, shares=shares, master_port=29507))
    env = {
        "PATH": f"{bin_}:/usr/bin:/bin",
        "SLURM_JOB_NODELIST": "n[1-2]" if len(shares) > 1 else "n1",
        "SLURMD_NODENAME": "n1",  # the batch script runs on the allocation's first node
        "SRUN_ARGS": str(tmp_path / "srun.args"),
    }
    ran = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, check=True)
    assert ran.stdout.splitlines() == expected
    if len(shares) > 1:
        assert (tmp_path / "srun.args").read_text().split()[:7] == [
            "--nodes=2",
            "--ntasks=2",
            "--ntasks-per-node=1",
            "--whole",
            "--kill-on-bad-exit=1",
            "--export=ALL",
            "/bin/sh",
        ]
