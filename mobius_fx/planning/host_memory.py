"""The host's memory, planned: everything a Mobius step keeps in host DRAM, and the rule that
refuses a plan whose host does not hold it.

Why a module of its own: the GPUs' memory is the step model's (`step_model`, `stage_memory`);
the host's is a different budget with different terms, and a user who is told "does not fit"
must be able to read each term back. What the runtime keeps on the host (mobius_fx/runtime):

- masters: the model's own parameters, in their dtype (`plan.layers`' bytes, each counted once);
- gradients: each trainable master's `.grad`, in the masters' dtype (`host_gradients.GradHomes`);
- gradient downloads: a stage's gradients arrive in the streamed dtype, into pinned buffers held
  until they are summed into `.grad` (a step's worth with `pipe.overlap` off; CUDA's caching host
  allocator keeps them pooled across steps). None when the stream is the masters' dtype: the
  download is then the gradient itself;
- optimizer state: `OPTIMIZER_STATE[optimizer]` times the trainable masters' bytes (AdamW and
  Adam keep exp_avg and exp_avg_sq in the parameter's dtype: 2x; SGD with momentum 1x);
- the streamed copy: the masters cast to the streamed dtype, pinned, kept across steps, that
  the uploads read (`runtime.streamed_copies.StreamedCopies`): one per master, shared by every GPU
  that uploads it (a tied weight, ZeRO-3 offload's GPUs, roundpipe's forward and backward GPUs);
- activations: the stage inputs offloaded for backward and the model's outputs, all
  micro-batches, held from the forward to the backward (the schedule IR's forward copies to the
  host);
- pinned transfer buffers: per GPU, a pinned buffer each way for the largest activation it moves at a
  time (an estimate of the copies in flight).

The rule: the total must be at most `fraction` (default 0.9, `CompileOptions.host_memory_fraction`)
of the topology's `host_memory`; the rest is the OS's, the data loader's and Python's. An unknown
host memory (None) refuses nothing.

>>> b = HostBudget("adamw", masters=4 * 2**30, grads=4 * 2**30, grad_downloads=2**31, optimizer_state=8 * 2**30,
...                streamed_copy=2**31, activations=2**28, pinned_buffers=2**20, limit=16 * 2**30)
>>> print(b.line())
host memory: 20.25 GiB needed of 16.00 GiB (masters 4.00 GiB, grads 4.00 GiB + 2.00 GiB streamed-dtype downloads, AdamW state 8.00 GiB, streamed copy 2.00 GiB, activations 256.00 MiB, pinned buffers 1.00 MiB)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from mobius_fx.errors import MobiusError, PlanError
from mobius_fx.units import fmt_bytes

__all__ = ["OPTIMIZERS", "OPTIMIZER_STATE", "HostBudget", "host_budget", "check_optimizer",
           "check_host_memory_fraction", "DEFAULT_HOST_FRACTION"]

# Optimizer state per byte of trainable master (the state tensors are in the parameter's dtype).
OPTIMIZER_STATE = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}
OPTIMIZERS = tuple(OPTIMIZER_STATE)
_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd-momentum": "SGD-momentum", "sgd": "SGD", "none": "no optimizer"}
DEFAULT_HOST_FRACTION = 0.9  # of the host's DRAM a plan may need; the rest is the OS's and the loader's


def check_optimizer(value: Any) -> str:
    """`value` when it is an optimizer the host budget models; MobiusError naming them otherwise."""
    if value not in OPTIMIZER_STATE:
        raise MobiusError(f"optimizer={value!r} is not one the host memory plan models; give one of "
                          f"{', '.join(map(repr, OPTIMIZERS))} (the state each keeps per trainable weight: AdamW and "
                          f"Adam 2x, SGD with momentum 1x, SGD and 'none' nothing; 8-bit optimizer states are not "
                          f"modelled: plan with 'sgd-momentum' for about their size)")
    return value


def check_host_memory_fraction(value: Any) -> float | None:
    """The share of the host's DRAM a plan may need: a number in (0, 1], or None (not checked)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise MobiusError(f"host_memory_fraction={value!r}; it must be a number in (0, 1], the share of the host's "
                          f"DRAM a plan may need (default {DEFAULT_HOST_FRACTION}), or None to plan without checking it")
    return float(value)


@dataclass(frozen=True)
class HostBudget:
    """What a step keeps in host memory, in bytes, term by term (module docstring), and the host's
    DRAM `limit` (None: unknown)."""

    optimizer: str
    masters: int
    grads: int
    grad_downloads: int
    optimizer_state: int
    streamed_copy: int
    activations: int
    pinned_buffers: int
    limit: int | None = None
    master_itemsize: int = 4  # bytes per element of the masters and of the streamed dtype: what the
    stream_itemsize: int = 2  # remedies rescale (bf16 masters)

    @property
    def total(self) -> int:
        return (self.masters + self.grads + self.grad_downloads + self.optimizer_state + self.streamed_copy
                + self.activations + self.pinned_buffers)

    def terms(self) -> str:
        grads = fmt_bytes(self.grads) + (f" + {fmt_bytes(self.grad_downloads)} streamed-dtype downloads"
                                         if self.grad_downloads else "")
        state = f"{_NAMES[self.optimizer]} state {fmt_bytes(self.optimizer_state)}" if self.optimizer_state \
            else f"{_NAMES[self.optimizer]}: no state"
        return (f"masters {fmt_bytes(self.masters)}, grads {grads}, {state}, streamed copy "
                f"{fmt_bytes(self.streamed_copy)}, activations {fmt_bytes(self.activations)}, pinned buffers "
                f"{fmt_bytes(self.pinned_buffers)}")

    def line(self) -> str:
        """One line: the total, the host's DRAM, and each term."""
        of = f"of {fmt_bytes(self.limit)}" if self.limit is not None else "(host memory not known: not checked)"
        return f"host memory: {fmt_bytes(self.total)} needed {of} ({self.terms()})"

    def bf16_masters(self) -> "HostBudget":
        """This budget with bf16 masters streamed in bf16: masters, gradients and optimizer state at
        2 bytes an element, no separate downloads, the streamed copy and activations in bf16."""
        m, st = 2 / self.master_itemsize, 2 / self.stream_itemsize
        return replace(self, masters=int(self.masters * m), grads=int(self.grads * m), grad_downloads=0,
                       optimizer_state=int(self.optimizer_state * m), streamed_copy=int(self.streamed_copy * st),
                       activations=int(self.activations * st), pinned_buffers=int(self.pinned_buffers * st),
                       master_itemsize=2, stream_itemsize=2)

    def lora(self) -> "HostBudget":
        """About this budget with only LoRA adapters trained (their gradients and state taken as 0)."""
        return replace(self, grads=0, grad_downloads=0, optimizer_state=0)

    def check(self, fraction: float | None = DEFAULT_HOST_FRACTION, *, microbatches: int | None = None) -> None:
        """PlanError when the total is over `fraction` of `limit` (nothing when either is None),
        naming the value, the rule and the remedies with what each would need."""
        if fraction is None or self.limit is None or self.total <= fraction * self.limit:
            return
        allowed = fraction * self.limit
        fits = lambda b: "fits" if b.total <= allowed else "still too much"  # noqa: E731
        remedies = []
        bf16, lora = self.bf16_masters(), self.lora()
        if self.master_itemsize > 2 and bf16.total < self.total:
            remedies.append(f"bf16 masters streamed in bf16 (model.to(torch.bfloat16) and dtype=torch.bfloat16; CLI: "
                            f"--master-dtype bf16 --dtype bf16): {fmt_bytes(bf16.total)}, {fits(bf16)}")
        if lora.total < self.total:
            remedies.append(f"LoRA with peft (only the adapters train: gradients and optimizer state shrink to "
                            f"theirs): about {fmt_bytes(lora.total)}, {fits(lora)}")
            both = bf16.lora()
            if self.master_itemsize > 2 and lora.total > allowed:
                remedies.append(f"LoRA on bf16 masters: about {fmt_bytes(both.total)}, {fits(both)}")
        if self.activations >= 0.1 * self.total and microbatches:
            remedies.append(f"a smaller batch or shorter sequences (the activations held for backward are "
                            f"{fmt_bytes(self.activations)} for the whole batch in {microbatches} micro-batches; they "
                            f"grow with the batch, not with how many micro-batches it is split into)")
        lighter = [o for o in ("sgd-momentum", "sgd") if OPTIMIZER_STATE[o] < OPTIMIZER_STATE[self.optimizer]]
        for o in lighter:
            other = replace(self, optimizer=o, optimizer_state=self.optimizer_state * OPTIMIZER_STATE[o]
                            // OPTIMIZER_STATE[self.optimizer])
            remedies.append(f"optimizer={o!r} (CLI: --optimizer {o}; planned with it, step your model with it too): "
                            f"{fmt_bytes(other.total)}, {fits(other)}")
        remedies.append(f"a host with at least {fmt_bytes(self.total / fraction)} of DRAM (set it in the topology "
                        f"JSON: \"host\": {{\"memory\": \"...GiB\"}})")
        raise PlanError(f"{self.line()}: over {fraction:.0%} of the host's {fmt_bytes(self.limit)} "
                        f"({fmt_bytes(allowed)}), refused. A plan may need at most "
                        f"host_memory_fraction={fraction:g} of the host's DRAM (the rest is the OS's, the data "
                        f"loader's and Python's). Remedies: " + "; ".join(remedies) + ". Supported optimizers for "
                        f"this budget: {', '.join(OPTIMIZERS)} (8-bit states are not modelled). To plan anyway: "
                        f"host_memory_fraction=None (CLI: --host-memory-fraction off), or a larger fraction up to 1")


def host_budget(*, layers: Sequence[Any], stages: Sequence[Any], ir: Any, precision: Any, optimizer: str,
                limit: int | None) -> HostBudget:
    """The `HostBudget` of a plan's parts: its `layers` (bytes in the masters' dtype), `stages`
    (bytes as streamed), schedule IR `ir`, `precision`, the `optimizer` it is planned for and
    the host's DRAM `limit`. The streamed copy is the masters once in the streamed dtype, not the
    stages' weights: a tied weight two stages upload is one copy on the host, as is a layer that
    several GPUs upload (the runtime's `StreamedCopies`)."""
    check_optimizer(optimizer)
    itemsizes = {"master_itemsize": precision.master.itemsize, "stream_itemsize": precision.stream.itemsize}
    masters = sum(int(l.param_bytes) for l in layers)
    grads = sum(int(l.grad_bytes) for l in layers)
    downloads = 0 if precision.stream == precision.master else sum(int(s.grad_bytes) for s in stages)
    held = sum(int(o.bytes) for o in ir.ops
               if o.phase == "forward" and o.dst == "host" and o.kind in ("offload", "send"))
    largest: dict[str, int] = {}
    for o in ir.ops:
        if o.kind in ("send", "offload", "restore") and o.bytes:
            for end in (o.src, o.dst):
                if end and end != "host":
                    largest[end] = max(largest.get(end, 0), int(o.bytes))
    return HostBudget(optimizer, masters=masters, grads=grads, grad_downloads=downloads,
                      optimizer_state=grads * OPTIMIZER_STATE[optimizer],
                      streamed_copy=int(masters * precision.scale), activations=held,
                      pinned_buffers=2 * sum(largest.values()), limit=limit, **itemsizes)
