"""fairseq-train with one more architecture, ``transformer_tied_layers``: fairseq's transformer
whose first two encoder layers share one fc1 weight, a tie that crosses two layer units (the
plugin must refuse it: sharding the layers apart would untie it). Test code, run with
``python -m tied_layers`` (tests/probes on PYTHONPATH) and fairseq-train's arguments."""
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel, base_architecture


@register_model("transformer_tied_layers")
class TransformerTiedLayers(TransformerModel):
    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        layers = model.encoder.layers
        layers[1].fc1.weight = layers[0].fc1.weight
        return model


@register_model_architecture("transformer_tied_layers", "transformer_tied_layers")
def tied_layers_architecture(args):
    base_architecture(args)


if __name__ == "__main__":
    from fairseq_cli.train import cli_main
    cli_main()
