"""What a moment format is: the interface every format of Adam's moments implements (fp32.py,
sixteen_bit.py, eight_bit.py), and the layout helpers they share.

A format stores a moment (``exp_avg`` or ``exp_avg_sq``) between steps as a tensor of its
``dtype`` shaped like the parameter, and maybe a tensor beside it under a state key of its own
(its ``side``: fp16's scale, 8 bits' block maxima). The step (optimizer/adam_stats.py,
optimizer/row_chunk_step.py) asks the format to ``widen`` what it stores to float32 for
fairseq's Adam and to ``narrow`` Adam's float32 result back, a chunk of rows at a time or a
whole tensor at a time; it never looks at a dtype or a side key itself (tests/test_layout.py
checks). The estimator (estimator/ledger.py) reads what a format costs from the same object:
the bytes it keeps (``element_bytes``, ``moment_bytes``) and the temporaries of its step
(``widened_bytes``, ``narrow_bytes``).

Tensors given to ``widen`` and ``narrow`` are a rank's local tensors (the production path), or
DTensors (the DTensor-dispatch reference, ``local_shards=False``): a format whose conversion is
plain tensor arithmetic lets DTensor dispatch run it (fp16, as fairseq writes it); one that
draws random numbers or works in blocks of a row runs it on the local shard and returns a
DTensor laid out as it was given.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.distributed.tensor import DTensor

#: Adam's two moments, in the order their random streams are numbered
MOMENTS = ("exp_avg", "exp_avg_sq")


def like(local: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``local`` as the DTensor ``template`` is (its mesh, placements, global shape); a plain
    tensor where ``template`` is one."""
    if not isinstance(template, DTensor):
        return local
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def shard_dims(p: torch.Tensor) -> list[int]:
    """The mesh dimensions ``p`` is sharded on (none for a plain tensor)."""
    return [d for d, pl in enumerate(p.placements) if pl.is_shard()] \
        if isinstance(p, DTensor) else []


def rows_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a plain tensor or sharded on dim 0 only (FSDP2's default): then each
    row lies on one rank."""
    return not isinstance(p, DTensor) or all(
        not pl.is_shard() or pl.dim == 0 for pl in p.placements)


class MomentFormat:
    """One way of storing a moment between steps. Subclasses set the attributes and override
    what differs; tests/test_moment_formats.py checks every registered format has them all."""

    #: the format's name: settings.MOMENT_FORMATS, the flags' value (--bf16-adam-stats: bf16)
    name: str = ""
    #: what a moment element is stored as
    dtype: torch.dtype = torch.float32
    #: the state key of each moment's side tensor (fp16's scale, 8 bits' block maxima), if any
    side_keys: dict[str, str] = {}
    #: bytes a stored element takes where that is the same for every parameter, else None
    #: (``moment_bytes`` then tells, by shape)
    element_bytes: Optional[int] = 4
    #: float32 bytes an element of a moment takes while it steps, widened (0: stepped where it
    #: is stored)
    widened_bytes: int = 0
    #: whether a chunk of rows narrows on its own (fp16's scale is its whole tensor's maximum:
    #: no), so the row-chunked step can store it (settings.step_takes_16_bit_grads agrees)
    narrows_rows: bool = True
    #: whether narrowing rounds stochastically, from a generator the step gives it
    draws: bool = False

    def side_key(self, key: str) -> Optional[str]:
        """The state key of moment ``key``'s side tensor, or None."""
        return self.side_keys.get(key)

    def for_parameter(self, p: torch.Tensor) -> "MomentFormat":
        """The format parameter ``p``'s moments take in a run of this format (8 bits: float32
        for a parameter too small, or not sharded by rows)."""
        return self

    def widen(self, stored: torch.Tensor, side: Optional[torch.Tensor], key: str,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The float32 values of ``stored`` (with its ``side``): into ``out`` where given (a
        float32 tensor of stored's shape), else a new tensor (a float32 ``stored`` itself,
        for formats stepped where they are stored)."""
        raise NotImplementedError

    def narrow(self, wide: torch.Tensor, key: str, generator: Optional[torch.Generator] = None,
               dest: Optional[torch.Tensor] = None, side: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Adam's float32 ``wide`` stored in this format: (the stored tensor, its side), into
        ``dest`` where given. ``side``: fp16's scale, decided for the whole tensor beforehand
        (``whole_sides``); 8 bits' block maxima are written into it where given. ``wide`` may
        be used as scratch space. ``generator``: the stream stochastic rounding draws from."""
        raise NotImplementedError

    def whole_sides(self, wides: Sequence[torch.Tensor], template: torch.Tensor,
                    local_shards: bool) -> list[Optional[torch.Tensor]]:
        """The side each of ``wides`` (whole moments of parameters laid out as ``template``)
        is narrowed with, decided over whole tensors before narrowing (fp16's scales); None
        for formats that decide nothing beforehand."""
        return [None] * len(wides)

    def empty(self, local: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A new stored tensor and side for a moment of the local tensor ``local`` (the row-
        chunked step narrows into them a chunk of rows at a time)."""
        return torch.empty(local.shape, dtype=self.dtype, device=local.device), None

    def side_rows(self, side: Optional[torch.Tensor], a: int, b: int) -> Optional[torch.Tensor]:
        """What of ``side`` belongs to rows a:b of the moment (a scale: all of it)."""
        return side

    def laid_out(self, stored: torch.Tensor, side: Optional[torch.Tensor], p: torch.Tensor
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Local ``stored`` and ``side`` as the state keeps them: DTensors laid out like the
        parameter ``p`` (and its rows); what is a DTensor already stays as it is."""
        if not isinstance(stored, DTensor):
            stored = like(stored, p)
        return stored, side

    def placeholder(self, value: torch.Tensor) -> Optional[torch.Tensor]:
        """A side tensor for moment ``value`` (laid out like it) that a checkpoint's DCP load
        fills (fit_saved_state.py); None for formats without one."""
        return None

    def moment_bytes(self, shape: Sequence[int], rows: int) -> int:
        """Bytes one moment keeps for ``rows`` rows of a parameter of (whole) ``shape``."""
        row = 1
        for n in shape[1:]:
            row *= n
        return self.element_bytes * rows * row

    def narrow_bytes(self, elements: int) -> int:
        """Bytes of temporaries while narrowing a chunk of ``elements`` (besides its values)."""
        return 0
