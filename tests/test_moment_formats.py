"""Every moment format (optimizer/moments/) implements the whole interface, the registry holds
the formats the flags name (settings.MOMENT_FORMATS), the settings' rules about formats agree
with what the formats say of themselves, and what a format says it costs (the estimator reads
it: estimator/ledger.py) is what it stores. Cheap: small tensors in one process, no training.
tests/test_layout.py checks that nothing outside the folder bypasses the formats; the step's
bits are checked by tests/test_row_chunk_step.py, test_local_shards.py and test_adam_stats*.py.
"""
from __future__ import annotations

import pytest
import torch

from fairseq_fsdp2 import settings
from fairseq_fsdp2.optimizer import moments
from fairseq_fsdp2.optimizer.moments.format import MOMENTS, MomentFormat
from fairseq_fsdp2.optimizer.moments.stochastic_round import generator_for

#: a parameter large enough for 8 bits (blocks of 256 and a last of 44 in each row)
SHAPE = (24, 300)


def test_the_registry_holds_the_formats_the_flags_name():
    assert tuple(moments.FORMATS) == settings.MOMENT_FORMATS
    assert all(moments.named(name).name == name for name in settings.MOMENT_FORMATS)
    # each stored dtype tells its format (stored_format reads a state by it)
    assert len({f.dtype for f in moments.FORMATS.values()}) == len(moments.FORMATS)


def overrides(fmt: MomentFormat, method: str) -> bool:
    return getattr(type(fmt), method) is not getattr(MomentFormat, method)


@pytest.mark.parametrize("name", settings.MOMENT_FORMATS)
def test_every_format_implements_the_whole_interface(name):
    """Each attribute set and of its kind; widen and narrow its own (the base has none); a
    format with side keys fills them on a checkpoint's load (``placeholder``), and one whose
    bytes depend on the shape says how (``moment_bytes``)."""
    fmt = moments.named(name)
    assert isinstance(fmt, MomentFormat) and fmt.name == name
    assert isinstance(fmt.dtype, torch.dtype)
    assert isinstance(fmt.side_keys, dict) and set(fmt.side_keys) in (set(), set(MOMENTS))
    if fmt.element_bytes is None:
        assert overrides(fmt, "moment_bytes")
    else:
        assert fmt.element_bytes == torch.empty((), dtype=fmt.dtype).element_size()
    assert fmt.widened_bytes in (0, 4)  # float32, or stepped where stored
    assert isinstance(fmt.narrows_rows, bool) and isinstance(fmt.draws, bool)
    assert overrides(fmt, "widen") and overrides(fmt, "narrow")
    if fmt.side_keys:
        assert overrides(fmt, "placeholder")


@pytest.mark.parametrize("name", settings.MOMENT_FORMATS)
def test_the_settings_rules_agree_with_the_formats(name):
    """settings.step_takes_16_bit_grads decides by a format's name that its rows narrow on
    their own (the row-chunked step stores it); row_chunked_step that a format other than
    fp32 is widened at every step."""
    fmt = moments.named(name)
    assert settings.step_takes_16_bit_grads("adam", name, amsgrad=False) == fmt.narrows_rows
    assert settings.row_chunked_step(True, name, narrow_grads=False) == \
        bool(fmt.widened_bytes)


@pytest.mark.parametrize("name", settings.MOMENT_FORMATS)
def test_each_format_stores_what_it_says_and_reads_it_back(name):
    """Narrowed whole and a chunk of rows at a time into ``empty``'s tensors (from the same
    stream: the same bits where rows narrow on their own), the state holds the format's dtype
    and side keys, ``stored_format`` tells the format from the state, ``moment_bytes`` is
    what it stores (fp16's scalar scale aside), and ``widen`` gives the values back within
    the format's rounding: bf16 keeps 8 significant bits, rounded stochastically to one of
    its two neighbours: under one unit in the last place, 2^-7 of the value; fp16 11, rounded
    to nearest: half a unit, 2^-11, where the scaled value is normal (fp16's smallest normal
    is 2^-14 and the largest scaled value 65504: this sample's smallest magnitude is far above
    2^-14 / 65504 of its largest), and the float32 division and product by the scale add
    2^-24 each; 8 bits: one gap of the map
    (stochastic), at most 0.9 / 64 of the block's maximum (the row's bounds it), and the
    float32 product by it 2^-24 more."""
    fmt, p = moments.named(name), torch.zeros(SHAPE)
    fmt_p = fmt.for_parameter(p)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    for k, key in enumerate(MOMENTS):
        value = x.abs() if key == "exp_avg_sq" else x.clone()
        side = fmt_p.whole_sides([value.clone()], p, local_shards=True)[0]
        gen = generator_for(torch.device("cpu"), k) if fmt_p.draws else None
        stored, new_side = fmt_p.narrow(value.clone(), key, gen, side=side)
        state = {key: stored}
        if fmt_p.side_key(key):
            state[fmt_p.side_key(key)] = new_side
        assert stored.dtype == fmt_p.dtype and stored.shape == value.shape
        assert moments.stored_format(state, key) is fmt_p
        side_bytes = new_side.nbytes if new_side is not None and new_side.dim() else 0
        assert fmt_p.moment_bytes(SHAPE, SHAPE[0]) == stored.nbytes + side_bytes
        wide = fmt_p.widen(stored, new_side, key)
        assert wide.dtype == torch.float32
        if not fmt_p.widened_bytes:
            assert wide is stored  # stepped where it is stored
        relative = {"bf16": 2 ** -7, "fp16": 2 ** -11 + 2 ** -23}.get(fmt_p.name)
        if fmt_p.name == "fp32":
            assert torch.equal(wide, value)
        elif relative:
            assert ((wide - value).abs() <= relative * value.abs()).all()
        else:
            blocks = value.view(SHAPE[0], -1, 1)  # loose: the row's maximum bounds its blocks'
            bound = 0.9 / 64 * (1 + 2 ** -23) * blocks.abs().amax(1)
            assert ((wide - value).abs() <= bound).all()
        if fmt_p.narrows_rows:  # a chunk of rows at a time, into empty()'s tensors
            dest, dest_side = fmt_p.empty(p)
            gen = generator_for(torch.device("cpu"), k) if fmt_p.draws else None
            for a in range(0, SHAPE[0], 8):
                fmt_p.narrow(value[a:a + 8].clone(), key, gen, dest=dest[a:a + 8],
                             side=fmt_p.side_rows(dest_side, a, a + 8))
            assert torch.equal(dest, stored)
            if new_side is not None:
                assert torch.equal(dest_side, new_side)
