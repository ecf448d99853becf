"""Faults survived: real rank processes, real signals (tests/probes/fault_point.py injects them).

A lost rank is named by the survivors, which exit non-zero within the configured timeout; the
same command then resumes from the newest intact checkpoint and reproduces the uninterrupted
run's losses; a failed save, a NaN loss and an out-of-memory error each stop with one clear line.
"""
import functools
import os
import random
import re
import time

import pytest
import torch

from conftest import REPO, tmpfs, train_args_for
from launcher import finish_ranks, free_port, start_ranks, train_inner

PROBES = str(REPO / "tests" / "probes")
UPDATES = 9
SAVE_EVERY = 3
TIMEOUT_S = 20  # --heartbeat-timeout: no collective waits longer for a peer
# --fsdp2-no-consolidate: no test here reads the export a finished run writes at its end (rank 0
# reading the shards back, after the run's last collective); a restart resumes from the shards
FSDP2 = ["--ddp-backend", "fsdp2", "--min-params-to-wrap", "1",
         "--save-interval-updates", SAVE_EVERY, "--heartbeat-timeout", TIMEOUT_S,
         "--num-workers", "0", "--no-epoch-checkpoints", "--fsdp2-no-consolidate"]


def fault_points(seed: int, n: int = 10) -> list[tuple[str, int, str]]:
    """n kill points at increasing updates: (phase, update, which rank or 'all')."""
    rng = random.Random(seed)
    points = []
    for update in sorted(rng.sample(range(2, UPDATES + 1), n)):
        saves = update % SAVE_EVERY == 0  # a save follows this update: it can die inside it
        phase = rng.choice(["forward", "backward", "step"] + (["shards", "copy"] if saves else []))
        who = rng.choice(["0", "all"] if phase == "copy" else ["0", "1", "all"])
        points.append((phase, update, who))
    return points


# A run that hangs is killed by the launcher after HANG_S (and says so in its output); runs
# take seconds when the machine is idle, HANG_S leaves room for a loaded one. No test here
# times a run: a rank that stopped by itself is told apart by its exit status and its message.
HANG_S = 600


def run(train_args, save_dir, fault=None, tmp_path=None, updates=UPDATES, timeout=HANG_S,
        extra=(), save=True):
    env = {"PYTHONPATH": PROBES}
    if fault:
        env["FAULT"] = fault
        env["FAULT_DIR"] = str(tmp_path / f"pids-{fault.replace(':', '-')}")
        os.mkdir(env["FAULT_DIR"])
    args = train_args(*FSDP2, *extra, "--save-dir", save_dir, save=save, updates=updates)
    started = time.monotonic()
    procs = start_ranks(2, lambda r: args, module="fault_point" if fault else "fairseq_cli.train",
                        env=env)
    return finish_ranks(procs, timeout), time.monotonic() - started


def losses(output: str) -> dict[int, tuple[str, str]]:
    return {int(r["num_updates"]): (r["loss"], r["gnorm"]) for r in train_inner(output)}


def resumed_at(output: str) -> int:
    found = re.search(r"Loaded checkpoint .* \(epoch \d+ @ (\d+) updates\)", output)
    return int(found.group(1)) if found else 0


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> list:
    """The kill-and-restart test's uninterrupted reference (its ranks' results), also 2 of the
    clean-exit test's 6 rank exits. Nothing reads its checkpoints: it saves none (and so shows
    that the saves of the runs compared with it do not change what they train)."""
    save_dir = tmp_path_factory.mktemp("reference")
    results, _ = run(functools.partial(train_args_for, corpus, save_dir), save_dir, save=False)
    return results


@pytest.mark.slow
def test_killed_ranks_are_named_and_restarts_reproduce_the_uninterrupted_run(train_args,
                                                                              uninterrupted,
                                                                              tmp_path):
    """5 seeded kill points (one rank or all; in forward, backward, the optimizer step, and
    inside saves: writing the shards and copying to checkpoint_last), each followed by a restart
    with the same command. The seed is one whose 5 points cover every phase and rank 0, rank 1
    and all ranks, 5 being the fewest that can (each run costs seconds; more points cost runs
    for no new case), and among them one rank alone killed inside a save (writing the shards:
    its peer survives in the save) and rank 1 killed in its optimizer step (rank 0 may be past
    the update's last collective), 3 of the kills of one rank; among such seeds, one whose chain
    makes the fewest updates (13 in all, 4 saves; the run is 9 updates, saves every 3)."""
    assert all(r.returncode == 0 for r in uninterrupted), uninterrupted[0].output[-3000:]
    expected = losses(uninterrupted[0].output)
    assert sorted(expected) == list(range(1, UPDATES + 1))

    save_dir = tmp_path / "faulty"
    points = fault_points(seed=10037, n=5)
    assert {p for p, _, _ in points} == {"forward", "backward", "step", "shards", "copy"}
    assert {w for _, _, w in points} >= {"0", "1", "all"}
    resume, compared = 0, 0
    for phase, update, who in points + [(None, None, None)]:
        fault = f"{phase}:{update}:{who}" if phase else None
        results, _ = run(train_args, save_dir, fault, tmp_path)
        where = f"run with FAULT={fault}"
        out = results[0].output
        assert resumed_at(out) == resume, f"{where}:\n{out[-3000:]}"
        # every update this run made equals the uninterrupted run's. Only rank 0 logs
        # train_inner (fairseq sets other ranks' loggers to WARNING), so rank 0's log is read
        # also when rank 0 is the killed one: it holds every update logged before the kill.
        # A kill in forward/backward of update U comes before U is logged; a kill inside the
        # save after update U comes after it; with a kill in rank 1's optimizer step, rank 0
        # (past the last collective of U) may log U or not.
        made = losses(out)
        last = UPDATES if fault is None else update
        surely = last if fault is None or phase in ("shards", "copy") else update - 1
        assert list(range(resume + 1, surely + 1)) == sorted(made)[:surely - resume] and \
            max(made, default=surely) <= last, f"{where}: logged {sorted(made)}:\n{out[-3000:]}"
        for n, value in made.items():
            assert value == expected[n], f"{where}: update {n}: {value} != {expected[n]}"
        compared += len(made)
        if fault is None:
            assert all(r.returncode == 0 for r in results), out[-3000:]
            break
        assert all(r.returncode != 0 for r in results), where
        if who != "all":
            survivor = results[1 - int(who)]
            lines = [l for l in survivor.output.splitlines() if l.startswith("fairseq_fsdp2: error:")]
            assert len(lines) == 1 and f"lost rank {who}" in lines[0], \
                f"{where}:\n{survivor.output[-3000:]}"
        assert not any("[launcher] rank" in r.output for r in results), where  # no hang
        # the newest save that completed: a kill in the copy to checkpoint_last.pt comes after
        # checkpoint_1_<update>.pt was written whole
        resume = update if phase == "copy" else (update - 1) // SAVE_EVERY * SAVE_EVERY
    # the restarts redo the updates lost since the last checkpoint: more than UPDATES compared
    assert compared >= UPDATES, compared


#: the hung-rank test's --heartbeat-timeout. Each rank applies it as its update 3 starts
#: (tests/probes/fault_point.py); until rank 1 stops, in the forward of the last decoder layer,
#: it bounds only how far apart the two ranks reach each collective of that stretch: the end of
#: update 2 and part of a forward of the tiny model: milliseconds, tens on a slow CPU sharing
#: its cores. 2 s is a hundred times that; 5 s waited 3 s longer for nothing (the survivor's
#: heartbeat check then adds its own 3 s either way).
HUNG_TIMEOUT_S = 2


def test_a_hung_rank_is_named_after_the_heartbeat_timeout(train_args, tmp_path):
    """A rank that stops answering (SIGSTOP) without dying: the other gives up after
    --heartbeat-timeout and names it. The probe keeps torch's 30-minute collective timeout
    until update 3 and applies the plugin's HUNG_TIMEOUT_S then (tests/probes/fault_point.py):
    a stall of a loaded machine in updates 1-2 cannot end the run (a 7 s stall of rank 1 in
    update 1 ended it at update 1 before)."""
    env = {"PYTHONPATH": PROBES, "FAULT": "hang:3:1"}
    args = train_args("--ddp-backend", "fsdp2", "--heartbeat-timeout", HUNG_TIMEOUT_S,
                      "--num-workers", "0")
    procs = start_ranks(2, lambda r: args, module="fault_point", env=env)
    try:
        survivor = finish_ranks(procs[:1], timeout=HANG_S)[0]
    finally:
        procs[1].kill()
    assert survivor.returncode == 1, survivor.output[-3000:]
    assert f"Timed out waiting {HUNG_TIMEOUT_S * 1000}ms" in survivor.output
    lines = [l for l in survivor.output.splitlines() if l.startswith("fairseq_fsdp2: error:")]
    assert len(lines) == 1 and "lost rank 1 (rank 0 noticed at update 3)" in lines[0], lines


#: torch's own wait for a peer without --heartbeat-timeout (its default process-group timeout)
TORCH_DEFAULT_WAIT_S = 30 * 60


def test_a_rank_whose_peer_never_comes_gives_up_after_the_timeout(train_args):
    """Rank 1 of 2, and rank 0 never starts (died before the rendezvous): without
    --heartbeat-timeout torch waits 30 minutes; with it, the rank stops by itself (exit status
    1: not killed) with one line, and torch's own message in it names the 1 s its store waited:
    that, not a clock, shows the timeout in effect (how long start-up takes depends on the CPU
    and its load: no test times it). A run still waiting after HANG_S, far below torch's
    30 minutes, is killed and fails the exit-status check. 1 s: the timeout covers nothing
    that could succeed (no rank 0 ever listens), so its length is only the test's idle wait."""
    assert HANG_S < TORCH_DEFAULT_WAIT_S
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    timeout = 1
    args = train_args("--ddp-backend", "fsdp2", "--heartbeat-timeout", timeout)
    (r,) = finish_ranks(start_ranks(1, lambda _: args, env=env, torchrun_env=False), HANG_S)
    assert r.returncode == 1, r.output[-3000:]  # stopped by itself, not killed
    lines = [l for l in r.output.splitlines() if l.startswith("fairseq_fsdp2: error:")]
    assert len(lines) == 1 and lines[0].startswith(
        "fairseq_fsdp2: error: rank 1 could not meet the other ranks at env:// within "
        f"--heartbeat-timeout {timeout} s (a rank died or never started)"), r.output[-3000:]
    assert f"{timeout * 1000}ms" in lines[0], lines[0]  # torch's store waited that long


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(train_args, tmp_path,
                                                               background):
    """From update 4 on files over 128 KiB cannot be written, so the update-6 save fails: one
    line on every rank, and the same command resumes from update 3. With
    --write-checkpoints-asynchronously the update-3 save may still be writing in the background
    when the disk fills (how far training got meanwhile depends on the machine): then that save
    fails, the next save point reports it, and the rerun starts from the beginning."""
    save_dir = tmp_path / "ckpt"
    extra = ["--write-checkpoints-asynchronously"] if background else []
    results, _ = run(train_args, save_dir, "disk-full:4:all", tmp_path, updates=7, extra=extra)
    failed = set()
    for r in results:
        assert r.returncode == 1, r.output[-3000:]
        lines = [l for l in r.output.splitlines() if l.startswith("fairseq_fsdp2: error:")]
        assert len(lines) == 1, r.output[-3000:]
        found = re.match(rf"fairseq_fsdp2: error: saving the checkpoint of update (\d+) to "
                         rf"{save_dir} failed on rank {r.rank}: .*File too large.*; the previous "
                         rf"checkpoints are intact", lines[0])
        assert found, lines[0]
        failed.add(int(found.group(1)))
    assert failed == {6} or background and failed == {3}, failed
    # the same command, with room on the disk again, resumes from the save before and finishes
    results, _ = run(train_args, save_dir, updates=7, extra=extra)
    assert all(r.returncode == 0 for r in results), results[0].output[-3000:]
    assert resumed_at(results[0].output) == min(failed) - 3


def test_a_save_in_flight_when_a_run_fails_is_abandoned_and_its_thread_joined(tmp_path):
    """The run's end after a failure (BackgroundSaves.close, from the run context) with a
    background save whose shards never complete (a rank gone inside DCP's collectives) and whose
    file fairseq never named: its thread stops waiting and is joined, no file is written, and
    no thread of the run is left (a daemon thread alive at exit can abort the process)."""
    from fairseq_fsdp2.checkpoint.async_save import BackgroundSaves, PendingSave
    saves = BackgroundSaves()
    pending = saves._pending = PendingSave(3, str(tmp_path), "shards-3", is_writer=True)
    pending.add_file(str(tmp_path / "checkpoint3.pt"), {"model": {}})
    assert pending._thread.is_alive()
    saves.close()
    assert not pending._thread.is_alive() and saves._pending is None
    assert not os.listdir(tmp_path)


def test_a_full_disk_says_so_with_the_free_space(train_args, tmp_path):
    """A real full disk: the save dir on a 64 KiB tmpfs, too small for the first save's shards.
    Every rank's one line says the disk is full and how much its file system has free.
    Skipped where mounting is not permitted."""
    save_dir = tmp_path / "small-disk"
    with tmpfs(save_dir, "size=64k"):
        results, _ = run(train_args, save_dir, updates=4)
    for r in results:
        lines = [l for l in r.output.splitlines() if l.startswith("fairseq_fsdp2: error:")]
        assert r.returncode == 1 and len(lines) == 1, r.output[-3000:]
        assert re.fullmatch(rf"fairseq_fsdp2: error: saving the checkpoint of update 3 to "
                            rf"{save_dir} failed on rank {r.rank}: no space left on device "
                            rf"\({save_dir}'s file system has \d+\.\d MiB free\)( \(rank \d's "
                            rf"write\))?; the previous checkpoints are intact", lines[0]), lines[0]


@pytest.mark.parametrize("fault, expected", [
    ("nan:3:1", [r"FloatingPointError: .*\(at update 3, rank 0\)",
                 r"FloatingPointError: .*\(at update 3, rank 1\)"]),
    ("oom:3:1", [r"fairseq_fsdp2: error: lost rank 1 \(rank 0 noticed at update 3\)",
                 r"fairseq_fsdp2: error: out of memory on rank 1 at update 3: CUDA out of "
                 r"memory\. Tried to allocate 20\.00 GiB \(simulated by the test\); per-rank peak "
                 r"GB at update 2: rank 0 \d\.\d{3}, rank 1 \d\.\d{3}\. See where it goes with "
                 r"--fsdp2-memory-breakdown 3"]),
])
def test_nan_loss_and_out_of_memory_stop_naming_update_and_rank(train_args, tmp_path, fault,
                                                               expected):
    """Each stops with its line on every rank. The NaN case writes its checkpoints in the
    background: fairseq's crash.pt, saved just before it raises, must be whole afterwards
    (the probe holds rank 0's background write of crash.pt until the main thread waits for it
    or has raised past it, so an exit that does not wait for it loses the file)."""
    nan = fault.startswith("nan")
    save_dir = tmp_path / "ckpt"
    results, _ = run(train_args, save_dir, fault, tmp_path, updates=5,
                     extra=["--write-checkpoints-asynchronously"] if nan else [])
    for r, pattern in zip(results, expected):
        assert r.returncode != 0
        assert re.search(pattern, r.output), f"rank {r.rank}:\n{r.output[-3000:]}"
    if nan:  # fairseq writes crash.pt (the state before the failed update), then raises
        crash = torch.load(save_dir / "crash.pt", weights_only=True)
        shards = save_dir / crash["fsdp2"]["shards"]
        assert (shards / ".metadata").is_file(), sorted(os.listdir(save_dir))
        assert crash["optimizer_history"][-1]["num_updates"] == 2, crash["optimizer_history"]


def test_three_short_runs_exit_cleanly(train_args, uninterrupted):
    """Every successful run ends through the interpreter's own exit (no os._exit), so the end
    of a run must leave nothing that aborts it: the heartbeat thread, left running as a daemon
    inside a store call, aborted the exit (std::terminate: docs/architecture.md, "The end of a
    run"); the run context stops and joins it. 3 runs of 2 ranks are 6 process exits, and every
    other multi-rank run of the suite checks its ranks' status too. The first is the kill test's
    uninterrupted reference (module-scoped: the same end of a run, after 9 updates), the others
    a run of 1 update each."""
    args = train_args("--ddp-backend", "fsdp2", "--num-workers", "0", updates=1)
    codes = []
    for attempt in range(3):
        results = uninterrupted if attempt == 0 else \
            finish_ranks(start_ranks(2, lambda r: args), timeout=HANG_S)
        codes += [r.returncode for r in results]
        assert "done training" in results[0].output, results[0].output[-2000:]  # rank 0 logs
    assert codes == [0] * 6, codes
