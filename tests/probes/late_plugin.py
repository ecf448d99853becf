"""A Python program that passes ``--user-dir fairseq_fsdp2 --ddp-backend fsdp2`` in a list to a
parser it built before loading the plugin, then follows the one line's advice: prints
``LATE <json>`` (what the first parse raised, what the second parsed); tests/test_in_process.py.

argv[1]: the plugin's directory; argv[2]: a data directory.
"""
import json
import sys

from fairseq import options


def parse(plugin: str, data: str):
    return options.parse_args_and_arch(options.get_training_parser(), [
        data, "--user-dir", plugin, "--ddp-backend", "fsdp2", "--arch", "transformer",
        "--task", "translation", "--fsdp2-root-reshard", "always"])


def main() -> None:
    plugin, data = sys.argv[1:3]
    try:
        parse(plugin, data)
        first = None
    except Exception as e:  # noqa: BLE001 - reported for the test
        first = {"type": type(e).__name__, "message": str(e)}
    import fairseq_fsdp2  # noqa: F401  (the advice)
    args = parse(plugin, data)
    print("LATE " + json.dumps({"first": first, "backend": args.ddp_backend,
                                "root_reshard": args.fsdp2_root_reshard}), flush=True)


if __name__ == "__main__":
    main()
