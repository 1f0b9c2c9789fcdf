"""The example configs users copy from must parse."""

from pathlib import Path

import pytest

from slipstream.engine.config import SlipstreamConfig
from slipstream.engine.optimizers import validate_optimizer_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").iterdir())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_parses(path: Path) -> None:
    config = SlipstreamConfig.load(path, world_size=2)
    assert config.optimizer is not None
    validate_optimizer_config(config.optimizer)
