"""`python -m bench.lora`'s arguments, the flags each server gets, and what the report quotes of kvserve's log."""

import pytest

from bench.lora.__main__ import build_parser, check_args, served_quantization, vllm_lora_flags
from bench.lora.adapters import DEFAULT_MODULES, DEFAULT_RANK


def test_the_defaults_are_the_issues_run():
    args = build_parser().parse_args([])
    assert args.arms == (0, 1, 4, 8) and args.adapters == 8 and args.streams == 16
    assert args.rank == DEFAULT_RANK and args.target_modules == DEFAULT_MODULES
    assert args.vllm is None and check_args(args) is None


def test_arguments_are_checked(tmp_path):
    parser = build_parser()
    for bad in (["--arms", "0,x"], ["--arms", "0,-1"], ["--streams", "0"], ["--target-modules", "lm_head"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "--adapters" in check_args(parser.parse_args(["--arms", "0,16"]))
    assert "base only" in check_args(parser.parse_args(["--arms", "1,4"]))
    assert "--vllm" in check_args(parser.parse_args(["--no-kvserve"]))
    assert "no such file" in check_args(parser.parse_args(["--vllm", str(tmp_path / "python")]))
    args = parser.parse_args(["--arms", "0,2,2", "--adapters", "2", "--rank", "8", "--target-modules", "q,v"])
    assert args.arms == (0, 2) and args.rank == 8 and args.target_modules == ("q_proj", "v_proj")


def test_vllm_gets_every_adapter_and_a_rank_bound_it_accepts(tmp_path):
    paths = {"a0": tmp_path / "a0", "a1": tmp_path / "a1"}
    flags = vllm_lora_flags(paths, 4)
    assert flags[:4] == ["--enable-lora", "--lora-modules", f"a0={tmp_path}/a0", f"a1={tmp_path}/a1"]
    assert flags[4:] == ["--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "8"]
    assert vllm_lora_flags(paths, 16)[-1] == "16"


def test_the_report_quotes_how_the_executor_serves_its_weights(tmp_path):
    log = tmp_path / "up.log"
    log.write_text(
        "2026-12-05 13:24:06.120 INFO    kvserve.kernels: packed 121 quantized linear layers into panels\n"
        "2026-12-05 13:24:06.166 INFO    kvserve.engine: weights: 92.1 MiB as served (--quantization auto)\n"
        "2026-12-05 13:24:07.000 INFO    kvserve.engine: ready\n"
    )
    assert served_quantization(log) == (
        "packed 121 quantized linear layers into panels; weights: 92.1 MiB as served (--quantization auto)"
    )
    log.write_text("nothing about weights\n")
    assert served_quantization(log) is None
