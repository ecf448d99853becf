"""Work done a chunk at a time, so that its temporaries stay small whatever a tensor's size: the
budgets of every such loop side by side (what each allows at once), and the rows of a chunk
from a budget (``rows_per_chunk``). Each module that chunks binds its budget under its own name
beside the reason for its size (the names in brackets below).
"""
from __future__ import annotations

#: Adam's step a chunk of rows at a time, in elements (optimizer/row_chunk_step.py, STEP_CHUNK)
STEP_ELEMENTS = 1 << 22
#: 8-bit moments quantized and dequantized a chunk of rows at a time, in elements
#: (optimizer/moments/blockwise_8bit.py): on CPU (CPU_CHUNK), on a GPU (CUDA_CHUNK), and the
#: chunk the estimator allows for (CHUNK)
QUANTIZE_CPU_ELEMENTS = 1 << 18
QUANTIZE_CUDA_ELEMENTS = 1 << 22
QUANTIZE_ESTIMATED_ELEMENTS = 1 << 21
#: bf16's stochastic rounding, elements per batch of random integers
#: (optimizer/moments/stochastic_round.py, CHUNK)
ROUND_ELEMENTS = 1 << 20
#: the fused loss's logits widened to float32 at once, in elements (criterions/fused.py,
#: FLOAT_ELEMENTS)
LOSS_FLOAT_ELEMENTS = 1 << 23
#: the tied embedding's early reduce-scatter input, in bytes (sharding/tied_grad_reduce.py,
#: ROW_CHUNK_BYTES)
TIED_REDUCE_BYTES = 64 * 2 ** 20


def rows_per_chunk(row: int, budget: int, unit: int = 1) -> int:
    """Rows of ``row`` elements (or bytes) each that fit in ``budget`` at once, a multiple of
    ``unit`` rows and at least ``unit`` (one row by default), however large a row is."""
    return max(unit, budget // max(row, 1) // unit * unit)
