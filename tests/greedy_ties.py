"""fairseq's ``--eval-bleu`` validation replayed on two runs' saved weights, to say where their
BLEU can be compared.

Two runs whose gradients are summed in other orders end with weights a few roundings apart
(under Adam some elements far more: tests/numerics.py), so their log-probabilities differ in the
last digits. Greedy decoding takes the arg-max at every step: where a step's two best tokens are
that close, the runs may choose differently, and BLEU, a discontinuous function of the choices,
may differ by a whole n-gram. Which CPU meets such a near tie is chance. So BLEU is compared
exactly only at validation points where both runs' weights decode every sentence alike; where a
sentence is decoded otherwise, the first step that differs must be a near tie: each run's margin
for its own token over the other's within what two runs' log-probabilities can differ by
(``tie_bound``). Anything else (other weights, another decoding) fails.

The replay runs fairseq's own validation step on each saved checkpoint (the task's
``valid_step`` with its sequence generator, the same batches, ``reduce_metrics``) and must give
the BLEU the run logged at that update: then its decodings are the ones the run scored.
"""
from __future__ import annotations

from pathlib import Path

import torch
from fairseq import checkpoint_utils, metrics, utils

from numerics import FP32_REORDERED, U32


def checkpoints_by_update(save_dir: Path) -> dict[int, Path]:
    """The checkpoint files a run saved (interval and epoch saves), by the update each holds
    (validation comes right before the save)."""
    found = {}
    for path in sorted(save_dir.glob("checkpoint*.pt")):
        if "best" in path.name or "last" in path.name or "consolidated" in path.name:
            continue
        state = torch.load(path, map_location="cpu", weights_only=True)
        found[state["optimizer_history"][-1]["num_updates"]] = path
    return found


class Replay:
    """One checkpoint validated as fairseq validates during training: ``bleu`` and each
    sentence's greedy tokens (``hyps``: sample id -> tokens)."""

    def __init__(self, path: Path):
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)])
        self.model, self.task = models[0].eval(), task
        task.load_dataset("valid")
        criterion = task.build_criterion(cfg.criterion)
        self.hyps: dict[int, torch.Tensor] = {}
        batches = task.get_batch_iterator(
            dataset=task.dataset("valid"), max_tokens=cfg.dataset.max_tokens_valid,
            max_sentences=cfg.dataset.batch_size_valid,
            max_positions=utils.resolve_max_positions(task.max_positions(),
                                                      self.model.max_positions()),
            ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
            required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
            seed=cfg.common.seed).next_epoch_itr(shuffle=False)
        inference_step, outputs, self.samples = task.inference_step, [], {}

        def recording(generator, models, sample, prefix_tokens=None):
            out = inference_step(generator, models, sample, prefix_tokens=prefix_tokens)
            for i, sid in enumerate(sample["id"].tolist()):
                self.hyps[sid] = out[i][0]["tokens"]
                self.samples[sid] = (sample["net_input"]["src_tokens"][i],
                                     sample["net_input"]["src_lengths"][i])
            return out
        task.inference_step = recording  # this task object only, to record what it decodes
        with torch.no_grad():
            for sample in batches:
                outputs.append(task.valid_step(sample, self.model, criterion)[2])
        with metrics.aggregate(new_root=True) as agg:
            task.reduce_metrics(outputs, criterion)
            self.bleu = agg.get_smoothed_values()["bleu"]

    def log_probs(self, sid: int, prefix: torch.Tensor) -> torch.Tensor:
        """Teacher-forced log-probabilities of the token after ``prefix`` for sentence sid."""
        src, length = self.samples[sid]
        eos = self.task.target_dictionary.eos()
        prev = torch.cat([prefix.new_tensor([eos]), prefix]).unsqueeze(0)
        with torch.no_grad():
            out = self.model(src.unsqueeze(0), length.view(1), prev)
            return self.model.get_normalized_probs(out, log_probs=True)[0, -1].float()


def tie_bound(lp: torch.Tensor, width: int) -> float:
    """How far apart two runs' log-probabilities of one token can be, summed over the two
    tokens of a tie: each within FP32_REORDERED relative (the bound the runs' losses, sums of
    such log-probabilities, are compared with), twice; plus the rounding between the generator's
    incremental step and this teacher-forced one, each a float32 dot product of ``width`` terms
    and a log-softmax over the vocabulary: (width + vocab) x U32 of the largest magnitude, for
    each of the two runs."""
    top = lp.abs().max().item()
    return 2 * FP32_REORDERED * top + 2 * (width + lp.numel()) * U32 * top


def divergences(a: Replay, b: Replay) -> list[str]:
    """The sentences a and b decode otherwise, each checked to be a near tie at the first step
    that differs (AssertionError otherwise); a description of each."""
    assert set(a.hyps) == set(b.hyps)
    found, width = [], a.model.decoder.embed_dim
    for sid in sorted(a.hyps):
        x, y = a.hyps[sid], b.hyps[sid]
        if torch.equal(x, y):
            continue
        k = next(i for i in range(min(len(x), len(y))) if x[i] != y[i])
        lp_a, lp_b = a.log_probs(sid, x[:k]), b.log_probs(sid, y[:k])
        i, j = x[k].item(), y[k].item()
        margins = (lp_a[i] - lp_a[j]).item(), (lp_b[j] - lp_b[i]).item()
        bound = max(tie_bound(lp_a, width), tie_bound(lp_b, width))
        assert max(margins) <= bound, (f"sentence {sid} step {k}: tokens {i} vs {j}, margins "
                                       f"{margins} beyond a near tie ({bound:.2e})")
        found.append(f"sentence {sid} step {k} (margins {margins[0]:.1e}, {margins[1]:.1e})")
    return found
