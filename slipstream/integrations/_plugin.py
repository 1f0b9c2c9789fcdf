"""``SlipstreamPlugin``: Accelerate's ``DeepSpeedPlugin`` fields and environment variables, for Slipstream.

[Note: the same knobs] ``accelerate config`` / ``accelerate launch`` write the DeepSpeed choices
into ``ACCELERATE_DEEPSPEED_*`` variables; reading the same ones means a launch set up for
DeepSpeed needs no change. Without a config file the fields build DeepSpeed's minimal config, as
the DeepSpeed plugin does; with one, fields that are set fill its ``"auto"`` values.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

from slipstream.integrations._config import fill_auto, get, read_config

try:  # the same classes, so code that checks isinstance against Accelerate's keeps working
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
except ImportError:  # pragma: no cover - very old or stripped Accelerate

    class DummyOptim:  # type: ignore[no-redef]
        """Stands for the optimizer of the config's ``optimizer`` section until ``prepare``."""

        def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
            self.params, self.lr, self.weight_decay, self.kwargs = params, lr, weight_decay, kwargs

    class DummyScheduler:  # type: ignore[no-redef]
        """Stands for the config's ``scheduler`` section (or ``lr_scheduler_callable``) until ``prepare``."""

        def __init__(
            self,
            optimizer: Any,
            total_num_steps: int | None = None,
            warmup_num_steps: int = 0,
            lr_scheduler_callable: Any = None,
            **kwargs: Any,
        ) -> None:
            self.optimizer, self.total_num_steps, self.warmup_num_steps = optimizer, total_num_steps, warmup_num_steps
            self.lr_scheduler_callable, self.kwargs = lr_scheduler_callable, kwargs


def _env_bool(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass
class SlipstreamPlugin:
    """The fields of Accelerate's ``DeepSpeedPlugin``; ``hf_ds_config`` is a path or a dict."""

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None
    config: dict[str, Any] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        env = os.environ.get
        if self.gradient_accumulation_steps is None:
            gas = env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
            self.gradient_accumulation_steps = int(gas) if gas.isdigit() else gas
        if self.gradient_clipping is None:
            clip = env("ACCELERATE_GRADIENT_CLIPPING", "auto")
            self.gradient_clipping = clip if clip == "auto" else float(clip)
        if self.zero_stage is None:
            self.zero_stage = int(env("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        if self.offload_optimizer_device is None:
            self.offload_optimizer_device = env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
        if self.offload_param_device is None:
            self.offload_param_device = env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
        if self.offload_optimizer_nvme_path is None:
            self.offload_optimizer_nvme_path = env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", "none")
        if self.offload_param_nvme_path is None:
            self.offload_param_nvme_path = env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "none")
        if self.zero3_save_16bit_model is None:
            self.zero3_save_16bit_model = _env_bool("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false")
        if self.enable_msamp is None:
            self.enable_msamp = env("ACCELERATE_FP8_BACKEND") == "MSAMP"
        if self.msamp_opt_level is None:
            self.msamp_opt_level = env("ACCELERATE_FP8_OPT_LEVEL", "O1")
        if self.hf_ds_config is None:
            self.hf_ds_config = env("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if isinstance(self.hf_ds_config, dict) or (
            isinstance(self.hf_ds_config, (str, os.PathLike)) and str(self.hf_ds_config) != "none"
        ):
            self.config = self._from_file(read_config(self.hf_ds_config))
        else:
            self.config = self._from_fields()
        self.config["steps_per_print"] = 0  # Accelerate silences the engine's progress line the same way
        if self.zero3_init_flag is None:
            self.zero3_init_flag = _env_bool(
                "ACCELERATE_DEEPSPEED_ZERO3_INIT", str(get(self.config, "zero_optimization.stage") == 3)
            )

    _FIELDS_TO_KEYS = {
        "gradient_accumulation_steps": "gradient_accumulation_steps",
        "gradient_clipping": "gradient_clipping",
        "zero_stage": "zero_optimization.stage",
        "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
        "offload_param_device": "zero_optimization.offload_param.device",
        "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
        "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
        "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    }

    def _from_file(self, config: dict[str, Any]) -> dict[str, Any]:
        config.setdefault("gradient_accumulation_steps", 1)
        if "zero_optimization" not in config:
            raise ValueError("Please specify the ZeRO optimization config in the DeepSpeed config.")
        for field, key in self._FIELDS_TO_KEYS.items():  # fields fill the file's "auto" values
            value = getattr(self, field)
            if value is not None:
                fill_auto(config, key, value)
        for field, key in self._FIELDS_TO_KEYS.items():  # and the file's values win for the fields
            value = get(config, key)
            if value is not None and value != "auto":
                setattr(self, field, value)
        return config

    def _from_fields(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.zero_stage}
        if self.offload_optimizer_device not in (None, "none"):
            zero["offload_optimizer"] = {"device": self.offload_optimizer_device}
            if self.offload_optimizer_device == "nvme":
                zero["offload_optimizer"]["nvme_path"] = self.offload_optimizer_nvme_path
        if self.offload_param_device not in (None, "none"):
            zero["offload_param"] = {"device": self.offload_param_device}
            if self.offload_param_device == "nvme":
                zero["offload_param"]["nvme_path"] = self.offload_param_nvme_path
        if self.zero3_save_16bit_model:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": zero,
        }
        if self.gradient_clipping and self.gradient_clipping != "auto":
            config["gradient_clipping"] = self.gradient_clipping
        return config

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """The config, under ``DeepSpeedPlugin``'s name (Accelerate's examples test ``"optimizer" in ...deepspeed_config``)."""
        return self.config

    def is_zero3_init_enabled(self) -> bool:
        return bool(self.zero3_init_flag)

    def config_copy(self) -> dict[str, Any]:
        """A copy to fill and hand to ``slipstream.initialize``."""
        return copy.deepcopy(self.config)
