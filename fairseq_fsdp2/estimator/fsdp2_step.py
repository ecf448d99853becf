"""The step simulator of the memory estimator: one training step of FSDP2 on one rank, replayed
on a ledger of live bytes per category (rules: peak.py; the ledger: ledger.py; fairseq's
legacy_ddp: ddp_step.py)."""
from __future__ import annotations

from typing import Optional

from ..sharding.plan import LAYER, ROOT
from ..criterions.fused import chunk_bytes
from ..sharding.tied_grad_reduce import INDEX_BYTES, buffer_is_input, chunk_rows, sparse_fits
from .ledger import (Ledger, Setup, optimizer_state_bytes, shard_rows, step_temporary_bytes,
                     unit_sizes, weight_bytes)
from .lora import trained_sizes
from .model_profile import ModelProfile


class _FSDP2Step:
    """One training step of FSDP2 (torch 2.13) on one rank, simulated on a ledger.

    The all-gather rules it follows: an all-gather writes a flat output buffer, which is copied
    out into the unsharded parameters; in forward (more than one rank) FSDP2 keeps that buffer
    until the next forward copy-out or the end of the model's forward, in backward it frees it
    at once. The backward of a unit prefetches the unit before it in forward order. A unit's
    gradients are copied into a reduce-scatter input buffer in the reduce dtype (fp32, or the
    compute dtype with --fsdp2-reduce-dtype fp16/bf16), kept until the next reduce-scatter or
    the end of backward. The reduce-scatter's output (this rank's shard) is the sharded
    gradient, cast to fp32 unless it stays in the 16-bit reduce dtype (sharding/
    sixteen_bit_grads.py). With one rank, "all-gather" is a copy.
    """

    def __init__(self, profile: ModelProfile, setup: Setup, rank: int):
        self.p, self.s, self.rank = profile, setup, rank
        self.trace = profile.trace_for(setup.device)
        self.c = profile.compute_bytes
        # bytes per element of the reduce-scatter input and output (FSDP2's reduce dtype)
        self.rb = self.c if setup.reduce_dtype != "fp32" else 4
        # bytes per element of a trained parameter's shard (fp32 masters, or bf16 weights) and of
        # its gradient shard (the 16-bit reduce output kept, or the parameter's dtype)
        self.wb = weight_bytes(setup)
        self.gb = self.rb if setup.narrow_grads else self.wb
        self.shards = setup.world_size // setup.replicate_degree
        self.units = {u.name: u for u in profile.units}
        self.local, self.padded, self.unit_largest = {}, {}, {}
        for u in profile.units:
            self.local[u.name], self.padded[u.name], self.unit_largest[u.name] = unit_sizes(
                u, self.shards, rank)
        self.largest = max(self.unit_largest.values(), default=0)
        self.full = {n: self.padded[n] * self.c for n in self.units}
        # what trains (LoRA: the adapters; lora.py), and the frozen rest's sharded elements
        lora = trained_sizes(profile, self.shards, rank)
        self.frozen_local = lora.frozen_local if lora else {n: 0 for n in self.units}
        self.grad_local = lora.local if lora else self.local
        self.grad_padded = lora.padded if lora else self.padded
        self.grad_numel = lora.numel if lora else {n: u.numel for n, u in self.units.items()}
        self.grad_largest = lora.largest if lora else self.largest
        self.trained_shapes = lora.shapes if lora else [sh for u in profile.units
                                                        for sh in u.shapes]
        self.layer_grads = lora.layer_params if lora else profile.layer_params
        self.embedding_grad = 1 if lora is None or lora.embedding_trained else 0
        self.on_device = not (setup.cpu_offload and setup.device == "cuda")
        self.led = Ledger()
        self.gathered: dict[str, int] = {}
        self.prefetched: dict[str, int] = {}
        self.retained_ag = 0
        self.retained_rs = 0
        self.post_order: list[Optional[str]] = []
        self.reduced: set[str] = set()
        self.no_backward_gather: set[str] = set()  # set_unshard_in_backward(False)
        self.shared = next((u.name for u in profile.units
                            if set(profile.output_paths) & set(u.module_paths)), ROOT)
        # the tied gradient reduced early (sharding/tied_grad_reduce.py): the projection's
        # part into the shard as backward starts, the lookups' rows kept and exchanged at its
        # end (when all ranks' rows gathered fit in the dense gradient's bytes, else densely)
        self.early = setup.tied_early_reduce and bool(self.embedding_grad)
        self.rows_kept = self.row_count = self.tied_shard = 0
        self.folded = False  # a rank's rows alone past the rule: added into a dense buffer
        V, d = profile.vocab, profile.embed_dim
        self.sparse = sparse_fits(setup.world_size * 2 * profile.workload.tokens, d, self.c, V)

    # -- FSDP2's operations -------------------------------------------------------------------
    def unshard(self, name: str, why: str, forward: bool) -> None:
        full, have = self.full[name], self.gathered.get(name, 0)
        if have >= full or (not forward and name in self.no_backward_gather):
            return
        led = self.led
        if self.shards == 1:
            led.moment(why, gathered=full - have)
        else:
            ag = self.prefetched.pop(name, 0)
            if not ag:
                ag = full
                led.add("comm", ag)  # all-gather output buffer
            if forward and self.retained_ag:
                # the previous unit's buffer is freed once this all-gather is waited for
                led.moment(f"{why} (buffer)")
                led.sub("comm", self.retained_ag)
                self.retained_ag = 0
            led.moment(why, gathered=full - have)  # copy-out: buffer and parameters alive
            if forward:
                self.retained_ag = ag
            else:
                led.sub("comm", ag)
        led.add("gathered", full - have)
        self.gathered[name] = full

    def reshard(self, name: str, keep_fraction: float = 0.0) -> None:
        have = self.gathered.get(name, 0)
        keep = int(self.full[name] * keep_fraction)
        if have > keep:
            self.led.sub("gathered", have - keep)
            self.gathered[name] = keep

    def post_forward(self, name: str) -> None:
        setting = self.units[name].reshard
        if setting is True:
            self.reshard(name)
        elif isinstance(setting, int) and not isinstance(setting, bool) and setting > 1:
            self.reshard(name, 1.0 / setting)
        self.post_order.append(name)

    def prefetch_before(self, name: str) -> None:
        """Backward prefetch: all-gather the unit before ``name`` in post-forward order."""
        idx = next((i for i in range(len(self.post_order) - 1, -1, -1)
                    if self.post_order[i] == name), None)
        if idx is None:
            return
        self.post_order[idx] = None  # this use is consumed
        target = next((self.post_order[j] for j in range(idx - 1, -1, -1)
                       if self.post_order[j] is not None), None)
        if target is None or self.gathered.get(target, 0) >= self.full[target] \
                or target in self.prefetched or target in self.no_backward_gather:
            return
        if self.shards == 1:
            self.unshard(target, f"backward: prefetch {target}", forward=False)
            return
        self.led.moment(f"backward: prefetch {target}", comm=self.full[target])
        self.led.add("comm", self.full[target])
        self.prefetched[target] = self.full[target]

    def reduce_scatter(self, name: str, grad_bytes: int, in_ledger: bool,
                       less: tuple[int, int] = (0, 0)) -> None:
        """``less``: (padded, local) elements FSDP2 does not reduce here (the tied weight
        reduced early)."""
        led = self.led
        led.sub("comm", self.retained_rs)  # the previous input buffer is released first
        self.retained_rs = 0
        rs_input = (self.grad_padded[name] - less[0]) * self.rb
        # A unit reduced at the end of backward (the root, the shared embedding) still holds
        # its unsharded gradients while FSDP2 allocates the reduce-scatter output (measured at
        # NLLB-600M: gradient, input and output of the shared unit alive at once); a layer's
        # gradients are freed after the copy-in, before the output is allocated. An output in
        # another dtype than the sharded gradient's (16 bits to fp32 masters' gradient, fp32 to
        # bf16 weights') is then cast, both alive at the cast.
        cast = self.gb if self.rb != self.gb else 0
        local = self.grad_local[name] - less[1]
        output = local * (self.rb + cast) if self.on_device else 0
        led.moment(f"backward: reduce-scatter {name}", comm=rs_input,
                   grads=output if in_ledger else grad_bytes)
        if not in_ledger and cast and output > grad_bytes:
            led.moment(f"backward: reduce-scatter {name} (output cast to "
                       f"{'fp32' if self.gb == 4 else 'bf16'})",
                       comm=rs_input, grads=output)
        if in_ledger:
            led.sub("grads", grad_bytes)  # unsharded gradients dropped after the copy-in
        led.add("comm", rs_input)
        self.retained_rs = rs_input
        if self.on_device and self.s.step_in_backward:
            # stepped at once, a parameter at a time, each gradient shard freed once stepped
            # (optimizer/step_in_backward.py): the unit's shards and the step's temporaries
            # of its largest parameter, then nothing kept
            big = min(self.unit_largest[name], self.grad_largest)
            led.moment(f"backward: {name} stepped in backward", grads=local * self.gb,
                       optim=step_temporary_bytes(self.s, big, big))
        elif self.on_device:  # the sharded gradient: fp32, the 16-bit output kept, or bf16
            led.add("grads", local * self.gb)
        self.reduced.add(name)
        self.reshard(name)

    def tied_reduce(self, why: str, dense_bytes: int) -> None:
        """The tied weight's dense gradient (in "grads", ``dense_bytes``, the compute dtype)
        reduced into this rank's shard (tied_grad_reduce.TiedShardReducer.reduce_dense): its
        own buffer the reduction's input where it is in the reduce dtype (on gloo all-reduced
        in place, the local rows copied out; on NCCL when the shards are even), else copied a
        chunk of rows at a time; then freed. The shard, in the reduce dtype, is held until the
        end of backward (the first reduce creates it, a later one adds into it)."""
        V, d, led = self.p.vocab, self.p.embed_dim, self.led
        local_rows, padded_rows = shard_rows(V, self.shards, self.rank)
        gloo = self.s.device == "cpu"
        in_place = buffer_is_input(self.c == self.rb, gloo, V, self.shards)
        out = (local_rows if in_place and gloo else padded_rows) * d * self.rb
        chunk = 0 if in_place else \
            self.shards * chunk_rows(self.shards, d, self.rb, padded_rows) * d * self.rb
        led.moment(f"{why}: tied gradient reduced early", grads=out, comm=chunk)
        led.sub("grads", dense_bytes)
        if not self.tied_shard:
            self.tied_shard = local_rows * d * self.rb
            led.add("grads", self.tied_shard)

    def tied_rows_exchanged(self) -> None:
        """The end of backward: the lookups' rows (2 x T per rank) gathered from every rank
        with their indices, concatenated, padded, and this shard's picked and added; or, when
        they do not fit the rule, a dense buffer built from them and reduced. Then the shard
        becomes the sharded gradient, cast to fp32 unless kept in the 16-bit reduce dtype."""
        p, led, c = self.p, self.led, self.c
        T, V, d = p.workload.tokens, p.vocab, p.embed_dim
        if self.sparse:
            gathered = self.s.world_size * 2 * T
            led.moment("backward: tied gradient's rows exchanged",
                       grads=2 * T * d * c + gathered * (d * c + INDEX_BYTES) + gathered * d * c)
        else:
            if not self.folded:
                led.add("grads", V * d * c)
            self.tied_reduce("backward: tied gradient's rows", V * d * c)
        led.sub("grads", self.rows_kept)
        self.rows_kept = 0
        local_rows = shard_rows(V, self.shards, self.rank)[0]
        kept = local_rows * d * self.gb
        if kept != self.tied_shard:
            led.moment(f"backward: tied gradient's shard cast to "
                       f"{'fp32' if self.gb == 4 else 'bf16'}", grads=kept)
        led.sub("grads", self.tied_shard)
        self.tied_shard = 0
        if self.s.update_freq == 1:  # else added into the gradient of the earlier micro-batches
            led.add("grads", kept)

    # -- the step ---------------------------------------------------------------------------------
    def run(self) -> Ledger:
        p, s, led, c = self.p, self.s, self.led, self.c
        T, V, d = p.workload.tokens, p.vocab, p.embed_dim
        mixed = c != 4
        elements = sum(self.grad_local.values())  # the trained shards' (fp32, or bf16)
        if self.on_device:
            led.add("sharded", elements * self.wb + sum(self.frozen_local.values()) * c)
            led.add("optim", optimizer_state_bytes(
                s, elements, self.trained_shapes, self.shards, self.rank))
            led.add("ema", elements * s.ema_bytes)  # beside the shards (trainer/ema.py)
        led.add("other", p.buffer_bytes)
        if s.update_freq > 1:  # gradients carried over from the earlier micro-batches
            if s.no_sync:
                led.add("grads", sum(self.grad_padded.values()) *
                        (4 if mixed and not s.bf16_weights else c))
            elif self.on_device:
                led.add("grads", elements * self.wb)
        self.forward()
        if s.loss_chunk_tokens > 0:
            first_accumulated = self.chunked_loss(min(s.loss_chunk_tokens, T))
        else:
            self.stock_loss()
            first_accumulated = False
        self.layers_backward(first_accumulated)
        # end of backward: the root and the units whose inputs need no gradient reduce-scatter
        if self.early:
            self.tied_rows_exchanged()
        for name in (ROOT, self.shared):
            if name in self.reduced:
                continue
            held = self.root_grads if name == ROOT else 0
            less = (0, 0)
            if name == self.shared and self.early:  # FSDP2 sees no gradient of the tied weight
                rows, padded = shard_rows(V, self.shards, self.rank)
                less = (padded * self.shards * d, rows * d)
                if self.grad_numel[name] == V * d and name != ROOT:
                    self.reduced.add(name)
                    self.reshard(name)
                    continue
            elif name == self.shared:
                held += V * d * c * self.embedding_grad
            rest = max((self.grad_numel[name] - (V * d if less[0] else 0)) * c - held, 0)
            led.add("grads", rest)
            self.reduce_scatter(name, held + rest, in_ledger=True, less=less)
        led.sub("comm", self.retained_rs)
        self.retained_rs = 0
        for name, nbytes in self.prefetched.items():
            led.sub("comm", nbytes)
        self.prefetched = {}
        for name in list(self.gathered):
            self.reshard(name)
        # optimizer step (the update's temporaries, for the largest shard; in backward already
        # but for the tied weight's shard where it was reduced early)
        optim = 0
        if self.on_device and not s.step_in_backward:
            optim = step_temporary_bytes(s, self.grad_largest, elements)
        elif self.on_device and self.early:
            rows = shard_rows(V, self.shards, self.rank)[0] * d
            optim = step_temporary_bytes(s, rows, rows) if rows else 0
        led.moment("optimizer step", optim=optim)
        return led

    def forward(self) -> None:
        p, s, led = self.p, self.s, self.led
        to_run: dict[str, set] = {}
        self.unshard(ROOT, "forward: all-gather root", forward=True)
        layer_units = [u.name for u in p.units if u.kind == LAYER]
        for kind, value in self.trace.events:
            if kind == "act":
                led.add("acts", value)
                continue
            name = p.owner.get(value)
            if name is None or name == ROOT or value not in self.units[name].module_paths:
                continue
            if kind == "enter":
                if not to_run.get(name):
                    to_run[name] = set(self.units[name].module_paths)
                self.unshard(name, f"forward: all-gather {name}", forward=True)
                if s.device == "cuda" and name in layer_units:
                    # implicit prefetch: the next layer's all-gather overlaps this layer
                    i = layer_units.index(name)
                    nxt = self.full[layer_units[i + 1]] if i + 1 < len(layer_units) else 0
                    led.moment(f"forward: {name}", comm=nxt)
            else:
                remaining = to_run.get(name, set())
                remaining.discard(value)
                if not remaining and name in to_run:
                    del to_run[name]
                    self.post_forward(name)
        self.post_forward(ROOT)
        for name in list(to_run):  # groups the forward did not complete (chunked loss)
            self.post_forward(name)
        led.sub("comm", self.retained_ag)  # the root's post-forward frees the last buffer
        self.retained_ag = 0
        led.moment("end of forward")

    def stock_loss(self) -> None:
        p, led, c = self.p, self.led, self.c
        T, V, d = p.workload.tokens, p.vocab, p.embed_dim
        float_copy = 4 if c != 4 else 0
        led.moment("loss forward: logits and log-probabilities", loss=T * V * (c + float_copy + 4))
        led.moment("loss backward: log-softmax gradient", loss=3 * T * V * 4)
        led.add("loss", T * V * c)  # the logits' gradient reaches the model output
        self.unshard(self.shared, f"backward: all-gather {self.shared}", forward=False)
        self.prefetch_before(self.shared)
        self.unshard(ROOT, "backward: all-gather root", forward=False)
        vd = V * d * c * self.embedding_grad  # (a frozen embedding has none)
        led.moment("backward: output projection", grads=vd, acts=T * d * c)
        led.add("grads", vd)  # the tied weight's gradient, in autograd's buffer
        if self.early:  # reduced inside the projection's backward (the logits' gradient alive)
            led.add("acts", T * d * c)
            self.tied_reduce("backward: output projection", vd)
            led.sub("acts", T * d * c)
        led.sub("loss", T * V * c)

    def chunked_loss(self, n: int) -> bool:
        """The fused chunked loss (criterions/fused.py): each chunk's logits, softmax and
        gradients in forward; backward only scales. The shared unit is gathered for the loss if
        it was resharded after forward, resharded after it, and never gathered in backward."""
        p, led, c = self.p, self.led, self.c
        T, V, d = p.workload.tokens, p.vocab, p.embed_dim
        # the FSDP2 trainer passes fp16's loss scale: gradients in the compute dtype
        led.add("loss", T * d * c * 2)  # the non-padding features and their gradient
        regather = self.gathered.get(self.shared, 0) < self.full[self.shared]
        self.unshard(self.shared, f"loss: all-gather {self.shared}", forward=False)
        chunk = chunk_bytes(n, V, c, c)  # logits (float32 a block of rows at a time)
        # the weight gradient (the tied buffer, with it) is created by the first chunk
        vd = V * d * c * self.embedding_grad  # (a frozen embedding has none)
        led.moment("loss forward: one chunk", loss=chunk, grads=vd)
        led.add("grads", vd)
        led.sub("loss", T * d * c)  # the features; their gradient goes on to the model output
        if regather:
            self.reshard(self.shared)
        self.no_backward_gather.add(self.shared)
        if self.early:  # the loss's backward, first in backward: its part reduced there
            self.tied_reduce("loss backward", vd)
        self.unshard(ROOT, "backward: all-gather root", forward=False)
        self.prefetch_before(ROOT)
        led.sub("loss", T * d * c)
        return bool(self.embedding_grad)  # the weight's gradient exists: lookups add to it

    def layers_backward(self, accumulated: bool) -> None:
        p, led, c = self.p, self.led, self.c
        T, V, d = p.workload.tokens, p.vocab, p.embed_dim
        recompute = getattr(self.trace, "recompute", {})
        self.root_grads = 0
        for kind, value in reversed(self.trace.events):
            if kind == "act":
                led.sub("acts", value)
                continue
            name = p.owner.get(value)
            if kind == "exit":  # this module's backward starts
                if value in p.embed_paths and name is not None:
                    self.unshard(name, f"backward: all-gather {name}", forward=False)
                if value in p.layer_params and name not in (None, ROOT):
                    self.unshard(name, f"backward: all-gather {name}", forward=False)
                    self.prefetch_before(name)
                if value in p.layer_params:
                    led.moment(f"backward: {value}", acts=recompute.get(value, 0)
                               + 2 * self.trace.max_act.get(value, 0) + T * d * c)
            elif value in p.layer_params:  # this layer's backward is over
                n_params = self.layer_grads[value]
                led.moment(f"backward: {value} gradients", grads=n_params * c, acts=2 * T * d * c)
                if name in (None, ROOT):
                    self.root_grads += n_params * c
                    led.add("grads", n_params * c)
                elif name not in self.reduced:
                    self.reduce_scatter(name, n_params * c, in_ledger=False)
            elif value in p.embed_paths:
                # stock: each lookup's dense vocab x dim gradient, added to the weight's; with
                # --fsdp2-tied-grad-buffer the rows are added into the one buffer in place
                extra = (0 if self.s.tied_grad_buffer or not self.embedding_grad else
                         V * d * c if accumulated else 2 * V * d * c)
                if self.early:  # reduced early: the lookup's rows and indices kept
                    self.row_count += T
                    if self.folded:
                        pass  # added into the dense buffer in place
                    elif sparse_fits(self.row_count, d, c, V):
                        self.rows_kept += T * (d * c + INDEX_BYTES)
                        led.add("grads", T * (d * c + INDEX_BYTES))
                    else:  # folded into a dense buffer (tied_grad_buffer._HubState.add_rows)
                        led.add("grads", V * d * c - self.rows_kept)
                        self.rows_kept, self.folded = 0, True
                led.moment(f"backward: {value} (embedding gradient)", grads=extra)
                accumulated = True


def simulate_fsdp2(profile: ModelProfile, setup: Setup, rank: int = 0) -> Ledger:
    return _FSDP2Step(profile, setup, rank).run()
