"""The VLM judge's answer forms without a server: strict parsing, the regex each constraint sends, GenEval checks."""

from __future__ import annotations

import json
import re

import pytest

from megatron_omni.reward.errors import RewardInputError, RewardScorerError
from megatron_omni.reward.judge_tasks import ALIGNMENT, COLOR, COUNT, PAIRWISE, RELATION, ocr_task
from megatron_omni.reward.vlm_judge import VlmJudgeClient, message_text
from megatron_omni.reward.vlm_scorers import geneval_checks, load_metadata_file


def test_strict_parse_takes_only_the_json_form() -> None:
    ocr = ocr_task(8)
    assert ocr.parse('{"text": "HELLO"}') == "HELLO"
    assert ocr.parse('{"text": "say \\"hi\\""}') == 'say "hi"'
    assert ALIGNMENT.parse('{"score": 4}') == 4
    assert PAIRWISE.parse('{"preferred": 2}') == 2
    assert COLOR.parse('{"color": "purple"}') == "purple"
    for task, bad in ((ocr, "HELLO"), (ocr, '```json\n{"text": "HELLO"}\n```'), (ALIGNMENT, "<think>4</think>"),
                      (ALIGNMENT, '{"score": 4'), (ocr, "")):
        with pytest.raises(RewardScorerError, match=f"answer to '{task.name}' is not JSON: " + re.escape(repr(bad))):
            task.parse(bad)
    for task, bad in ((ALIGNMENT, '{"score": 6}'), (ALIGNMENT, '{"score": "4"}'), (ocr, '{"text": "ABCDEFGHIJ"}'),
                      (PAIRWISE, '{"preferred": 1, "why": "x"}'), (COLOR, '{"color": "teal"}'), (COUNT, "[3]")):
        with pytest.raises(RewardScorerError, match="does not match its schema"):
            task.parse(bad)


def test_regex_and_schema_describe_the_same_answers() -> None:
    ocr = ocr_task(8)
    good = ['{"text": ""}', '{"text": "HELLO"}', '{"text": "a\\"b\\\\c"}']
    bad = ['{"text":"HELLO"}', '{"text": "ABCDEFGHI"}', '{ "text": "A"}', '{"text": "A"} ']
    for answer in good:
        assert re.fullmatch(ocr.regex, answer) and ocr.parse(answer) == json.loads(answer)["text"]
    for answer in bad:
        assert not re.fullmatch(ocr.regex, answer), answer
    for task, answers in ((ALIGNMENT, ['{"score": 1}', '{"score": 5}']), (PAIRWISE, ['{"preferred": 1}']),
                          (COUNT, ['{"count": 0}', '{"count": 9}']), (RELATION, ['{"answer": "no"}']),
                          (COLOR, ['{"color": "white"}'])):
        for answer in answers:
            assert re.fullmatch(task.regex, answer), (task.name, answer)
            task.parse(answer)
    assert not re.fullmatch(ALIGNMENT.regex, '{"score": 0}') and not re.fullmatch(COUNT.regex, '{"count": 10}')
    assert ALIGNMENT.constraint_fields("regex") == {"structured_outputs": {"regex": ALIGNMENT.regex}}
    assert ALIGNMENT.constraint_fields("json_schema")["response_format"]["json_schema"]["schema"] == ALIGNMENT.schema
    assert ALIGNMENT.constraint_fields("none") == {}


def test_message_text_refuses_missing_and_cut_answers() -> None:
    assert message_text({"choices": [{"message": {"content": '{"score": 3}'}, "finish_reason": "stop"}]}, 8) \
        == '{"score": 3}'
    with pytest.raises(RewardScorerError, match="cut at max_tokens=8: '\\{\"score'"):
        message_text({"choices": [{"message": {"content": '{"score'}, "finish_reason": "length"}]}, 8)
    for bad in ({}, {"choices": []}, {"choices": [{"message": {}}]}, {"choices": [{"message": {"content": None}}]}):
        with pytest.raises(RewardScorerError, match="VLM judge"):
            message_text(bad, 8)
    with pytest.raises(RewardInputError, match="constraint 'grammar'"):
        VlmJudgeClient(base_url="http://127.0.0.1:1/v1", model="m", constraint="grammar")
    with pytest.raises(RewardInputError, match="http"):
        VlmJudgeClient(base_url="127.0.0.1:1", model="m")


def test_geneval_checks_from_metadata(tmp_path) -> None:
    meta = {"include": [{"class": "bus", "count": 1, "color": "red"},
                        {"class": "dog", "count": 2, "position": ["right of", 0]}],
            "exclude": [{"class": "bus", "count": 2}]}
    checks = geneval_checks(meta)
    assert [(t.name, f) for t, f, _ in checks] == [
        ("count", {"noun": "buses"}), ("color", {"noun": "bus"}), ("count", {"noun": "dogs"}),
        ("relation", {"noun": "dog", "relation": "right of", "other": "bus"}), ("count", {"noun": "buses"})]
    count_bus, _, count_dogs, _, exclude_bus = (want for _, _, want in checks)
    assert count_bus(1) and not count_bus(0) and count_dogs(3) and not count_dogs(1)
    assert exclude_bus(1) and not exclude_bus(2)
    for bad in ({}, {"include": []}, {"include": [{"class": "cat"}]},
                {"include": [{"class": "cat", "count": 1, "color": "teal"}]},
                {"include": [{"class": "cat", "count": 1, "position": ["behind", 0]}]}):
        with pytest.raises(RewardInputError, match="geneval"):
            geneval_checks(bad)
    path = tmp_path / "meta.jsonl"
    path.write_text(json.dumps({"prompt": "a red bus", **meta}) + "\n\nnot json\n")
    with pytest.raises(RewardInputError, match="meta.jsonl:3: not JSON"):
        load_metadata_file(path)
    with pytest.raises(RewardInputError, match="is not a file"):
        load_metadata_file(tmp_path / "nope.jsonl")


def test_in_process_vlm_judge_is_a_config_error() -> None:
    from megatron_omni.trainer.config import ConfigError, JobConfig
    from megatron_omni.trainer.config_checks import check_reward

    cfg = JobConfig()
    cfg.reward.scorer = "0.5*geneval+0.5*jpeg_compressibility"
    with pytest.raises(ConfigError, match="geneval asks a VLM judge server.*set reward.url"):
        check_reward(cfg)
    cfg.reward.url = "http://127.0.0.1:8000"
    check_reward(cfg)
