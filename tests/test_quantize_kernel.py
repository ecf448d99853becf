"""The 8-bit moments' C++ kernel (optimizer/csrc/blockwise_8bit.cpp) computes what the eager
tensor operations compute (optimizer/blockwise_8bit.py), bit for bit: the same codes and block
maxima from the same draws, and the same dequantized values. Exactness, not a tolerance: both
do the same float32 operations in the same order (the kernel is built without fused
multiply-add), so any difference is a bug. Every version of the kernel's loops that this CPU
runs is compared (quantize's plain C++ loops everywhere, its AVX-512 loops where the CPU has
them). tests/test_quantize_law.py proves the rounding law
on the default path (the kernel where built).

Inputs meant to reach every branch: rows that are a whole number of blocks and rows that end
in a short block (the eager code pads it with zeros), magnitudes over 40 decades (denormal
quotients included), blocks of zeros and of -0.0, blocks whose elements are all negative or
all equal, elements that are exact map values times the block maximum (the prefix tables'
crossings). And a row holding inf and NaN: its codes are left out of the comparison (a NaN's
bits after a vectorized maximum differ between the eager code's loops and by CPU; no step
stores a non-finite moment: fairseq skips the step on a non-finite gradient norm), but every
other row must come out the same."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from fairseq_fsdp2.optimizer.moments import kernels
from fairseq_fsdp2.optimizer.moments.blockwise_8bit import (BLOCK, CPU_CHUNK, dequantize,
                                                            dynamic_map, quantize)
from fairseq_fsdp2.optimizer.moments.stochastic_round import to_bf16_stochastic

from conftest import REQUIRE_FIXTURE_DEPS


@pytest.fixture(scope="module")
def built():
    if kernels.blockwise_8bit() is None:
        message = ("the C++ kernel is not built here (no compiler or ninja, or "
                   f"{kernels.DISABLE} set): the eager code runs, nothing to compare")
        if os.environ.get(REQUIRE_FIXTURE_DEPS) == "1" and not os.environ.get(kernels.DISABLE):
            pytest.fail(message + " (scripts/test.sh builds it first)", pytrace=False)
        pytest.skip(message)


def tensor(rows: int, row: int, signed: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, row, generator=g) * 10.0 ** torch.randint(-20, 20, (rows, 1),
                                                                   generator=g).float()
    x[:, 1::7] *= torch.rand(rows, len(range(1, row, 7)), generator=g) ** 16  # tiny quotients
    if rows > 6:
        x[0] = 0.0
        x[1] = -0.0
        x[2] = -x[2].abs()
        x[3] = 0.25
        q = dynamic_map(signed)  # exact map values times a block maximum of 2^-3
        x[4] = q[torch.randint(0, 256, (row,), generator=g)] * 0.125
        x[4, 0] = 0.125
        x[5, :3] = torch.tensor([float("inf"), float("nan"), -1.0])
    return x if signed else x.abs()


@pytest.mark.parametrize("rows,row", [(40, 3 * BLOCK), (33, 300), (9, 1000),
                                      (CPU_CHUNK // 512 + 5, 512)])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("isa", [kernels.PLAIN, kernels.AVX512])
def test_the_kernel_quantizes_and_dequantizes_as_the_eager_code_bit_for_bit(
        built, rows, row, signed, isa):
    if isa > kernels.best_loops():
        pytest.skip("this CPU has no AVX-512: the plain loops run here, and are compared")
    x = tensor(rows, row, signed, seed=rows * row)
    codes, absmax = quantize(x, signed, torch.Generator().manual_seed(7), isa=isa)
    codes_e, absmax_e = quantize(x, signed, torch.Generator().manual_seed(7), kernel=False)
    finite = x.isfinite().all(-1)
    assert rows <= 6 or not finite[5]
    codes, absmax, codes_e, absmax_e = (t[finite] for t in (codes, absmax, codes_e, absmax_e))
    assert torch.equal(absmax.view(torch.int32), absmax_e.view(torch.int32)), \
        (absmax.view(-1)[:8], absmax_e.view(-1)[:8])
    differ = (codes != codes_e).nonzero()
    assert not len(differ), (f"{len(differ)} codes differ, first at {differ[0].tolist()}: "
                             f"{codes[tuple(differ[0])]} vs {codes_e[tuple(differ[0])]}")
    values = dequantize(codes, absmax, signed)
    values_e = dequantize(codes, absmax, signed, kernel=False)
    assert torch.equal(values.view(torch.int32), values_e.view(torch.int32))


def test_the_kernel_draws_what_the_eager_code_draws(built):
    """The generator is left where the eager code leaves it: the next moment's (and a resumed
    run's) draws are the same."""
    x = tensor(20, 700, True, seed=1)
    g, g_e = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    quantize(x, True, g)
    quantize(x, True, g_e, kernel=False)
    assert torch.equal(torch.randint(0, 1 << 30, (4,), generator=g),
                       torch.randint(0, 1 << 30, (4,), generator=g_e))


# -- the build ---------------------------------------------------------------------------------

@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """kernels' build with torch's builder replaced (no compiler runs): its build folder is
    ``tmp_path``, and ``load`` does what torch's JIT build does first (a FileBaton on
    ``lock`` there, which waits as long as the file exists), except that it fails instead of
    waiting forever; no module of the process is loaded yet."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton
    calls = []

    def load(name, sources, build_directory, **kwargs):
        baton = FileBaton(os.path.join(build_directory, kernels.TORCH_LOCK))
        if not baton.try_acquire():
            raise AssertionError("torch's build would wait here forever")
        baton.release()
        calls.append(name)
        return "module"

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.delenv(kernels.DISABLE, raising=False)
    return calls


def test_a_lock_left_by_a_killed_build_is_removed_with_one_line(fresh_build, tmp_path, caplog):
    """A build killed midway leaves torch's lock file; the next build (no other holds the
    build's own lock: the process that held it is gone) removes it, says so in one line, and
    builds instead of waiting on it forever."""
    (tmp_path / kernels.TORCH_LOCK).write_text("")
    assert kernels.blockwise_8bit() == "module" and fresh_build == [kernels.NAME]
    assert not (tmp_path / kernels.TORCH_LOCK).exists()
    lines = [r.getMessage() for r in caplog.records if r.name == kernels.__name__]
    assert len(lines) == 1 and "\n" not in lines[0] and "stopped midway" in lines[0], lines


def test_a_run_that_finds_no_kernel_says_so_once(fresh_build, monkeypatch, caplog):
    """Where the kernel cannot be built (here: no ninja), one warning line with the builder's
    reason, once per process; the eager code runs, whose bits the tests above compare."""
    from torch.utils import cpp_extension

    def no_ninja(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions (pip install ninja to "
                           "get it)")
    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    assert kernels.blockwise_8bit() is None and kernels.blockwise_8bit() is None
    assert kernels.best_loops() == kernels.PLAIN
    lines = [r.getMessage() for r in caplog.records if r.name == kernels.__name__]
    assert lines == ["the 8-bit moments' C++ kernel could not be built (RuntimeError: Ninja is "
                     "required to load C++ extensions (pip install ninja to get it)); the "
                     "slower eager tensor operations compute the same values instead"], lines


def test_the_end_of_a_run_drops_every_threads_buffers_and_tables():
    """What the moments' code keeps between calls, in two threads (a run's own and, say, a
    background save's): release_workspaces, which a run's end calls, drops both threads'
    buffers (8-bit quantize's workspace, bf16 rounding's draws) and the per-device tables.
    tests/test_in_process.py checks that a run calls it."""
    from fairseq_fsdp2.optimizer.moments.blockwise_8bit import kept_state, release_workspaces
    from fairseq_fsdp2.optimizer.moments.stochastic_round import to_bf16_stochastic

    def work() -> None:
        quantize(torch.randn(4, 512), True, torch.Generator().manual_seed(1))
        to_bf16_stochastic(torch.randn(1000), torch.Generator().manual_seed(2))

    release_workspaces()
    other = threading.Thread(target=work)  # kept referenced: its buffers stay while it does
    other.start()
    other.join()
    work()
    # a workspace and draws per thread; one table (signed moments' on the CPU), shared
    assert kept_state() == {"workspaces": 2, "draws": 2, "tables": 1}, kept_state()
    release_workspaces()
    assert kept_state() == {"workspaces": 0, "draws": 0, "tables": 0}, kept_state()


#: calls each thread makes at once with the other
ROUNDS = 8


def test_threads_rounding_at_once_get_what_each_would_alone():
    """Two threads quantizing to 8 bits and rounding to bf16 at the same time (as two
    optimizers stepping in one process; the kernel runs without the GIL): each gets, bit for
    bit, what the same call gives alone, every one of ROUNDS times. Each thread keeps its own
    CPU buffers between calls (blockwise_8bit._Workspace, stochastic_round's draws); were they
    shared, one thread's draws or quotients would be written over by the other's while it
    reads them. Tensors of 3 quantize chunks each (CPU_CHUNK elements), so every call refills
    the buffers several times."""
    rows, row = 3 * CPU_CHUNK // 1000, 1000
    inputs = [torch.randn(rows, row, generator=torch.Generator().manual_seed(i)) for i in (0, 1)]

    def rounded(i: int):
        codes, absmax = quantize(inputs[i], True, torch.Generator().manual_seed(10 + i))
        bf16 = to_bf16_stochastic(inputs[i].clone(), torch.Generator().manual_seed(20 + i))
        return codes, absmax, bf16

    alone = [rounded(i) for i in (0, 1)]
    start = threading.Barrier(2)
    results: dict = {0: [], 1: []}

    def work(i: int) -> None:
        start.wait()
        for _ in range(ROUNDS):
            results[i].append(rounded(i))
    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        assert len(results[i]) == ROUNDS
        for got in results[i]:
            for name, a, b in zip(("codes", "block maxima", "bf16"), got, alone[i]):
                assert torch.equal(a, b), f"thread {i}: its {name} are not what it gets alone"
