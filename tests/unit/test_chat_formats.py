"""Template families read from the template source, and agents' histories handed to each
family's template (model_runtime/chat/formats.py, templates.py)."""

from __future__ import annotations

import json

import pytest

from model_runtime.chat.formats import (
    Family,
    detect_format,
    envelope_calls,
    envelope_response,
    template_messages,
)
from model_runtime.chat.messages import ChatMessage, Tool, ToolCall
from model_runtime.chat.templates import ChatTemplate, TemplateError
from tests.support.chat_fixtures import SOURCES, template

WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}, "The weather in a city.")
CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
ROUND_TRIP = [ChatMessage("system", "Be terse."), ChatMessage("user", "Weather in Paris?"),
              ChatMessage("assistant", "", (CALL,)),
              ChatMessage("tool", "22 C, sunny", tool_call_id="call_1")]


@pytest.mark.parametrize("name, family, reasoning", [
    ("chatml", Family.GENERIC, None), ("hermes", Family.HERMES, None),
    ("think", Family.HERMES, ("<think>", "</think>")), ("llama3", Family.LLAMA3, None),
    ("mistral", Family.MISTRAL, None)])
def test_the_family_is_read_from_the_template_source(name: str, family: Family,
                                                     reasoning: tuple[str, str] | None) -> None:
    fmt = detect_format(SOURCES[name])
    assert fmt.family is family and fmt.reasoning == reasoning
    assert fmt.string_arguments == (name == "think")  # it writes a string as it is


def test_mistral_call_ids_are_nine_letters_and_digits_others_openai_s() -> None:
    mistral_id = detect_format(SOURCES["mistral"]).new_call_id()
    assert len(mistral_id) == 9 and mistral_id.isalnum()
    assert detect_format(SOURCES["hermes"]).new_call_id().startswith("call_")


def test_a_template_s_leading_bos_is_dropped_when_the_tokenizer_adds_one() -> None:
    source = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    adds = ChatTemplate(source, bos_token="<s>", add_bos=True)
    keeps = ChatTemplate(source, bos_token="<s>", add_bos=False)
    messages = [{"role": "user", "content": "hi"}]
    assert adds.render(messages) == "hi" and keeps.render(messages) == "<s>hi"


def test_a_template_that_refuses_the_messages_raises_template_error() -> None:
    tmpl, _ = template("mistral")
    with pytest.raises(TemplateError, match="Tool call IDs must be 9"):
        tmpl.render([{"role": "user", "content": "x"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": "call_123456789abc", "type": "function",
                          "function": {"name": "f", "arguments": {}}}]}])
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_native_families_get_openai_s_shapes_with_arguments_as_the_template_wants() -> None:
    for name, arguments in (("hermes", {"city": "Paris"}), ("think", '{"city": "Paris"}')):
        _, fmt = template(name)
        out = template_messages(fmt, ROUND_TRIP, {"call_1": CALL})
        assert out[2]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": arguments}}]
        assert out[3] == {"role": "tool", "content": "22 C, sunny", "tool_call_id": "call_1",
                          "name": "get_weather"}


def test_the_generic_family_writes_tools_into_the_system_message_and_calls_as_json() -> None:
    _, fmt = template("chatml")
    results = [*ROUND_TRIP, ChatMessage("tool", "rain tomorrow", tool_call_id="call_1")]
    out = template_messages(fmt, results, {"call_1": CALL}, tools=[WEATHER], envelope=True)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be terse.\n\n")
    assert json.dumps(WEATHER.as_openai()) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": envelope_calls([CALL])}
    # Consecutive results are one user turn, each naming its tool.
    assert out[3]["role"] == "user" and len(out) == 4
    first, second = (json.loads(line) for line in out[3]["content"].split("\n"))
    assert first == {"tool_response": {"name": "get_weather", "content": "22 C, sunny"}}
    assert second["tool_response"]["content"] == "rain tomorrow"


def test_the_envelope_is_written_back_exactly_as_the_grammar_has_the_model_write_it() -> None:
    assert envelope_response('Say "hi"\n') == '{"response": "Say \\"hi\\"\\n"}'
    calls = [CALL, ToolCall("c2", "noop", "")]
    assert envelope_calls(calls) == ('{"tool_calls": [{"name": "get_weather", "arguments": '
                                     '{"city": "Paris"}}, {"name": "noop", "arguments": {}}]}')


def test_developer_is_system_unless_the_template_knows_it() -> None:
    _, fmt = template("chatml")
    assert template_messages(fmt, [ChatMessage("developer", "x")], {})[0]["role"] == "system"
    fmt = detect_format("{% if m.role == 'developer' %}{% endif %}")
    assert template_messages(fmt, [ChatMessage("developer", "x")], {})[0]["role"] == \
        "developer"
