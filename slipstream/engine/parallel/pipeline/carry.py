"""What a stage hands the next besides its hidden state: the router logits a balancing loss reads.

[Note: router logits carried between stages] A mixture-of-experts model trained with its
load-balancing loss (transformers' ``output_router_logits``: Mixtral, Qwen2/3-MoE, OLMoE,
Granite-MoE, DeepSeek-V3, …) computes that loss at the end of its forward from *every* layer's
router logits: ``E · Σ_e f_e · P_e``, a product of two means over all layers' tokens, so it is not
a sum of per-layer or per-stage terms. transformers records each router's logits while the blocks
run (output-capturing hooks append them to a per-forward collector) and the head reads the
collected tuple. Under a pipeline the last stage's forward runs only its own blocks, so it would
see only its own layers' logits (the twin check refused that). So each stage hands its collected
logits on with its hidden state:

* at the end of a non-last stage (the gate raises ``StageOutput``) the logits collected in this
  forward, the ones received first, are stacked ``[layers, tokens, experts]`` and sent with the
  activation (one more message per transfer: layers·tokens·experts values, small beside the
  hidden state's tokens·hidden);
* at the start of the next stage's range they go back into its collector, before its own layers
  append theirs, so the last stage's model sees every layer's logits in global layer order and
  its own loss function computes one process's value;
* the received tensor is an input of the stage like the hidden state: its gradient goes back with
  the hidden state's, so every stage's routers receive the balancing loss's gradient.

Nothing here knows a model: only the collector transformers fills. What is carried is decided
once, the same on every rank: a model that can record router logits and has
``config.output_router_logits`` on hands them on (an empty tensor from a stage whose layers have
no router, such as DeepSeek's first dense layers, keeps the message count fixed); otherwise
nothing more is sent, and a forward that records them anyway (``output_router_logits=True`` passed
per call) is refused at the stage's end rather than trained on the last stage's layers alone. A
model whose balancing loss is computed some other way is still compared by the twin check.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.engine.parallel.router_logits import ROUTER_FIELD
from slipstream.errors import UsageError

_NOT_CARRIED = (
    "pipeline: this forward records router logits (output_router_logits passed per call), but the model's "
    "config.output_router_logits was off at initialize, so the stages do not hand them on and the balancing "
    "loss would see the last stage's layers only; set config.output_router_logits = True before initialize"
)


def _collector_variable() -> Any | None:
    """transformers' per-forward output collector (a context variable holding ``{key: [tensors]}``), if this version has one."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def _router_recorder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The (outermost) transformers model inside ``model`` that declares router logits among the outputs it can record."""
    for module in model.modules():
        recordable = getattr(type(module), "_can_record_outputs", None)
        if isinstance(recordable, dict) and ROUTER_FIELD in recordable:
            return module
    return None


class RouterCarry:
    """Takes a stage's collected router logits at its end and gives them to the next stage's collector.

    ``sends``: the model's config asks for router logits, so every hand-over carries them; without it
    the carry only refuses a forward that recorded some (see the module note).
    """

    def __init__(self, collector: Any, sends: bool) -> None:
        self._collector, self.sends = collector, sends

    @classmethod
    def of(cls, model: torch.nn.Module) -> RouterCarry | None:
        """A carry for ``model``, or None where it cannot record router logits (every rank decides the same)."""
        collector, recorder = _collector_variable(), _router_recorder(model)
        if collector is None or recorder is None:
            return None
        return cls(collector, bool(getattr(getattr(recorder, "config", None), "output_router_logits", False)))

    def check_batch(self, batch: Any) -> None:
        """Refuse, on every rank alike at ``engine(batch)``, a batch asking for router logits the stages do not carry."""
        if not self.sends and isinstance(batch, dict) and batch.get("output_router_logits"):
            raise UsageError(_NOT_CARRIED)

    def _collected(self) -> list[torch.Tensor] | None:
        collected = self._collector.get()
        if not isinstance(collected, dict):
            return None
        found = collected.get(ROUTER_FIELD)
        return found if isinstance(found, list) else None

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """The router logits this forward has collected so far, stacked (an empty tensor on ``like``'s device if none);
        None where the pipeline carries none (UsageError if this forward recorded some anyway)."""
        layers = self._collected()
        if not self.sends:
            if layers:
                raise UsageError(_NOT_CARRIED)
            return None
        if not layers:
            return torch.empty(0, device=like.device)
        shapes = {tuple(t.shape) for t in layers}
        if len(shapes) != 1:
            raise UsageError(
                f"pipeline: the model's layers record router logits of different shapes ({sorted(shapes)}); a stage hands "
                "its layers' logits on as one tensor, so they must match"
            )
        return torch.stack(layers)

    def give(self, carried: torch.Tensor) -> None:
        """Put the earlier stages' router logits first in this forward's collector (nothing if none were carried)."""
        if carried.numel() == 0:
            return
        layers = self._collected()
        if layers is None:
            raise UsageError(
                "pipeline: router logits arrived from the previous stage, but this stage's forward records none "
                "(output_router_logits must be the same on every stage)"
            )
        layers[:0] = list(carried.unbind(0))
