"""The memory estimator: the ZeRO paper's worked example, the command line, no torch at import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import slipstream
from slipstream import estimator
from slipstream.cli import main as cli_main
from slipstream.engine.config.zero import DEFAULT_REDUCE_BUCKET_NUMEL

ROOT = Path(__file__).resolve().parents[2]


def test_paper_example_7_5b_on_64_ranks() -> None:
    # ZeRO paper, Figure 1: Ψ = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB per device. Stage 2 also
    # keeps two send buffers of one gradient bucket (the engine's default: 25 MiB of fp32 elements), bf16.
    result = slipstream.estimate(7.5e9, dp=64)
    send_buffers = 2 * 2 * DEFAULT_REDUCE_BUCKET_NUMEL
    totals = [result.stage(s).model_states - (send_buffers if s == 2 else 0) for s in range(4)]
    assert [round(t / 1e9, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert result.bucket == DEFAULT_REDUCE_BUCKET_NUMEL


def test_stage2_send_buffers_follow_the_bucket_the_largest_parameter_and_the_model() -> None:
    """DeepSpeed's 5e8 in a config: 2 GB of bf16 send buffers at stage 2, which the paper's formula does not show."""
    plain = slipstream.estimate(7.5e9, dp=64).stage(2).grads
    deepspeed = slipstream.estimate(7.5e9, dp=64, reduce_bucket_size=500_000_000).stage(2).grads
    assert deepspeed - plain == 2 * 2 * (500_000_000 - DEFAULT_REDUCE_BUCKET_NUMEL)
    for stage in (0, 1, 3):  # reduced in the gradient buffer itself, or per unit
        assert slipstream.estimate(7.5e9, dp=64, reduce_bucket_size=500_000_000).stage(stage).grads == (
            slipstream.estimate(7.5e9, dp=64).stage(stage).grads
        )
    assert estimator.gradient_bucket(1e6) == 1e6  # never more than the model
    assert estimator.gradient_bucket(1e9, 1000, largest_param=50257 * 1600) == 50257 * 1600  # one parameter, one bucket
    import torch  # a module's own largest parameter sizes the bucket

    module = torch.nn.Sequential(torch.nn.Linear(400, 400, bias=False), torch.nn.Linear(10, 10))
    assert slipstream.estimate(module, dp=2, reduce_bucket_size=1000).bucket == 400 * 400


def test_cli_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["estimate", "--params", "7.5e9", "--dp", "64", "--reduce-bucket-size", "5e8"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert [rows[s][4] for s in "0123"] == ["120.0", "31.4", "18.6", "1.9"]  # the model-states column
    assert "stage 2's grads include two send buffers of 500M elements" in out


def test_ranks_on_cpu_count_their_shared_memory_rings() -> None:
    """One ring carries the gradients at stages 0-2, two lanes at stage 3, one more for hpZ (utils/host_rings.py)."""
    from slipstream.utils.host_rings import PIECE_BYTES

    ring = 2 * PIECE_BYTES + PIECE_BYTES // 4  # a rank's own file of two halves and the scratch row, at 4 ranks
    on_gpu, on_cpu = slipstream.estimate(1e8, dp=4), slipstream.estimate(1e8, dp=4, on_cpu=True)
    assert [on_cpu.stage(s).collectives for s in range(4)] == [ring, ring, ring, 2 * ring]
    assert all(on_cpu.stage(s).total - on_gpu.stage(s).total == on_cpu.stage(s).collectives for s in range(4))
    assert all(on_gpu.stage(s).collectives == 0 for s in range(4))
    hpz = 2 * PIECE_BYTES + PIECE_BYTES // 2
    assert estimator.host_collective_bytes(3, 4, estimator.Stage3Layout(hpz=2)) == 2 * ring + hpz
    assert estimator.host_collective_bytes(3, 1) == 0, "one rank has no ring"


def test_cli_cpu_prints_the_rings(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["estimate", "--params", "1e8", "--dp", "2", "--cpu"]) == 0
    out = capsys.readouterr().out
    line = "totals include, per rank on CPU, the same-host collectives' buffers: stage 0 0.021, stage 1 0.021"
    assert line in out and "stage 3 0.042" in out  # 20 MiB per ring at 2 ranks (GB = 1e9 bytes)


def test_cli_does_not_import_torch() -> None:
    code = (
        "import sys; from slipstream.cli import main; main(['estimate', '--params', '1e9', '--dp', '8']); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    assert "model states" in done.stdout


def test_model_config_activations_and_recommendation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"  # GPT-2 XL's config.json keys
    config.write_text(
        json.dumps({"n_layer": 48, "n_embd": 1600, "n_head": 25, "vocab_size": 50257, "n_positions": 1024})
    )
    assert (
        cli_main(
            ["estimate", "--model-config", str(config), "--dp", "8", "--micro-batch", "8", "--device-memory", "40"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "1.6B parameters" in out and "48 layers, hidden 1600" in out
    assert "recommended for 40.0 GB per device:" in out
    # Activations (Korthikanti et al.): s·b·h·34 per layer at 16 bit (flash attention) + the eager loss's 12·s·b·V (bf16).
    shape = estimator.ModelShape(params=1, layers=48, hidden=1600, heads=25, vocab=50257)
    expected = 48 * 1024 * 8 * 1600 * 34 + 12 * 1024 * 8 * 50257
    assert estimator.activation_bytes(shape, 1024, 8) == expected
    checkpointed = estimator.activation_bytes(shape, 1024, 8, checkpointing=True)
    assert checkpointed == 48 * 2 * 1024 * 8 * 1600 + 1024 * 8 * 1600 * 34 + 12 * 1024 * 8 * 50257
    assert estimator.activation_bytes(shape, 1024, 8, flash=False) > expected


def test_recommendation_escalates_until_it_fits() -> None:
    shape = estimator.ModelShape(params=int(7.5e9), layers=32, hidden=4096, vocab=32000)
    fits = estimator.recommend(shape, dp=64, seq=2048, micro_batch=1, precision="bf16", device_memory=80e9)
    assert "ZeRO stage 1, no offload, no activation checkpointing" in fits  # 31.4 GB + activations
    tight = estimator.recommend(shape, dp=8, seq=2048, micro_batch=4, precision="bf16", device_memory=24e9)
    assert "activation checkpointing on" in tight or "offload" in tight
    assert "does not fit" in estimator.recommend(
        shape, dp=1, seq=2048, micro_batch=1, precision="bf16", device_memory=8e9
    )


def test_offload_moves_optimizer_state_off_the_device() -> None:
    for stage in (1, 2, 3):
        _, _, optimizer, offloaded = estimator.model_state_bytes(1e9, 8, stage, "bf16", "cpu")
        assert optimizer == 0 and offloaded >= 16e9 / 8
    assert estimator.model_state_bytes(1e9, 8, 3, "bf16", "cpu")[0] == 0  # ZeRO-Infinity: parameter shards too


def test_estimate_from_a_model_reads_its_config() -> None:
    from tests.reference import tiny_gpt2

    model = tiny_gpt2(n_layer=2, n_embd=64)
    result = slipstream.estimate(model, dp=2, micro_batch=4)
    assert result.shape.params == sum(p.numel() for p in model.parameters())
    assert (result.shape.layers, result.shape.hidden, result.shape.vocab, result.seq_len) == (2, 64, 256, 32)
    assert result.stage(0).activations is not None


def test_tiles_and_sequence_shards_in_the_activation_estimate() -> None:
    """The terms of [Note: sequence shards and tiles], each checked by its own arithmetic."""
    from slipstream.estimator import ModelShape, Tiling, activation_bytes, checkpointed_input_bytes, longest_sequence

    shape = ModelShape(10**6, layers=2, hidden=64, heads=4, vocab=1000, intermediate=128)
    n = 4096
    plain = activation_bytes(shape, n, 1, "bf16")
    assert plain == 2 * n * (15 * 64 + 3 * 64 + 4 * 128) + 12 * n * 1000
    # sequence over 4 ranks: a quarter of every term
    assert activation_bytes(shape, n, 1, "bf16", tiling=Tiling(seq_shards=4)) == activation_bytes(
        shape, n // 4, 1, "bf16"
    )
    logits = activation_bytes(shape, n, 1, "bf16", tiling=Tiling(logits_tile=256))
    assert plain - logits == 12 * (n - 256) * 1000
    mlp = activation_bytes(shape, n, 1, "bf16", tiling=Tiling(mlp_tile=256))
    assert plain - mlp == 2 * n * (3 * 64 + 4 * 128) - 2 * 2 * n * 64 - 256 * (3 * 64 + 4 * 128)
    # the longest sequence: fits at its value, not one step beyond, and grows with the tiles
    budget = 50e6
    for tiling in (Tiling(), Tiling(256, 256)):
        seq = longest_sequence(shape, budget, 1, "bf16", True, True, tiling)
        assert (
            activation_bytes(shape, seq, 1, "bf16", True, True, tiling)
            <= budget
            < activation_bytes(shape, seq + 256, 1, "bf16", True, True, tiling)
        )
    assert longest_sequence(shape, budget, 1, "bf16", True, True, Tiling(256, 256)) > 4 * longest_sequence(
        shape, budget, 1, "bf16", True, True, Tiling()
    )
    assert longest_sequence(shape, 10.0, 1, "bf16", True, True, Tiling()) == 0
    # the checkpointed inputs offloaded: every layer's input (2·n·h in bf16) leaves the device, nothing else does
    both = activation_bytes(shape, n, 1, "bf16", True, True, Tiling(256, 256))
    offloaded = activation_bytes(shape, n, 1, "bf16", True, True, Tiling(256, 256, offload_checkpoints=True))
    assert both - offloaded == 2 * 2 * n * 64 == checkpointed_input_bytes(shape, n, 1, "bf16")
    assert checkpointed_input_bytes(shape, n, 2, "fp32", seq_shards=4) == 2 * 2 * n * 64 * 2 * 2 / 4
    assert activation_bytes(shape, n, 1, "bf16", tiling=Tiling(offload_checkpoints=True)) == plain  # not checkpointed


def test_cli_max_seq_table(capsys: pytest.CaptureFixture[str]) -> None:
    from slipstream.cli import main

    args = [
        "estimate",
        "--params",
        "8e9",
        "--layers",
        "32",
        "--hidden",
        "4096",
        "--heads",
        "32",
        "--vocab",
        "128256",
        "--intermediate",
        "14336",
        "--activation-checkpointing",
        "--seq-shards",
        "8",
        "--dp",
        "8",
        "--max-seq",
        "--device-memory",
        "80",
        "--tiled-logits",
        "4096",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == [
        "stage",
        "model",
        "states",
        "untiled",
        "tiled",
        "logits",
        "tiled",
        "MLP",
        "both",
        "all",
        "three",
    ]
    stage0, stage3 = out[2].split(), out[5].split()
    assert stage0[2:] == ["none"] * 5  # 128 GB of model states alone exceed 72 GB
    longest = [int(x.replace(",", "")) for x in stage3[2:]]
    assert longest[0] < longest[2] < longest[1] < longest[3] < longest[4]
    # what the longest offloaded sequence asks of host memory or disk: 32 layers' inputs, 1/8 of its tokens each, bf16
    assert out[6].endswith(f"({32 * -(-longest[4] // 8) * 4096 * 2 / 1e9:.1f} GB per rank at {longest[4]:,} tokens)")
    # host memory bounds the offloaded inputs: the longest sequence's fit in it, 256 tokens more would not
    assert main([*args, "--host-memory", "100"]) == 0
    bounded = int(capsys.readouterr().out.splitlines()[5].split()[-1].replace(",", ""))
    per_token = 32 * 4096 * 2 / 8  # bytes per rank per token of the sequence
    assert bounded * per_token <= 100e9 < (bounded + 256) * per_token and bounded < longest[4]
    # without checkpointing there are no checkpointed inputs to offload: no such column
    assert main([a for a in args if a != "--activation-checkpointing"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[-1] == "both"
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "8e9", "--max-seq"])
    assert "--max-seq needs --device-memory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "8e9", "--offload-checkpoints"])
    assert "--offload-checkpoints offloads the checkpointed inputs; it needs --activation-checkpointing" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "8e9", "--host-memory", "100"])
    assert "--host-memory bounds the offloaded checkpointed inputs of --max-seq" in capsys.readouterr().err


def test_stage3_layouts_mics_partitions_over_its_shard_group_and_hpz_adds_its_copy() -> None:
    plain = estimator.model_state_bytes(1e9, 16, 3, "bf16")
    mics = estimator.model_state_bytes(1e9, 16, 3, "bf16", layout=estimator.Stage3Layout(mics=4))
    hpz = estimator.model_state_bytes(1e9, 16, 3, "bf16", layout=estimator.Stage3Layout(hpz=8))
    assert (
        sum(plain[:3]) == 16e9 / 16 and sum(mics[:3]) == 16e9 / 4
    )  # 16 bytes per parameter over the partition's ranks
    assert hpz[0] == plain[0] + 2e9 / 8 and hpz[1:] == plain[1:]  # bf16 weights: 1/8 of them once more
    assert estimator.model_state_bytes(
        1e9, 16, 2, "bf16", layout=estimator.Stage3Layout(4, 4)
    ) == estimator.model_state_bytes(1e9, 16, 2, "bf16")
    with pytest.raises(
        ValueError, match=r"--mics-shard-size \(mics_shard_size\) must divide the data-parallel degree 16, got 3"
    ):
        estimator.model_state_bytes(1e9, 16, 3, "bf16", layout=estimator.Stage3Layout(mics=3))
    table = estimator.estimate(7e9, 16, layout=estimator.Stage3Layout(hpz=8)).table()
    assert "stage 3 with hpZ over 8" in table.splitlines()[0]
