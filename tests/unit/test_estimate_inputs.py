"""``slipstream estimate`` refuses every bad value as one line naming the option, exit status 2, no traceback.

Runs the CLI's ``main`` in-process: a converter that raised anything but ``ArgumentTypeError`` would
surface here as an exception (a traceback for the user), not as ``SystemExit(2)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.cli import main as cli_main

P = ["--params", "7e9"]

# (arguments after "estimate", what the one line must contain)
BAD_OPTIONS = {
    "params inf": (
        ["--params", "inf"],
        "--params: 'inf': must be a finite positive number of parameters (e.g. 7e9 or 7B)",
    ),
    "params overflows to inf": (["--params", "1e400"], "--params: '1e400': must be a finite positive number"),
    "params nan": (["--params", "nan"], "--params: 'nan': must be a finite positive number"),
    "params negative": (["--params", "-1"], "--params: '-1': must be a finite positive number"),
    "params zero": (["--params", "0"], "--params: '0': must be a finite positive number"),
    "params below one": (["--params", "0.4"], "--params: '0.4': must be a finite positive number"),
    "params not a number": (["--params", "seven"], "--params: 'seven': must be a finite positive number"),
    "params beyond any model": (["--params", "1e30"], "--params: '1e30': must be at most 1e15 (1000T) parameters"),
    "params suffix beyond any model": (["--params", "2000T"], "--params: '2000T': must be at most 1e15"),
    "dp zero": (
        [*P, "--dp", "0"],
        "--dp: '0': must be a whole number from 1 to 1,000,000,000 (the data-parallel degree)",
    ),
    "dp negative": ([*P, "--dp", "-8"], "--dp: '-8': must be a whole number from 1"),
    "dp huge": ([*P, "--dp", "9" * 5000], "--dp: '99999"),
    "seq-len negative": (
        [*P, "--seq-len", "-5"],
        "--seq-len: '-5': must be a whole number from 1 to 1,000,000,000 (tokens per sequence)",
    ),
    "seq-len fractional": ([*P, "--seq-len", "1.5"], "--seq-len: '1.5': must be a whole number"),
    "seq-len beyond the limit": (
        [*P, "--seq-len", "99999999999999999999"],
        "--seq-len: '99999999999999999999': must be a whole",
    ),
    "micro-batch zero": ([*P, "--micro-batch", "0"], "--micro-batch: '0': must be a whole number from 1"),
    "layers negative": ([*P, "--layers", "-1"], "--layers: '-1': must be a whole number from 1"),
    "hidden zero": ([*P, "--hidden", "0"], "--hidden: '0': must be a whole number from 1"),
    "heads not a number": ([*P, "--heads", "x"], "--heads: 'x': must be a whole number from 1"),
    "vocab negative": ([*P, "--vocab", "-3"], "--vocab: '-3': must be a whole number from 1"),
    "device-memory nan": (
        [*P, "--device-memory", "nan"],
        "--device-memory: 'nan': must be a number of GB (1e9 bytes) per device from 0.001 to 1,000,000",
    ),
    "device-memory inf": ([*P, "--device-memory", "inf"], "--device-memory: 'inf': must be a number of GB"),
    "device-memory negative": ([*P, "--device-memory", "-1"], "--device-memory: '-1': must be a number of GB"),
    "device-memory zero": ([*P, "--device-memory", "0"], "--device-memory: '0': must be a number of GB"),
    "host-memory nan": (
        [*P, "--host-memory", "nan"],
        "--host-memory: 'nan': must be a number of GB (1e9 bytes) per rank from 0.001 to 1,000,000",
    ),
    "host-memory zero": ([*P, "--host-memory", "0"], "--host-memory: '0': must be a number of GB"),
    "neither params nor config": ([], "give --params N (e.g. 7e9 or 7B) or --model-config config.json"),
}

# (the config file's bytes, or None for a missing file, what the one line must contain after the file name)
BAD_CONFIGS = {
    "missing": (None, "--model-config: cannot read {path}: No such file or directory"),
    "not UTF-8": (b'{"n_layer": 4, "name": "caf\xe9"}', "--model-config: {path} line 1 is not UTF-8 text (byte 0xe9)"),
    "truncated JSON": (b'{"n_layer": 48,', "--model-config: {path} is not valid JSON: Expecting property name"),
    "empty": (b"", "--model-config: {path} is not valid JSON: Expecting value at line 1 column 1"),
    "a list": (b"[1, 2]", "--model-config: {path} holds a JSON list, not an object"),
    "nested too deeply": (
        b"[" * 100_000 + b"]" * 100_000,
        "--model-config: {path} is not valid JSON: nested too deeply",
    ),
    "a number of 5000 digits": (
        b'{"params": ' + b"9" * 5000 + b"}",
        "--model-config: {path}: a number in it has too many digits",
    ),
    "params Infinity": (
        b'{"params": Infinity}',
        "--model-config: {path}: 'params' is Infinity; it must be a number of parameters",
    ),
    "num_parameters negative": (
        b'{"num_parameters": -1}',
        "--model-config: {path}: 'num_parameters' is -1; it must be",
    ),
    "params true": (b'{"params": true}', "--model-config: {path}: 'params' is true"),
    "hidden size 1e400": (
        b'{"n_layer": 2, "n_embd": 1e400, "vocab_size": 10}',
        "--model-config: {path}: 'n_embd' is Infinity",
    ),
    "layers negative": (b'{"n_layer": -2, "n_embd": 64, "vocab_size": 10}', "--model-config: {path}: 'n_layer' is -2"),
    "intermediate_size a string": (
        b'{"n_layer": 2, "n_embd": 64, "vocab_size": 10, "intermediate_size": "big"}',
        "--model-config: {path}: 'intermediate_size' is \"big\"",
    ),
    "no parameter count": (
        b'{"model_type": "gpt2"}',
        "--model-config {path}: no parameter count (params or num_parameters)",
    ),
    "derives too many parameters": (
        b'{"n_layer": 1000000000, "n_embd": 1000000000, "vocab_size": 1000000000}',
        "--model-config {path}: describes 1.2e+28 parameters, more than 1e15",
    ),
}


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``slipstream estimate ARGV``; assert exit 2 and nothing on stdout; return the one stderr line."""
    with pytest.raises(SystemExit) as exited:
        cli_main(["estimate", *argv])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("slipstream estimate: error: "), err
    return err


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_option_is_one_line(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv, expected = BAD_OPTIONS[case]
    assert expected in _refused(argv, capsys)


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_model_config_is_one_line_naming_the_file(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, expected = BAD_CONFIGS[case]
    path = tmp_path / "config.json"
    if content is not None:
        path.write_bytes(content)
    assert expected.format(path=path) in _refused(["--model-config", str(path)], capsys)


def test_a_directory_as_model_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert f"--model-config: cannot read {tmp_path}: Is a directory" in _refused(
        ["--model-config", str(tmp_path)], capsys
    )


def test_valid_values_still_print_the_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "estimate",
        "--params",
        "7B",
        "--dp",
        "8",
        "--seq-len",
        "2048",
        "--micro-batch",
        "4",
        "--layers",
        "32",
        "--hidden",
        "4096",
        "--heads",
        "32",
        "--vocab",
        "32000",
        "--device-memory",
        "80",
    ]
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith(
        "7.0B parameters, data-parallel degree 8, bf16; activations for micro-batch 4 × sequence 2048"
    )
    assert "recommended for 80.0 GB per device: ZeRO stage 2" in out
    config = tmp_path / "config.json"  # a byte-order mark from a Windows editor is fine
    config.write_bytes(b"\xef\xbb\xbf" + json.dumps({"num_parameters": 1.5e9}).encode())
    assert cli_main(["estimate", "--model-config", str(config)]) == 0
    assert capsys.readouterr().out.startswith("1.5B parameters")


def test_the_largest_accepted_values_keep_the_table_readable(capsys: pytest.CaptureFixture[str]) -> None:
    top = "1000000000"
    argv = [
        "estimate",
        "--params",
        "1e15",
        "--seq-len",
        top,
        "--micro-batch",
        top,
        "--layers",
        top,
        "--hidden",
        top,
        "--heads",
        top,
        "--no-flash-attention",
        "--device-memory",
        "1000000",
    ]
    assert cli_main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[0] in {"0", "1", "2", "3"}]
    assert [len(row) for row in rows] == [7] * 4  # every column apart: 1.6e+07, not 16000000.0 run into the next
