"""bench/tenancy/hostile_inputs.py, hostile_bodies.py and hostile_report.py without a stack: the bodies are the
issue's inputs, the options reach them, and the table says what happened, timeouts included."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from bench.tenancy.hostile_bodies import ATTACKS, GATEWAY_BODY_LIMIT, Sizes, class_regex, parse_cases
from bench.tenancy.hostile_inputs import build_parser, victim_body
from bench.tenancy.hostile_report import Exchange, markdown_table


def test_a_case_number_names_its_lettered_cases_and_an_unknown_one_is_refused():
    assert parse_cases("1,3,6") == ["1", "3", "6a", "6b"]
    assert parse_cases("6b, 2") == ["2", "6b"]
    assert parse_cases("8,7") == ["7", "8"]
    with pytest.raises(ValueError, match="9"):
        parse_cases("1,9")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--cases", "9"])
    assert build_parser().parse_args([]).cases == [*ATTACKS]


def test_sizes_come_from_the_command_line():
    args = build_parser().parse_args(
        ["--cases", "2", "--stop-strings", "10", "--stop-n", "4", "--distinct-regexes"]
    )
    sizes = Sizes(**{name: getattr(args, name) for name in Sizes.__dataclass_fields__})
    body = json.loads(ATTACKS["2"](sizes, "m").bodies[0])
    assert len(body["stop"]) == 10 and body["n"] == 4
    regexes = {json.loads(raw)["structured_outputs"]["regex"] for raw in ATTACKS["3"](sizes, "m").bodies}
    assert len(regexes) == sizes.regex_requests


def test_default_bodies_are_the_issues_inputs_and_fit_the_gateways_body_limit():
    sizes = Sizes()
    bias = json.loads(ATTACKS["1"](sizes, "m").bodies[0])["logit_bias"]
    assert sorted(map(int, bias)) == list(range(49_152))
    assert class_regex(160).startswith("[^a]*[^b]*") and len(class_regex(160)) == 800
    flood = ATTACKS["4"](sizes, "m")
    assert not flood.keyed and len(flood.bodies) == 16
    assert GATEWAY_BODY_LIMIT - 4096 < flood.body_bytes <= GATEWAY_BODY_LIMIT
    for case in ATTACKS:
        for raw in ATTACKS[case](sizes, "m").bodies:
            assert len(raw) <= GATEWAY_BODY_LIMIT, case  # a 413 would test nothing else
    assert len(json.loads(ATTACKS["6b"](sizes, "m").bodies[0])["messages"]) >= 20_000


def test_table_shows_timeouts_statuses_and_ratios():
    report = {
        "alone_s": 0.5,
        "timeout_s": 20.0,
        "settle_timeout_s": 30.0,
        "cases": [
            {
                "case": "1",
                "description": "logit_bias",
                "attacker": [{"status": 200, "seconds": 21.0, "finished": False}],
                "victim": {"latency": None, "ttft": None, "error": "not done within 20 s"},
                "live_latencies": [0.01, 0.03],
                "quiet_after": None,
            },
            {
                "case": "4",
                "description": "flood",
                "attacker": [
                    {"status": 401, "seconds": 2.0, "finished": True},
                    {"status": 401, "seconds": 4.0, "finished": True},
                    {"status": None, "seconds": 1.0, "finished": False, "error": "ReadError: x"},
                ],
                "victim": {"latency": 1.5, "ttft": 1.2, "error": None},
                "live_latencies": [3.0],
                "quiet_after": 2.25,
            },
        ],
    }
    lines = markdown_table(report).splitlines()
    assert len(lines) == 4 and lines[1].startswith("| --- |")
    logit = [cell.strip() for cell in lines[2].split("|")[1:-1]]
    assert logit[2:] == [
        "200, cut",
        "> 21.00 s",
        "0.50 s",
        "> 20 s",
        "> 40x",
        "-",
        "max 0.03 s, median 0.020 s",
        "> 30 s",
    ]
    flood = [cell.strip() for cell in lines[3].split("|")[1:-1]]
    assert flood[2] == "401 x2, no answer"
    assert flood[3] == "median 2.00 s, max 4.00 s"
    assert flood[5:8] == ["1.50 s", "3.0x", "1.20 s"]
    assert flood[9] == "2.25 s"


def test_an_exchange_cut_mid_stream_is_reported_as_cut():
    report = {
        "alone_s": 1.0,
        "timeout_s": 5.0,
        "settle_timeout_s": 5.0,
        "cases": [
            {
                "case": "2",
                "description": "stop",
                "attacker": [asdict(Exchange(200, 6.0, finished=False, error_event=True))],
                "victim": {"latency": 2.0, "ttft": None, "error": None},
                "live_latencies": [],
                "quiet_after": 0.5,
            }
        ],
    }
    cells = [cell.strip() for cell in markdown_table(report).splitlines()[2].split("|")[1:-1]]
    assert cells[2] == "200 + error event, cut" and cells[8] == "-"


def _pattern(raw: bytes) -> str:
    schema = json.loads(raw)["response_format"]["json_schema"]["schema"]
    return schema["properties"]["code"]["pattern"]


def test_the_pattern_cases_send_156_classes_against_a_json_schema_victim():
    sizes = Sizes()
    flood = ATTACKS["7"](sizes, "m")
    assert len(flood.bodies) == 16 and flood.victim == "json_schema" and flood.sends == 1
    patterns = {_pattern(raw) for raw in flood.bodies}
    assert patterns == {f"^{class_regex(156)}$"} and class_regex(156).count("[") == 156
    distinct = ATTACKS["7"](Sizes(distinct_patterns=True, pattern_requests=4, pattern_classes=20), "m")
    assert len({_pattern(raw) for raw in distinct.bodies}) == 4
    twice = ATTACKS["8"](sizes, "m")
    assert len(twice.bodies) == 1 and twice.sends == 2 and twice.victim == "chat"
    assert _pattern(twice.bodies[0]) == f"^{class_regex(156)}$"
    assert json.loads(twice.bodies[0])["response_format"] not in [
        json.loads(raw)["response_format"] for raw in flood.bodies
    ]  # not refused already for case 7's sake


def test_the_json_schema_victim_is_a_new_grammar_each_time_and_ends_with_it():
    first, second = (victim_body("m", 32, "json_schema", probe) for probe in (1, 2))
    assert first["response_format"] != second["response_format"] and not first["ignore_eos"]
    schema = first["response_format"]["json_schema"]["schema"]
    assert schema["properties"] == {"ok": {"type": "boolean"}} and schema["required"] == ["ok"]
    assert "response_format" not in victim_body("m", 32) and victim_body("m", 32)["ignore_eos"]


def test_a_case_sent_twice_reports_each_answer_in_turn_against_its_own_victim_alone():
    report = {
        "alone_s": 2.0,
        "timeout_s": 60.0,
        "settle_timeout_s": 60.0,
        "cases": [
            {
                "case": "8",
                "description": "refused twice",
                "attacker": [asdict(Exchange(400, 10.4, finished=True)), asdict(Exchange(400, 0.02, True))],
                "victim": {"latency": 0.5, "ttft": 0.1, "error": None},
                "live_latencies": [],
                "quiet_after": 0.5,
                "sends": 2,
                "alone_s": 0.25,
            }
        ],
    }
    cells = [cell.strip() for cell in markdown_table(report).splitlines()[2].split("|")[1:-1]]
    assert cells[2] == "400 x2" and cells[3] == "10.40 s, then 0.02 s"
    assert cells[4] == "0.25 s" and cells[6] == "2.0x"
