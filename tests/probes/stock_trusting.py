"""Stock fairseq-train, without the plugin, reading stock checkpoints the test itself wrote: test
code, the reference side of a comparison.

torch >= 2.6 loads with ``weights_only=True``, which refuses what stock fairseq pickles (the
argparse Namespace of legacy configs, numpy values of --eval-bleu's meters): stock fairseq cannot
read its own files on this torch. The plugin allow-lists those classes, but a reference run that
loaded the plugin would also run its other global patches (atomic copies, the parse and
call_main wrappers, checkpoint reading), and a bug in them would then cancel out of the
comparison. So this runs ``python -m fairseq_cli.train`` with nothing of the plugin, after
allow-listing exactly the globals of the files named in ``TRUSTED_CHECKPOINTS``
(``os.pathsep``-separated; files the test's own stock runs wrote), torch's documented way for a
trusted file (``get_unsafe_globals_in_checkpoint``, then ``add_safe_globals``, and the classes
torch's refusal names). Given several
ranks, stock fairseq reads a checkpoint on rank 0 and sends the state to the others through
torch.save/torch.load with the objects it made of it (OmegaConf's config, its own placeholders):
``--load-checkpoint-on-all-dp-ranks`` (stock fairseq's option, the same state on every rank)
has each rank read the trusted file itself instead.
"""
import os
import pickle
import pkgutil
import re
import runpy
import sys

import torch


#: the object a pickled global ``module.qualname`` names
resolve = pkgutil.resolve_name


def allow_globals_of(path: str, attempts: int = 50) -> list[str]:
    """Allow-list what ``path`` needs to load with ``weights_only=True``: the globals it names,
    then each class torch still refuses to build (a numpy dtype's class, made by calling the
    allowed ``numpy.dtype``, is not a global of the file), until it loads."""
    names = list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    torch.serialization.add_safe_globals([resolve(n) for n in names])
    for _ in range(attempts):
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return names
        except pickle.UnpicklingError as e:
            refused = re.search(r"but got <class '([\w.]+)'>|GLOBAL ([\w.]+) was not", str(e))
            if refused is None:
                raise
            names.append(refused.group(1) or refused.group(2))
            torch.serialization.add_safe_globals([resolve(names[-1])])
    raise RuntimeError(f"{path}: still refused after allowing {names}")


if __name__ == "__main__":
    assert "--user-dir" not in sys.argv, "the reference run takes no plugin"
    for trusted in os.environ["TRUSTED_CHECKPOINTS"].split(os.pathsep):
        allow_globals_of(trusted)
    sys.argv.append("--load-checkpoint-on-all-dp-ranks")
    try:
        runpy.run_module("fairseq_cli.train", run_name="__main__", alter_sys=True)
    finally:
        assert "fairseq_fsdp2" not in sys.modules, "the plugin was imported"
