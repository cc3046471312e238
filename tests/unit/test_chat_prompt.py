"""One chat request made ready for the runtime (model_runtime/chat/prompt.py): the save
boundary holds the tools, a tool round trip continues the text the previous turn ended
with, and each tool choice gets its constraint."""

from __future__ import annotations

import pytest

from model_runtime.chat.formats import envelope_calls, envelope_response
from model_runtime.chat.messages import ChatInputError, ChatMessage, Tool, ToolCall, ToolChoice
from model_runtime.chat.prompt import ChatRequest, plan_chat
from model_runtime.chat.templates import ChatTemplate, RenderCancelled
from tests.support.chat_fixtures import template

WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]})
NOOP = Tool("noop")
SYSTEM = ChatMessage("system", "You are the terse assistant of a weather desk.")


CALL_A = ToolCall("a", "get_weather", '{"city": "Paris"}')
CALL_B = ToolCall("b", "get_weather", '{"city": "Oslo"}')


def ask(question: str) -> list[ChatMessage]:
    return [SYSTEM, ChatMessage("user", question)]


@pytest.mark.parametrize("name", ["chatml", "hermes", "think", "llama3"])
def test_the_save_boundary_holds_the_system_message_and_the_tools(name: str) -> None:
    tmpl, fmt = template(name)
    first = plan_chat(tmpl, fmt, ChatRequest(ask("Weather in Paris?"), tools=[WEATHER]))
    second = plan_chat(tmpl, fmt, ChatRequest(ask("And in Rome?"), tools=[WEATHER],
                                              tool_choice=ToolChoice("required")))
    head = first.text[:first.head_chars]
    assert "get_weather" in head and SYSTEM.content in head
    assert "Paris" not in head
    assert second.text[:second.head_chars] == head  # the same tools: the same cached head


def test_mistral_tools_come_late_so_the_head_holds_none() -> None:
    tmpl, fmt = template("mistral")
    plan = plan_chat(tmpl, fmt, ChatRequest(ask("Weather?"), tools=[WEATHER]))
    assert "get_weather" in plan.text and "get_weather" not in plan.text[:plan.head_chars]


def round_trip(name: str, generated: str, call: ToolCall) -> tuple[str, str]:
    """The first request's prompt plus what the model wrote, and the next request's
    prompt after the client sent the call and its result back."""
    tmpl, fmt = template(name)
    first = plan_chat(tmpl, fmt, ChatRequest(ask("Weather in Paris?"), tools=[WEATHER]))
    history = [*ask("Weather in Paris?"), ChatMessage("assistant", "", (call,)),
               ChatMessage("tool", "22 C", tool_call_id=call.id)]
    second = plan_chat(tmpl, fmt, ChatRequest(history, tools=[WEATHER]))
    return first.text + generated, second.text


@pytest.mark.parametrize("name, generated", [
    ("chatml", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>'),
    ("think", '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n'
              '</tool_call>'),
])
def test_a_tool_round_trip_continues_the_text_the_model_wrote(name: str, generated: str) -> None:
    arguments = generated[generated.index('"arguments": ') + 13:generated.rindex("}")]
    before, after = round_trip(name, generated, ToolCall("call_1", "get_weather", arguments))
    assert after.startswith(before), (before, after)


def test_a_reply_in_the_envelope_is_written_back_as_generated() -> None:
    tmpl, fmt = template("chatml")
    first = plan_chat(tmpl, fmt, ChatRequest(ask("Hi"), tools=[WEATHER]))
    generated = envelope_response("Hello! Ask me about the weather.")
    history = [*ask("Hi"), ChatMessage("assistant", "Hello! Ask me about the weather."),
               ChatMessage("user", "Paris?")]
    second = plan_chat(tmpl, fmt, ChatRequest(history, tools=[WEATHER]))
    assert second.text.startswith(first.text + generated)
    assert envelope_calls([]) == '{"tool_calls": []}'


def test_the_think_family_drops_reasoning_of_turns_before_the_last_user_message() -> None:
    tmpl, fmt = template("think")
    turn = [*ask("Hi"), ChatMessage("assistant", "Hello.", reasoning="The user greets.")]
    now = plan_chat(tmpl, fmt, ChatRequest(turn))
    assert "The user greets." in now.text  # the turn after the last user message keeps it
    later = plan_chat(tmpl, fmt, ChatRequest([*turn, ChatMessage("user", "Bye")]))
    assert "The user greets." not in later.text and "Hello." in later.text
    assert now.text.endswith("<|im_start|>assistant\n")


def test_a_prompt_that_opens_reasoning_is_read_from_inside_it() -> None:
    _, fmt = template("think")
    opening = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}"
                           "{% if add_generation_prompt %}<think>\n{% endif %}")
    plan = plan_chat(opening, fmt, ChatRequest([ChatMessage("user", "q")]))
    assert plan.inside_reasoning
    out = plan.parser()
    out.feed("pondering</think>answer")
    out.close()
    assert (out.output.reasoning, out.output.content) == ("pondering", "answer")
    closed = plan_chat(*template("think"), ChatRequest(ask("q"),
                                                       variables={"enable_thinking": False}))
    assert not closed.inside_reasoning and closed.text.endswith("</think>\n\n")


def test_a_prompt_that_closed_reasoning_gets_a_grammar_without_it() -> None:
    """enable_thinking false: the template closed the block, so the constrained answer
    starts at once (a grammar offering a new <think> block first lets a model spend its
    tokens there)."""
    tmpl, fmt = template("think")
    tools = {"tools": [WEATHER], "tool_choice": ToolChoice("required")}
    thinking = plan_chat(tmpl, fmt, ChatRequest(ask("q"), **tools))
    closed = plan_chat(tmpl, fmt, ChatRequest(ask("q"), variables={"enable_thinking": False},
                                              **tools))
    assert thinking.constraint is not None and closed.constraint is not None
    assert "<think>" in thinking.constraint.grammar
    assert "<think>" not in closed.constraint.grammar
    assert "think" not in closed.constraint.grammar.replace("get_weather", "")


def test_each_tool_choice_gets_its_constraint() -> None:
    hermes = template("hermes")
    auto = plan_chat(*hermes, ChatRequest(ask("q"), tools=[WEATHER, NOOP]))
    assert auto.constraint is not None and auto.constraint.triggers == ("<tool_call>",)
    assert auto.tools and not auto.envelope
    required = plan_chat(*hermes, ChatRequest(ask("q"), tools=[WEATHER],
                                              tool_choice=ToolChoice("required")))
    assert required.constraint is not None and required.constraint.triggers == ()
    named = plan_chat(*hermes, ChatRequest(ask("q"), tools=[WEATHER, NOOP],
                                           tool_choice=ToolChoice("function", "noop")))
    assert named.constraint is not None and "get_weather" not in named.constraint.grammar
    none = plan_chat(*hermes, ChatRequest(ask("q"), tools=[WEATHER],
                                          tool_choice=ToolChoice("none")))
    assert none.constraint is None and not none.tools
    assert "get_weather" in none.text  # still shown: the cached head stays the same
    generic = plan_chat(*template("chatml"), ChatRequest(ask("q"), tools=[WEATHER],
                                                         tool_choice=ToolChoice("none")))
    assert generic.envelope and generic.constraint is not None
    assert "tool_calls" not in generic.constraint.grammar.split("root ::=")[1]
    schema = plan_chat(*hermes, ChatRequest(ask("q"), json_schema={"type": "object"}))
    assert schema.constraint is not None and schema.constraint.triggers == ()
    plain = plan_chat(*hermes, ChatRequest(ask("q")))
    assert plain.constraint is None and not plain.tools


@pytest.mark.parametrize("request_, param", [
    (ChatRequest([ChatMessage("user", "q"), ChatMessage("tool", "r", tool_call_id="nope")]),
     "messages[1].tool_call_id"),
    (ChatRequest([ChatMessage("user", "q"), ChatMessage("tool", "r")]),
     "messages[1].tool_call_id"),
    # A call no tool message right after it answers (OpenAI's and Anthropic's rule).
    (ChatRequest([ChatMessage("user", "q"), ChatMessage("assistant", "", (CALL_A,)),
                  ChatMessage("user", "and?")]), "messages[1].role"),
    (ChatRequest([ChatMessage("user", "q"), ChatMessage("assistant", "", (CALL_A, CALL_B)),
                  ChatMessage("tool", "r", tool_call_id="a")]), "messages[1].role"),
    (ChatRequest([ChatMessage("user", "q"), ChatMessage("assistant", "", (CALL_A,))]),
     "messages[1].role"),
    (ChatRequest([ChatMessage("user", "q"), ChatMessage("assistant", "", (CALL_A,)),
                  ChatMessage("user", "x"), ChatMessage("tool", "r", tool_call_id="a")]),
     "messages[1].role"),
    (ChatRequest(ask("q"), tool_choice=ToolChoice("required")), "tool_choice"),
    (ChatRequest(ask("q"), tools=[WEATHER], tool_choice=ToolChoice("function", "other")),
     "tool_choice"),
    (ChatRequest(ask("q"), tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (ChatRequest(ask("q"), tools=[WEATHER], grammar='root ::= "x"'), "grammar"),
])
def test_bad_combinations_name_their_place(request_: ChatRequest, param: str) -> None:
    with pytest.raises(ChatInputError) as err:
        plan_chat(*template("hermes"), request_)
    assert err.value.param == param


def test_a_call_must_be_answered_right_after_it_in_any_order() -> None:
    asked = [ChatMessage("user", "q"), ChatMessage("assistant", "", (CALL_A, CALL_B))]
    with pytest.raises(ChatInputError) as err:
        plan_chat(*template("hermes"), ChatRequest(
            [*asked, ChatMessage("tool", "ra", tool_call_id="a")]))
    assert err.value.message == (  # OpenAI's words
        "An assistant message with 'tool_calls' must be followed by tool messages "
        "responding to each 'tool_call_id'. The following tool_call_ids did not have "
        "response messages: b")
    answered = [*asked, ChatMessage("tool", "rb", tool_call_id="b"),
                ChatMessage("tool", "ra", tool_call_id="a"), ChatMessage("user", "thanks")]
    assert "thanks" in plan_chat(*template("hermes"), ChatRequest(answered)).text


def test_a_rendering_stops_once_its_caller_is_gone() -> None:
    tmpl, fmt = template("chatml")
    messages = tuple(ChatMessage("user" if i % 2 == 0 else "assistant", f"m{i}")
                     for i in range(2000))
    asked: list[int] = []

    def gone() -> bool:
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(RenderCancelled):
        plan_chat(tmpl, fmt, ChatRequest(messages), cancelled=gone)
    assert len(asked) == 3
    assert plan_chat(tmpl, fmt, ChatRequest(messages), cancelled=lambda: False).text == \
        plan_chat(tmpl, fmt, ChatRequest(messages)).text
