"""Launchers as users run them, with the real fairseq-train CLI and the plugin:

- torchrun's agent (real ``torch.distributed.run``, 2 workers on CPU, forked from the test's
  pre-imported server; it starts its workers as usual, each a small process (fork_client.py)
  whose environment, output and signals the server's forked child takes on, so the agent sees
  and signals its workers as with the ``torchrun`` command; tests/test_nllb_finetune.py runs
  the command itself, with fresh interpreters): a worker is SIGKILLed mid-run
  (tests/probes/fault_point.py). With the default settings the job stops: the agent's report
  names the lost rank, the survivor prints one line saying how to resume. With
  ``--max-restarts 1`` the agent restarts the workers, which resume from the newest complete
  checkpoint.
- SLURM, emulated: no SLURM here, so each task gets the environment ``srun`` gives it
  (SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_NTASKS(_PER_NODE), SLURM_NODEID, SLURM_PROCID,
  SLURM_LOCALID) and a stand-in ``scontrol`` on PATH answers ``scontrol show hostnames`` with
  localhost. Both of fairseq's modes: one task per rank, and one task per node that starts the
  node's ranks (torch.multiprocessing.spawn, fresh interpreters; on CPU
  --distributed-world-size / nodes ranks per node, on GPUs one per GPU: not run here).
- Several nodes, emulated on one machine: two SLURM node ids, two torchrun agents
  (``--nnodes 2 --node-rank K``).

Every training run must print exactly the per-update losses of the same training started by the
test's own launcher (tests/launcher.py), also when a run resumes what another launcher saved.
"""
import os
import re
from datetime import datetime

import pytest

from conftest import PLUGIN, REPO, TINY_MODEL, TRAINING
from launcher import (FORKED_WORKER, finish_ranks, free_port, ok, start_ranks, start_torchrun,
                      train_inner)

PROBES = str(REPO / "tests" / "probes")
FAULT_POINT = [*FORKED_WORKER, "fault_point"]  # torchrun's entry: tests/probes/fault_point.py
# `python -m fairseq_cli.train`: fairseq_cli/train.py run as __main__, which takes
# registration.py's __main__ branch of the Trainer patch; the fairseq-train console script
# imports the module instead (the other branch): tests/probes/fault_point.py here, the command
# itself in tests/test_nllb_finetune.py
FAIRSEQ_TRAIN = [*FORKED_WORKER, "fairseq_cli.train"]
#: the uninterrupted reference's length: the restart test's run (killed in update 4, the last,
#: two updates after the save it resumes from) and the SLURM/torchrun chain (updates 1-4)
UPDATES = 4
# --fsdp2-no-consolidate: no test here reads the export a finished run writes at its end (rank 0
# reading the shards back, after the run's last collective); every launch resumes from the shards
FSDP2 = ["--ddp-backend", "fsdp2", "--min-params-to-wrap", "1", "--save-interval-updates", "2",
         "--heartbeat-timeout", "60", "--num-workers", "0", "--no-epoch-checkpoints",
         "--fsdp2-no-consolidate"]
ENV = {"PYTHONPATH": os.pathsep.join([PROBES, str(REPO)])}
TIMEOUT_S = 300  # per run; the machine may be loaded


def fairseq_args(corpus, save_dir, updates: int, *extra) -> list[str]:
    return [str(corpus), "--user-dir", PLUGIN, *TINY_MODEL, *TRAINING, *FSDP2,
            "--max-update", str(updates), "--save-dir", str(save_dir), *map(str, extra)]


def losses(output: str) -> list[tuple[int, tuple[str, str]]]:
    return [(int(r["num_updates"]), (r["loss"], r["gnorm"])) for r in train_inner(output)]


def assert_losses(output: str, reference: dict, updates: list[int]) -> None:
    """The updates logged are exactly ``updates`` and each has the reference loss and gnorm."""
    made = losses(output)
    assert [n for n, _ in made] == updates, output[-4000:]
    for n, value in made:
        assert value == reference[n], f"update {n}: {value} != {reference[n]}"


def resumed_at(output: str) -> list[int]:
    return [int(u) for u in re.findall(r"Loaded checkpoint .* \(epoch \d+ @ (\d+) updates\)",
                                       output)]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("fairseq_fsdp2: error:")]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict:
    """The uninterrupted 2-rank run, started by tests/launcher.py (torchrun's environment).
    Nothing reads its checkpoints: it saves none (--no-save; and so shows that the saves of the
    runs compared with it do not change what they train)."""
    save_dir = tmp_path_factory.mktemp("reference")
    out = ok(finish_ranks(start_ranks(2, lambda r: fairseq_args(corpus, save_dir, UPDATES,
                                                                "--no-save"),
                                      env=ENV), TIMEOUT_S))
    found = dict(losses(out))
    assert sorted(found) == list(range(1, UPDATES + 1))
    return found


def torchrun(args: list, out: str, env: dict = None):
    """Start torchrun's agent; all its output (and its workers') goes to ``out``."""
    return start_torchrun(args, out, {**ENV, **(env or {})})


def survivor_line(save_dir, update: int, restarts_left: bool) -> str:
    then = ("torchrun restarts the workers (restart 1 of 1), which resume from the newest "
            f"complete checkpoint in {save_dir}") if restarts_left else \
        f"run the same command again to resume from the last checkpoint in {save_dir}"
    return (f"fairseq_fsdp2: error: stopped by torchrun (SIGTERM) on rank 0 at update {update}: "
            f"a worker failed or the job was stopped; torchrun's error report names the failed "
            f"rank; {then}")


def assert_one_survivor_line(out: str, save_dir, update: int, restarts_left: bool) -> None:
    """The agent SIGTERMs the survivor about 0.1 s after the kill; the survivor's own check
    (liveness.py) needs 3 s to name the lost rank, so its line is the SIGTERM one, unless the
    agent was starved of CPU for longer than that: then it is the survivor's own report."""
    lines = error_lines(out)
    assert len(lines) == 1, out[-4000:]
    assert lines[0] == survivor_line(save_dir, update, restarts_left) or lines[0].startswith(
        f"fairseq_fsdp2: error: lost rank 1 (rank 0 noticed at update {update})"), lines[0]


def timings(out: str) -> str:
    """For the report (pytest -s): seconds from the kill to the agent's SIGTERM (torchrun's log
    time) and to the restarted attempt's first update (fairseq's log time: whole seconds).
    Called after the run's checks, so that a failing run shows its own output."""
    killed = re.search(r"FAULT_KILL (\d+\.\d+)", out)
    if killed is None:
        return "no kill logged"
    kill = float(killed.group(1))
    day = datetime.fromtimestamp(kill).strftime("%Y-%m-%d")
    said = []
    term = re.search(r"^W\d{4} (\S+) .*closing signal SIGTERM", out, re.M)
    if term:
        sent = datetime.strptime(f"{day} {term.group(1)}", "%Y-%m-%d %H:%M:%S.%f")
        said.append(f"kill -> SIGTERM to the survivor {sent.timestamp() - kill:.2f} s")
    restarted = out.split("torchrun restart 1 of 1")
    first = re.search(r"^(\S+ \S+) \| INFO \| train_inner", restarted[-1], re.M)
    if len(restarted) > 1 and first:
        at = datetime.strptime(first.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        said.append(f"kill -> restarted attempt's first update {at - kill:.0f} s")
    return ", ".join(said)


@pytest.mark.slow
def test_torchrun_default_a_lost_worker_stops_the_job_with_one_line(corpus, reference,
                                                                    tmp_path):
    """torchrun with its default settings; worker 1 is SIGKILLed in update 3."""
    save_dir = tmp_path / "ckpt"
    agent = torchrun(["--nproc_per_node", 2, "--master_port", free_port(), *FAULT_POINT,
                      *fairseq_args(corpus, save_dir, 3)], str(tmp_path / "log"),
                     {"FAULT": "forward:3:1"})
    agent.wait(TIMEOUT_S)
    out = agent.output()
    assert agent.returncode == 1, out[-4000:]
    # the agent's report: its own traceback and the table, whose root cause is rank 1
    report = out[out.index("Traceback (most recent call last)"):]
    assert "ChildFailedError" in report and re.search(
        r"Root Cause \(first observed failure\):\n\[0\]:\n.*\n.*\n\s*rank\s*: 1 \(local_rank: "
        r"1\)\n\s*exitcode\s*: -9", report), report
    assert "Traceback" not in out[:out.index(report)], "a worker printed a traceback"
    assert_one_survivor_line(out, save_dir, 3, restarts_left=False)
    assert_losses(out, reference, [1, 2])
    print(f"\ntorchrun, lost worker: {timings(out)}")


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_by_itself(corpus, reference, tmp_path):
    """The same command with --max-restarts 1; worker 1 is SIGKILLed in update 4 (of 4): the
    agent restarts both workers, which resume from update 2 (the newest checkpoint; saves every
    2 updates), make update 3 again (the first attempt made it after that checkpoint) and
    finish with the uninterrupted run's losses. Default rendezvous (static, --master_port);
    docs/launching.md "Restarts" says why every rendezvous works."""
    save_dir = tmp_path / "ckpt"
    agent = torchrun(["--nproc_per_node", 2, "--master_port", free_port(), "--max-restarts", 1,
                      *FAULT_POINT, *fairseq_args(corpus, save_dir, UPDATES)],
                     str(tmp_path / "log"), {"FAULT": "forward:4:1"})
    agent.wait(TIMEOUT_S)
    out = agent.output()
    assert agent.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert_one_survivor_line(out, save_dir, 4, restarts_left=True)
    first, restarted = out.split("torchrun restart 1 of 1 (TORCHELASTIC_RESTART_COUNT=1): "
                                 f"resuming from the newest complete checkpoint in {save_dir}")
    assert resumed_at(first) == [] and resumed_at(restarted) == [2], out[-4000:]
    assert_losses(first, reference, [1, 2, 3])
    assert_losses(restarted, reference, [3, 4])
    print(f"\ntorchrun --max-restarts 1: {timings(out)}")


def slurm_env(scontrol: str, nodes: int, tasks_per_node: int, node: int, local: int) -> dict:
    """What srun gives task ``local`` of node ``node``; the nodes' hostnames all reach this
    machine (localhost, 127.0.0.1)."""
    nodelist = ",".join(["localhost", "127.0.0.1"][:nodes])
    return {**ENV, "PATH": f"{scontrol}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
            "SLURM_NNODES": str(nodes), "SLURM_NTASKS": str(nodes * tasks_per_node),
            "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node * tasks_per_node + local), "SLURM_LOCALID": str(local)}


@pytest.fixture
def scontrol(tmp_path) -> str:
    """A stand-in for SLURM's scontrol: `scontrol show hostnames A,B` prints A and B."""
    folder = tmp_path / "slurm-bin"
    folder.mkdir()
    script = folder / "scontrol"
    script.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\n'
                      'echo "$3" | tr , "\\n"\n')
    script.chmod(0o755)
    return str(folder)


def srun(scontrol, nodes: int, tasks_per_node: int, args) -> list:
    """The tasks of an emulated `srun --nodes N --ntasks-per-node T fairseq-train ARGS`."""
    return finish_ranks(start_ranks(
        nodes * tasks_per_node, lambda r: args, torchrun_env=False,
        env=lambda r: slurm_env(scontrol, nodes, tasks_per_node, *divmod(r, tasks_per_node))),
        TIMEOUT_S)


@pytest.mark.slow
def test_slurm_both_modes_and_two_nodes_continue_one_training(corpus, reference, scontrol,
                                                              tmp_path):
    """One training, 1 update per launch, each launch resuming the previous one's checkpoint
    (built on the meta device) with the uninterrupted run's losses, all exiting 0:
    SLURM one task per rank (1 node x 2 tasks); SLURM one task per node (2 nodes x 1 rank);
    SLURM one task per node starting 2 ranks (spawned; must run the plugin's launch path:
    the meta-device build is enabled only there); torchrun on 2 emulated nodes."""
    save_dir = tmp_path / "ckpt"
    port = free_port()

    def check(out: str, updates: list[int]) -> None:
        assert_losses(out, reference, updates)
        assert "Traceback" not in out and not error_lines(out), out[-4000:]
        if updates[0] > 1:
            assert resumed_at(out) == [updates[0] - 1], out[-4000:]
            assert "model built on the meta device" in out, out[-4000:]

    out = ok(srun(scontrol, 1, 2, fairseq_args(corpus, save_dir, 1, "--distributed-port", port)))
    assert "SLURM: rank 0 of 2, rendezvous at tcp://localhost:" in out
    check(out, [1])
    out = ok(srun(scontrol, 2, 1, fairseq_args(corpus, save_dir, 2, "--distributed-port", port)))
    check(out, [2])
    out = ok(srun(scontrol, 1, 1, fairseq_args(corpus, save_dir, 3, "--distributed-port", port,
                                               "--distributed-world-size", 2)))
    assert "SLURM: rank 0 to 1 of 2" in out
    check(out, [3])

    endpoint = f"localhost:{free_port()}"
    agents = [torchrun(["--nnodes", 2, "--node-rank", k, "--nproc-per-node", 1,
                        "--rdzv-endpoint", endpoint, *FAIRSEQ_TRAIN,
                        *fairseq_args(corpus, save_dir, 4)], str(tmp_path / f"node{k}.log"))
              for k in (0, 1)]
    for agent in agents:
        agent.wait(TIMEOUT_S)
        assert agent.returncode == 0, agent.output()[-4000:]
    check(agents[0].output(), [4])


def test_slurm_two_nodes_without_a_shared_save_dir_stop_before_writing(corpus, scontrol,
                                                                      tmp_path):
    """SLURM one task per rank on 2 nodes x 2 tasks, each node with its own --save-dir: every
    rank stops with one line naming the other node's ranks, exit 2, and nothing is written."""
    port = free_port()
    results = finish_ranks(start_ranks(
        4, lambda r: fairseq_args(corpus, tmp_path / f"node{r // 2}", 2, "--distributed-port",
                                  port), torchrun_env=False,
        env=lambda r: slurm_env(scontrol, 2, 2, *divmod(r, 2))), TIMEOUT_S)
    for r in results:
        lines = error_lines(r.output)
        assert r.returncode == 2 and len(lines) == 1, r.output[-4000:]
        assert re.fullmatch(
            rf"fairseq_fsdp2: error: --save-dir is not the same directory on every rank: rank 2 "
            rf"\(host \S+, {tmp_path}/node1\), rank 3 \(host \S+, {tmp_path}/node1\) cannot see "
            rf"the file rank 0 \(host \S+\) wrote in {tmp_path}/node0; on several nodes "
            rf"--save-dir must be a directory all nodes share .*", lines[0]), lines[0]
        assert "Traceback" not in r.output and "begin training" not in r.output
    assert not (tmp_path / "node0").exists() and not (tmp_path / "node1").exists()


@pytest.mark.parametrize("extra, nodes, message", [
    ([], 2, "under SLURM, --distributed-port PORT is needed: a free port on the job's first "
            "node, the same for every task (it hosts the rendezvous)"),
    (["--distributed-port", "1", "--distributed-world-size", "3"], 2,
     "--distributed-world-size 3 is not a multiple of the 2 SLURM nodes (one task per node "
     "starts --distributed-world-size / nodes ranks on CPU)"),
])
def test_slurm_settings_that_cannot_work_are_one_line(corpus, scontrol, tmp_path, extra, nodes,
                                                      message):
    (r,) = finish_ranks(start_ranks(1, lambda r: fairseq_args(corpus, tmp_path / "ckpt", 2,
                                                             *extra), torchrun_env=False,
                                    env=slurm_env(scontrol, nodes, 1, 0, 0)), TIMEOUT_S)
    assert r.returncode == 2 and error_lines(r.output) == [f"fairseq_fsdp2: error: {message}"], \
        r.output[-3000:]
    assert "Traceback" not in r.output and not (tmp_path / "ckpt").exists()
