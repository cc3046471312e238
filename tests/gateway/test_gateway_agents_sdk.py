"""The ``openai-agents`` SDK running an agent with a function tool against a real gateway
(the tiny Hermes-template model, a real worker and cache daemon), over the Responses API
and over chat completions. The tiny model's random weights would not choose a tool on
their own, nor end a free reply within a test's tokens (the SDK takes a reply cut at
max_tokens for a failure): the call is forced (``tool_choice="required"``), the SDK runs
the tool with the model's arguments and stops on its output (``stop_on_first_tool``).
The tool output's way back to the model is tested with OpenAI's client
(tests/gateway/test_gateway_responses.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

from tests.support.gateway_proc import GatewayProcess, Gateways, model_entry

set_tracing_disabled(True)  # traces would be sent to OpenAI's servers


@pytest.fixture(scope="module")
def gw(gateways: Gateways, tiny_hermes_model: Path) -> GatewayProcess:
    return gateways.start("agents_sdk", models=[
        model_entry("hermes", tiny_hermes_model, "--n-ctx", "2048", "--n-seq-max", "2")])


def run_agent(gw: GatewayProcess, api: str) -> tuple[list[str], object]:
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city today.

        Args:
            city: The city's name.
        """
        asked.append(city)
        return f"Snow in {city}, -3 C."

    async def main() -> object:
        client = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="none", max_retries=0,
                             timeout=60)
        model = OpenAIResponsesModel("hermes", client) if api == "responses" else \
            OpenAIChatCompletionsModel("hermes", client)
        agent = Agent(name="dispatcher", instructions="Answer briefly; use the tools.",
                      tools=[get_weather], model=model,
                      model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                   max_tokens=200, parallel_tool_calls=False),
                      tool_use_behavior="stop_on_first_tool")
        try:
            return await Runner.run(agent, "Weather in Oslo?", max_turns=4)
        finally:
            await client.close()

    return asked, asyncio.run(main())


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_agent_calls_a_tool_and_answers_with_its_result(gw: GatewayProcess,
                                                           api: str) -> None:
    asked, result = run_agent(gw, api)
    items = result.new_items  # type: ignore[attr-defined]
    assert [type(item) for item in items] == [ToolCallItem, ToolCallOutputItem]
    assert len(asked) == 1 and isinstance(asked[0], str)  # the model's own argument
    assert items[0].raw_item.name == "get_weather"  # type: ignore[union-attr]
    assert items[1].output == f"Snow in {asked[0]}, -3 C."
    assert result.final_output == items[1].output  # type: ignore[attr-defined]
    assert len(result.raw_responses) == 1  # type: ignore[attr-defined]
