"""A run returns to its caller: programs that train in-process, a second run in the same
process, and hydra sweeps (process/lifecycle.py, process/run_context.py, command_line/exits.py).

One Python program (tests/probes/in_process.py, a plain process: not a training command, so the
plugin does not own it) trains, validates and generates with fairseq's own mains, trains again
resuming the first run's mid-run save, trains another config, fails twice and trains once more,
all inside a TemporaryDirectory; a hydra --multirun sweep runs its jobs one after the
other in one process. Real runs: 1 rank, the tiny model.
"""
import json
import os

import pytest

from conftest import REPO, TINY_MODEL, TRAINING
from launcher import run_command, run_ranks, train_inner

from fairseq_fsdp2.data import numbers
from fairseq_fsdp2.data.prepare import prepare

PROBES = str(REPO / "tests" / "probes")
PHASES = ["start", "train", "validate", "generate", "resume", "other",
          "missing-data", "broken-checkpoint", "after-failures", "end"]


@pytest.fixture(scope="module")
def program(corpus):
    """The probe's output: {phase: (its record, the output since the previous phase)}, and the
    whole result."""
    spec = json.dumps({"corpus": str(corpus), "model": TINY_MODEL, "training": TRAINING})
    (result,) = run_ranks(1, lambda r: [spec], module="in_process", torchrun_env=False,
                          env={"PYTHONPATH": os.pathsep.join([PROBES, str(REPO)])},
                          timeout=400)  # ~15 s alone; a loaded 2-core machine is far slower
    phases, section = {}, []
    for line in result.output.splitlines():
        if line.startswith("PHASE "):
            _, name, record = line.split(" ", 2)
            phases[name] = (json.loads(record), "\n".join(section))
            section = []
        else:
            section.append(line)
    return phases, result


def test_the_program_runs_to_its_end_and_its_exit_handlers_run_once_at_exit(program):
    phases, result = program
    assert result.returncode == 0, result.output[-4000:]
    assert list(phases) == PHASES, result.output[-4000:]
    lines = result.output.splitlines()
    # the caller's atexit handler: not run in the middle (the old end of a run ran them all,
    # and a TemporaryDirectory's cleanup with them), once at interpreter exit
    assert lines.count("ATEXIT") == 1 and lines.index("ATEXIT") > lines.index("DONE")
    assert phases["end"][0]["tmp_exists"]


def test_each_run_leaves_the_process_as_it_found_it(program):
    """No SIGTERM handler, warning filter, process group, plugin thread, run context or kept
    CPU buffer of the stochastic rounding (the "other" run's bf16 moments: the draws' buffers)
    is left behind by a run, a failed one included."""
    phases, _ = program
    assert "Adam's moments kept in bf16 between steps" in phases["other"][1]
    start = {k: v for k, v in phases["start"][0].items() if k != "fairseq_caches_group"}
    assert not start["group"] and not start["run"] and start["threads"] == []
    for name in PHASES[1:]:
        record = phases[name][0]
        assert {k: record[k] for k in start} == start, name


def test_fairseq_caches_its_global_group_where_the_run_context_drops_it(program):
    """fairseq's get_global_group caches the group as an attribute of the function; the run
    context deletes it (run_context.FAIRSEQ_GROUP_CACHE), or the next run's barrier would use
    the destroyed group. Fails here first if fairseq caches it elsewhere."""
    phases, _ = program
    assert phases["start"][0]["fairseq_caches_group"] is True


def test_fairseq_validate_and_generate_read_the_checkpoint_in_the_same_process(program):
    phases, _ = program
    validated = [line for line in phases["validate"][1].splitlines()
                 if "valid on 'valid' subset" in line]
    assert len(validated) == 1, phases["validate"][1][-3000:]
    sentences = int(validated[0].split("| bsz ")[1].split()[0])
    assert sentences > 0 and phases["generate"][0]["hypotheses"] == sentences


def test_training_again_resumes_exactly_in_the_same_process(program):
    """The resumed run (updates 5-6 from the first run's save at update 4), after the first run,
    validation and generation in this process, against the first run itself, which trained on
    uninterrupted to update 6 (its updates 1-6): the same logged losses and bit-identical
    weights (mid-epoch resume is bit-exact, platform notes; nothing may carry over between
    runs, and the reference ran before anything could)."""
    phases, _ = program
    resumed = {int(r["num_updates"]): r["loss"] for r in train_inner(phases["resume"][1])}
    reference = {int(r["num_updates"]): r["loss"] for r in train_inner(phases["train"][1])}
    assert sorted(resumed) == [5, 6] and sorted(reference) == list(range(1, 7)), \
        (resumed, reference)
    assert resumed == {u: reference[u] for u in (5, 6)}
    assert phases["resume"][0]["same_weights"] is True


def test_another_config_trains_after_them_in_the_same_process(program):
    phases, _ = program
    record, output = phases["other"]
    assert record["consolidated"]
    # one encoder layer: 5 units (the first run's plan had 6)
    assert "FSDP2 sharding plan: 5 units over 1 rank(s)" in output, output[-3000:]
    assert "FSDP2 sharding plan: 6 units over 1 rank(s)" in phases["train"][1]
    assert [int(r["num_updates"]) for r in train_inner(phases["after-failures"][1])] == [1, 2]


def test_a_failed_run_raises_its_one_line_error_and_the_program_goes_on(program):
    phases, _ = program
    missing = phases["missing-data"][0]
    assert missing["error"]["type"] == "OptionError" and missing["error"]["exit_status"] == 2
    assert missing["error"]["message"].startswith("data not found: ")
    assert not missing["save_dir"]  # bad input writes nothing
    broken = phases["broken-checkpoint"][0]["error"]
    assert broken["type"] == "CheckpointError" and broken["exit_status"] == 2
    assert broken["message"].startswith("cannot read checkpoint "), broken
    assert "\n" not in missing["error"]["message"] + broken["message"]


def test_a_run_in_the_callers_process_group_leaves_it_as_it_found_it(program):
    """The program opens its own process group (collective timeout 1234 s) and runs training in
    it with --heartbeat-timeout 30 and 8-bit moments: while the group is still open after the
    run, everything is as before the run: the group's collective timeout (the run set 30 s on
    it), torch.load's allow-list, the moments' kept buffers of every thread and their tables,
    the CUDA device, fairseq's cached global group, and the group itself (not destroyed)."""
    phases, _ = program
    caller = phases["after-failures"][0]["caller_group"]
    assert caller["before"]["group"] and caller["before"]["timeouts"] == [1234.0], caller
    assert caller["after"] == caller["before"], caller


def test_a_program_under_torchrun_trains_twice_on_two_ranks(corpus, tmp_path):
    """tests/probes/two_runs.py on 2 ranks (torchrun's environment, rank 0 hosting the store):
    two runs in each process, the second with another config. Each run stops its heartbeat
    thread (no fsdp2 thread is left) and destroys its group, and the second rendezvous does not
    read the first's keys (run_context.RunContext.index; without it the second run hung or
    failed connecting to the first run's addresses)."""
    args = [corpus, *TINY_MODEL, *TRAINING, "--ddp-backend", "fsdp2", "--min-params-to-wrap", 1,
            "--num-workers", "0", "--max-update", "2", "--save-dir", tmp_path / "ckpt"]
    results = run_ranks(2, lambda r: args, module="two_runs",
                        env={"PYTHONPATH": os.pathsep.join([PROBES, str(REPO)])}, timeout=400)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.output[-4000:]}"
        runs = [json.loads(line.split(" ", 2)[2]) for line in r.output.splitlines()
                if line.startswith("RUN ")]
        assert runs == [{"group": False, "run": False, "threads": []}] * 2, runs
    assert (tmp_path / "ckpt-second" / "checkpoint_last_consolidated.pt").is_file()
    assert "FSDP2 sharding plan: 5 units over 2 rank(s)" in results[0].output


def test_a_parser_built_before_the_plugin_gets_one_line_naming_the_fix(corpus):
    """--user-dir fairseq_fsdp2 --ddp-backend fsdp2 in a list, to a parser built before the
    plugin was loaded (it cannot know the choice or the options): one OptionError naming the
    fix, and after ``import fairseq_fsdp2`` the same list parses (tests/probes/late_plugin.py)."""
    result = run_command("late_plugin", str(REPO / "fairseq_fsdp2"), str(corpus),
                         env={"PYTHONPATH": os.pathsep.join([PROBES, str(REPO)])})
    assert result.returncode == 0, result.output[-3000:]
    (line,) = [l for l in result.output.splitlines() if l.startswith("LATE ")]
    late = json.loads(line[5:])
    assert late["first"]["type"] == "OptionError", late
    assert "import fairseq_fsdp2 before options.get_training_parser()" in late["first"]["message"]
    assert (late["backend"], late["root_reshard"]) == ("fsdp2", "always")


# --- a hydra sweep ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nllb_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep-data")
    numbers.write_corpus(root / "raw", [("eng_Latn", "fra_Latn")], n_train=600, n_valid=20,
                         n_test=4, seed=3)
    return prepare(root / "raw", root / "data", vocab_size=100, log=lambda *a: None)


def sweep(data, root, *overrides):
    out = root / "jobs.jsonl"
    result = run_command(
        "fairseq_fsdp2.hydra_train", "--multirun", "--config-dir", REPO / "configs",
        "--config-name", "nllb_tiny_demo", f"task.data={data}", "common.cpu=true",
        "common.log_interval=1", "lr_scheduler.warmup_updates=2",
        f"checkpoint.save_dir={root}/ck_${{hydra:job.num}}", f"hydra.sweep.dir={root}/sweep",
        "+hydra.callbacks.results._target_=sweep_results.JobResults",
        f"+hydra.callbacks.results.out={out}", *overrides,
        env={"PYTHONPATH": os.pathsep.join([PROBES, str(REPO)])}, timeout=400)
    jobs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return result, jobs


def valid_losses_per_job(output: str) -> list[list[float]]:
    """Each job's validation losses, in order: hydra's launcher prints ``[HYDRA] \t#N : ...``
    as it starts job N, its job logging ``[valid][INFO] - {json}`` for each validation."""
    jobs = []
    for line in output.splitlines():
        if "[HYDRA] \t#" in line:
            jobs.append([])
        elif "[valid][INFO] - " in line:
            jobs[-1].append(float(json.loads(line.split("[valid][INFO] - ", 1)[1])["valid_loss"]))
    return jobs


VALIDATIONS = 2  # one per update: best, mean and last told apart (below)


def test_a_hydra_sweep_runs_every_job_and_returns_each_best_validation_loss(nllb_data,
                                                                         tmp_path):
    """Each job validates, and saves, after each of its 2 updates. It returns its best loss
    (checkpoint_best.pt's: the least, the largest with maximize_best_checkpoint_metric), not
    fairseq's smoothed valid meter, which is their mean, nor the last. Two validations tell
    the three apart: their mean is neither (they differ), and the largest is the first (the
    loss falls). The 4 jobs run in one process, the two that minimize one after the other:
    the first (lr 0.003) reaches a lower loss than the second (lr 0.0003) ever does, so a best
    carried over into the second job would be returned there."""
    result, jobs = sweep(nllb_data, tmp_path, f"optimization.max_update={VALIDATIONS}",
                         "dataset.validate_interval_updates=1",
                         "checkpoint.save_interval_updates=1",
                         "checkpoint.maximize_best_checkpoint_metric=false,true",
                         "optimization.lr=[0.003],[0.0003]")
    assert result.returncode == 0, result.output[-4000:]
    assert [(j["num"], j["status"]) for j in jobs] == [(n, "COMPLETED") for n in range(4)]
    # the values fairseq's meter rounds to 3 decimals, as the log prints them
    losses = valid_losses_per_job(result.output)
    assert [len(each) for each in losses] == [VALIDATIONS] * 4, result.output[-4000:]
    print(f"validation losses per job: {losses}")
    for j, each in zip(jobs, losses):
        best = max(each) if j["maximize"] else min(each)
        mean = sum(each) / len(each)
        assert best != mean, (j, each)  # validations whose best is not their mean
        assert not j["maximize"] or best != each[-1], (j, each)  # nor, here, the last
        assert j["value"] == best, (j, each)
        assert os.path.isfile(os.path.join(j["save_dir"], "checkpoint_last_consolidated.pt"))
    minimizing = [(j["lr"], min(each)) for j, each in zip(jobs, losses) if not j["maximize"]]
    # jobs 0 and 1, one after the other: the first job's best would win in the second
    assert [lr for lr, _ in minimizing] == [[0.003], [0.0003]], minimizing
    assert not jobs[0]["maximize"] and not jobs[1]["maximize"], jobs
    assert minimizing[0][1] < minimizing[1][1], minimizing


@pytest.fixture(scope="module")
def failing_sweep(nllb_data, tmp_path_factory):
    """One sweep serves both failure tests below (one process instead of two): jobs 0 and 1
    have a bad model override, job 2 a bad --fsdp2-reshard-degree, job 3 neither (hydra runs
    the product of the two lists, the first one's values outermost)."""
    return sweep(nllb_data, tmp_path_factory.mktemp("failing-sweep"), "optimization.max_update=2",
                 "+model.activation_fn=nonsense,relu",
                 "distributed_training.fsdp2_reshard_degree=3,0")


def test_a_failed_job_of_a_sweep_is_reported_as_hydra_reports_one(failing_sweep):
    """Job 2's --fsdp2-reshard-degree 3 is bad input on one rank: the job fails (raised to
    hydra, which reports it and exits 1), job 3 trains and exports."""
    result, jobs = failing_sweep
    assert result.returncode == 1, result.output[-4000:]
    assert [(j["num"], j["status"]) for j in jobs] == [
        (0, "FAILED"), (1, "FAILED"), (2, "FAILED"), (3, "COMPLETED")], jobs
    assert "--fsdp2-reshard-degree 3 must divide" in jobs[2]["value"]
    assert "Error executing job with overrides" in result.output, result.output[-3000:]
    assert os.path.isfile(os.path.join(jobs[3]["save_dir"], "checkpoint_last_consolidated.pt"))


def test_a_job_whose_config_is_bad_fails_alone_and_the_sweep_goes_on(failing_sweep):
    """Jobs 0 and 1's model override is bad input that the hydra entry finds while filling in
    the config's defaults (integration/hydra_config.add_defaults_or_stop): raised to hydra as
    the job's failure, not an exit of the whole process, so jobs 2 and 3 still run and job 3
    trains."""
    result, jobs = failing_sweep
    assert result.returncode == 1, result.output[-4000:]
    assert [(j["num"], j["status"]) for j in jobs] == [
        (0, "FAILED"), (1, "FAILED"), (2, "FAILED"), (3, "COMPLETED")], jobs
    for job in jobs[:2]:
        assert job["value"].startswith(
            "OptionError: model.activation_fn: invalid choice: 'nonsense'"), job


def test_a_run_starts_without_the_best_score_and_patience_an_earlier_run_left_in_fairseq():
    """fairseq keeps the best validation score and --patience's count for the whole process
    (attributes of save_checkpoint and should_stop_early): a second run in a program would
    write checkpoint_best.pt only where it beat the first run, and stop early on the first
    run's count. Opening a run forgets them (process/run_context.forget_previous_runs); here in
    this process, with the records an earlier run would leave (no process group is made)."""
    import fairseq_cli.train as fairseq_train
    from fairseq import checkpoint_utils

    from fairseq_fsdp2.process import run_context

    records = [(checkpoint_utils.save_checkpoint, "best"),
               (fairseq_train.should_stop_early, "best"),
               (fairseq_train.should_stop_early, "num_runs")]
    assert [(h.__name__, n) for h, n in records] == [
        (f, n) for _, f, names in run_context.FAIRSEQ_RUN_RECORDS for n in names]
    for holder, name in records:
        setattr(holder, name, 3)  # an earlier run's best (3.0) and patience count (3)
    run = run_context.open_run(builds_on_meta=False, background_saves=False)
    try:
        left = [f"{h.__name__}.{n}" for h, n in records if hasattr(h, n)]
    finally:
        run.close()
        for holder, name in records:
            vars(holder).pop(name, None)
    assert not left, f"a new run still sees {left}"
