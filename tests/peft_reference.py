"""The PEFT side of tests/test_lora.py: a program run in its own process with the test-only
transformers and peft on its path (never in the pytest process or the fairseq ranks; the test
forks it from the test server, ``python -m peft_reference`` with tests/ on the path).

    python peft_reference.py BASE_HF_DIR ADAPTER_DIR REQUEST.json RESULT.json
        load BASE_HF_DIR with transformers' M2M100ForConditionalGeneration.from_pretrained, the
        adapters with peft.PeftModel.from_pretrained, and compute in eval mode the ``logits``
        of ``src`` (left-padded with 1) / ``prev``, in float32 and in float64 (``logits64``:
        the model converted with ``.double()``); ``lora_modules``: how many modules PEFT
        adapted, ``lora_B_abs_sum``: the loaded B matrices' absolute sum (zero if not loaded).
"""
import copy
import json
import sys
from pathlib import Path

import torch


def main(base: str, adapter: str, request: dict) -> dict:
    from peft import PeftModel
    from transformers import M2M100ForConditionalGeneration

    model = M2M100ForConditionalGeneration.from_pretrained(base)
    model = PeftModel.from_pretrained(model, adapter).eval()
    result = {"lora_modules": sum(1 for n, _ in model.named_modules()
                                  if n.endswith(".lora_A.default")),
              "lora_B_abs_sum": sum(p.abs().sum().item() for n, p in model.named_parameters()
                                    if "lora_B" in n)}
    src = torch.tensor(request["src"])
    for key, m in (("logits", model), ("logits64", copy.deepcopy(model).double())):
        with torch.no_grad():
            out = m(input_ids=src, attention_mask=src.ne(1).long(),
                    decoder_input_ids=torch.tensor(request["prev"]))
        result[key] = out.logits.tolist()  # json writes float64 values exactly (repr)
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    base_dir, adapter_dir, req, res = sys.argv[1:]
    Path(res).write_text(json.dumps(main(base_dir, adapter_dir, json.loads(Path(req).read_text()))))
