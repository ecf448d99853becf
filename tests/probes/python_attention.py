"""fairseq-train whose attention modules all take fairseq's own Python path (``torch.bmm``,
softmax, ``torch.bmm``) instead of PyTorch's fused ``F.multi_head_attention_forward``, as the
attention modules of a LoRA run do (models/lora.py sets fairseq's ``skip_embed_dim_check``):
a full fine-tune whose forward makes the float32 operations of a LoRA run whose adapters are
still zero (tests/test_lora.py compares their first losses)."""
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq_cli.train import cli_main


def on_the_python_path(init):
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.skip_embed_dim_check = True
    return __init__


if __name__ == "__main__":
    MultiheadAttention.__init__ = on_the_python_path(MultiheadAttention.__init__)
    cli_main()
