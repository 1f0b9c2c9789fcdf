"""The order of streams, events and collectives, pinned on CPU with a recording accelerator.

On a GPU, communication runs on its own streams (``comm/context.py``); correctness then rests on
the events between them and the compute stream. Here a recording accelerator logs every stream
and event call, the context logs launches, waits, frees and buffer recycling, and hooks log when
compute uses a unit and when each gradient is written. The checks below hold for ZeRO-3 and
ZeRO-2 steps; a deliberately reordered call makes them fail.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import slipstream
from slipstream.accelerator.cpu import CPUAccelerator
from tests.harness import run_distributed


class _Stream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: _Event) -> None:
        self.log.append(("stream_waits", self, event))

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("stream_waits_stream", self, other))

    def synchronize(self) -> None:
        self.log.append(("host_waits_stream", self))


class _Event:
    def __init__(self, log: list, number: int) -> None:
        self.log, self.number, self.stream = log, number, None

    def record(self, stream: _Stream | None = None) -> None:
        self.stream = stream
        self.log.append(("record", self, stream))

    def synchronize(self) -> None:
        self.log.append(("host_waits", self))

    def query(self) -> bool:
        return True


class RecordingAccelerator(CPUAccelerator):
    """The CPU accelerator, with streams and events that log what is asked of them."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.compute = _Stream(self.log, "compute")
        self.active = [self.compute]
        self.events = 0

    def new_stream(self) -> _Stream:
        return _Stream(self.log, f"stream{len(self.log)}")

    def current_stream(self) -> _Stream:
        return self.active[-1]

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        self.active.append(stream)
        try:
            yield stream
        finally:
            self.active.pop()

    def new_event(self) -> _Event:
        self.events += 1
        return _Event(self.log, self.events)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(16, 1))


def _recorded_step(stage: int, break_wait: bool = False, break_issue: bool = False) -> list[tuple[str, ...]]:
    """One forward/backward/step of a 3-block model at ``stage``; the log as (what, a, b) strings."""
    import slipstream.comm.context as context_module

    recorder = RecordingAccelerator()
    context_module.get_accelerator = lambda: recorder  # every CommContext made from here on records
    original_wait, original_issue = context_module.CommContext.wait, context_module.CommContext.issue
    if break_wait:  # the host waits, but compute never waits for the collective's stream

        def wait(self: Any, pending: Any) -> None:
            if pending.work is not None:
                pending.work.wait()
            pending.waited = True
            self._note("wait", pending.kind, pending.tag)

        context_module.CommContext.wait = wait
    if break_issue:  # launched on its stream before the stream waits for compute to write the inputs

        def issue(self: Any, kind: str, launch: Any, tag: str = "") -> Any:
            with self.accelerator.stream(self.stream(kind)):
                self._note("launch", kind, tag)
                work = launch()
                done = self.accelerator.new_event()
                done.record(self.stream(kind))
            return context_module.Pending(self, kind, tag, work, done)

        context_module.CommContext.issue = issue
    try:
        model = _model()
        log = recorder.log
        names = {id(p): n for n, p in model.named_parameters()}
        for p in model.parameters():  # before initialize: runs before the strategy's own gradient hook
            p.register_post_accumulate_grad_hook(lambda p: log.append(("grad", names[id(p)], "")))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        }
        engine = slipstream.initialize(model, config)
        context = engine.strategy.comm_context
        context.observer = lambda what, kind, tag: log.append((what, kind, tag))
        for name, module in model.named_children():
            module.register_forward_pre_hook(lambda m, a, name=name: log.append(("use", name, "")))
        x = torch.randn(2, 16)
        engine.backward(engine(x).pow(2).mean())
        log.append(("step", "", ""))
        engine.step()
        kinds = {id(s): k for k, s in context.streams.items()}
        out = []
        for entry in log:
            out.append(tuple(_name(x, kinds) for x in entry))
        engine.close()
        return out
    finally:
        context_module.CommContext.wait, context_module.CommContext.issue = original_wait, original_issue
        context_module.get_accelerator = CPUAccelerator


def _name(x: Any, kinds: dict[int, str]) -> str:
    if isinstance(x, _Stream):
        return kinds.get(id(x), x.name)
    if isinstance(x, _Event):
        return f"e{x.number}"
    return str(x) if x is not None else ""


# --------------------------------------------------------------------------- the rules
def check_order(log: list[tuple[str, ...]]) -> None:
    """Raise AssertionError naming the first collective that breaks an ordering rule."""
    recorded = {e[1]: (i, e[2]) for i, e in enumerate(log) if e[0] == "record"}  # event -> (index, stream)
    for i, (what, kind, tag) in enumerate(log):
        if what != "launch":
            continue
        # 1. the kind's stream waited for an event recorded on compute before this launch (inputs written)
        before = [e for e in log[:i] if e[0] == "stream_waits" and e[1] == kind]
        last_launch = max((j for j, e in enumerate(log[:i]) if e[0] == "launch" and e[1] == kind), default=-1)
        fresh = [e for e in before if log.index(e) > last_launch and recorded.get(e[2], (0, ""))[1] == "compute"]
        assert fresh, f"{kind} of {tag} launched without waiting for compute to write its inputs"
        # 2. an event recorded on the kind's stream right after the launch; compute waits for it before "wait" is noted
        done = next((e[1] for e in log[i + 1 :] if e[0] == "record" and e[2] == kind), None)
        assert done is not None, f"no event after the {kind} of {tag}"
        noted = next((j for j, e in enumerate(log) if e == ("wait", kind, tag) and j > i), None)
        if noted is not None:
            assert ("stream_waits", "compute", done) in log[i:noted], (
                f"compute used the result of the {kind} of {tag} without waiting for its stream"
            )
    for i, (what, kind, tag) in enumerate(log):
        if what == "recycle":  # 3. a send buffer back in the pool only after its collective completed
            assert ("wait", kind, tag) in log[:i], f"send buffer of {tag} reused before its {kind} completed"
        if what == "use":  # 4. a ZeRO-3 unit is used only after its gather was waited on
            gathers = [
                j for j, e in enumerate(log[:i]) if e[0] == "launch" and e[1] == "all_gather" and f"({kind})" in e[2]
            ]
            if gathers:
                tag_of = log[gathers[-1]][2]
                assert ("wait", "all_gather", tag_of) in log[gathers[-1] : i], (
                    f"{kind} computed on before its gather was waited on"
                )


def _check_zero3(log: list[tuple[str, ...]]) -> None:
    check_order(log)
    for i, (what, _kind, tag) in enumerate(log):
        match = re.match(r"ZeRO-3 gradients of unit \d+ \((.+)\)$", tag) if what == "launch" else None
        if match:  # 5. a unit's gradients reduced only after backward wrote every one of them
            block = match.group(1)
            prefix = "" if block.startswith("<") else block + "."  # the root unit: parameters outside the blocks
            written = [e[1] for e in log[:i] if e[0] == "grad" and e[1].startswith(prefix)]
            assert written, f"{tag} reduced before its gradients were written"
        if what == "free" and "unit" in tag:  # 6. freed after compute recorded the end of its use
            assert log[i - 1][0] == "record" and log[i - 1][2] == "compute", f"{tag} freed without an event on compute"
    launches = {e[2] for e in log if e[0] == "launch"}
    assert any(t.startswith("ZeRO-3 unit") for t in launches) and any(
        t.startswith("ZeRO-3 gradients") for t in launches
    )


def _check_zero2(log: list[tuple[str, ...]]) -> None:
    check_order(log)
    step = log.index(("step", "", ""))
    buckets = [e for e in log if e[0] == "launch" and e[1] == "reduce_scatter"]
    assert len(buckets) >= 2, buckets  # reduce_bucket_size 300: several buckets
    for _, kind, tag in buckets:
        assert ("wait", kind, tag) in log[:step], f"{tag} not complete before the optimizer step"
    first = log.index(buckets[0])
    assert any(e[0] == "grad" for e in log[:first]), "a gradient bucket reduced before any gradient was written"


def _body(stage: int, break_wait: bool, break_issue: bool) -> list[tuple[str, ...]]:
    return _recorded_step(stage, break_wait, break_issue)


@pytest.mark.parametrize("stage", [2, 3])
def test_stream_and_event_order(stage: int) -> None:
    log = run_distributed(2, _body, stage, False, False)[0]
    (_check_zero3 if stage == 3 else _check_zero2)(log)


@pytest.mark.parametrize("stage,broken", [(3, "wait"), (3, "issue"), (2, "issue")])
def test_a_reordered_call_fails_the_checks(stage: int, broken: str) -> None:
    log = run_distributed(2, _body, stage, broken == "wait", broken == "issue")[0]
    with pytest.raises(AssertionError, match="without waiting"):
        (_check_zero3 if stage == 3 else _check_zero2)(log)
