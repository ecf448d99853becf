"""fairseq-train with the allocator read alongside the plugin's memory monitor (tests/test_cuda.py):
at every log, before the monitor reads and resets the peak, print the allocator's own figures
(``ALONGSIDE {json}``). Arguments: fairseq-train's."""
import functools
import json

import torch

import fairseq_fsdp2  # noqa: F401  (the plugin, as --user-dir loads it)
from fairseq_fsdp2.memory.monitor import MemoryMonitor


def retries() -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


def main() -> None:
    init, log = MemoryMonitor.__init__, MemoryMonitor.log

    @functools.wraps(init)
    def traced_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.retries_start = retries()  # the monitor's own first reading, just taken

    @functools.wraps(log)
    def traced_log(self, num_updates):
        print("ALONGSIDE " + json.dumps({
            "update": num_updates, "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(), "retries_total": retries(),
            "retries_start": self.retries_start}), flush=True)
        return log(self, num_updates)

    MemoryMonitor.__init__, MemoryMonitor.log = traced_init, traced_log
    from fairseq_cli.train import cli_main
    cli_main()


if __name__ == "__main__":
    main()
