"""The workloads of ``tools/bench_whole_states.py`` and the arithmetic of its report.

A workload is a conversation that grows by one request per step: :meth:`prompt` gives the
text of the next request (and the leading part that is its system message, or "" when the
request is raw text), :meth:`advance` takes the reply and adds what the caller sends next.
Both arms of the benchmark are sent the tokens of these texts as the kvcache arm tokenized
them, so they see identical prompts.

* :class:`AgentLoop`: raw text; each step appends the reply's text and an observation and
  the whole is tokenized again (so the reply's tokens may come out otherwise, as in agent
  loops over a raw completion endpoint). Each prompt extends the previous prompt and its
  reply, up to how the reply re-tokenizes.
* :class:`SeamLoop`: the same with a tool result that ends in a space ("Thought: "), as
  ReAct prompts do: a reply starting with a word takes that space into its first token
  when the next prompt is tokenized, so the previous prompt's last token changes (its
  state at the prompt's end is no prefix of the next prompt).
* :class:`ThinkingChat`: a chat rendered with the ``<think>`` template of
  ``tools/make_tiny_gguf.py`` (Qwen 3's shape): each reply is stored as
  ``<think>reasoning</think>answer`` and the template drops the reasoning of every turn
  before the last user message, so the next prompt extends the previous *prompt* but not
  the previous prompt and its reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from harness.make_tiny_gguf import THINK_TEMPLATE

from model_runtime.chat.templates import ChatTemplate

AGENT_SYSTEM = ("You are a careful agent. Tools: search(query), open(url), "
                "write(path, text). Think step by step, call one tool per step, and report "
                "what you found. ")
OBSERVATION = "\nObservation: the tool returned {n} results about the cat and the dog.\nAction:"
SEAM_OBSERVATION = ("\nObservation: the tool returned {n} results about the cat and the "
                    "dog.\nThought: ")
CHAT_QUESTIONS = ("Which of the two pets needs more care in winter, the cat or the dog?",
                  "And how often should each of them see a vet?",
                  "What should I feed them when I travel for a week?",
                  "Summarise your advice in three short points.",
                  "One more: which of them suits a small flat?")


class Workload(Protocol):
    name: str

    def prompt(self) -> tuple[str, str]:
        """The next request's text and its leading system part ("" for raw text)."""
        ...

    def advance(self, reply: str, step: int) -> None:
        """Take step ``step``'s reply (0-based) and add what the caller sends next."""
        ...


def repeat_to_tokens(unit: str, count_tokens: Any, n_tokens: int) -> str:
    """``unit`` repeated until ``count_tokens`` of it reaches ``n_tokens``."""
    text = unit
    while count_tokens(text) < n_tokens:
        text += unit
    return text


class AgentLoop:
    """A raw agent loop: system text, then reply + observation per step."""

    name = "agent_loop"
    observation = OBSERVATION  # what follows each reply (its {n}: the step, from 1)

    def __init__(self, system: str) -> None:
        self.text = system

    def prompt(self) -> tuple[str, str]:
        return self.text, ""

    def advance(self, reply: str, step: int) -> None:
        self.text += reply + self.observation.format(n=step + 1)


class SeamLoop(AgentLoop):
    """A raw agent loop whose tool results end in a space (see the module's docstring)."""

    name = "seam_loop"
    observation = SEAM_OBSERVATION

    def __init__(self, system: str) -> None:
        super().__init__(system + SEAM_OBSERVATION.format(n=0))


def think_reply(reply: str) -> str:
    """A generated reply as a reasoning model's message: its first half as the reasoning
    in ``<think>`` tags, the rest as the answer. (A tiny random model does not write the
    tags itself; a reasoning model's reply has this shape.)"""
    half = len(reply) // 2
    return f"<think>\n{reply[:half].strip()}\n</think>\n\n{reply[half:].strip()}"


class ThinkingChat:
    """A chat under a template that drops earlier turns' reasoning (Qwen 3's shape)."""

    name = "thinking_chat"

    def __init__(self, system: str, questions: Sequence[str] = CHAT_QUESTIONS) -> None:
        self.template = ChatTemplate(THINK_TEMPLATE)
        self.questions = list(questions)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": self.questions[0]}]

    def prompt(self) -> tuple[str, str]:
        return (self.template.render(self.messages),
                self.template.render(self.messages[:1], add_generation_prompt=False))

    def advance(self, reply: str, step: int) -> None:
        question = self.questions[(step + 1) % len(self.questions)]
        self.messages += [{"role": "assistant", "content": think_reply(reply)},
                          {"role": "user", "content": question}]


WORKLOADS = {"agent_loop": AgentLoop, "seam_loop": SeamLoop, "thinking_chat": ThinkingChat}


def step_columns(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-request rows (``prompt``, ``read``, ``prefilled``, optionally ``hit`` and
    ``tier``) as one list per field, and the prompt tokens prefilled after the first step
    (which is cold on both arms in one process) in sum and per step."""
    doc: dict[str, Any] = {key: [r.get(key) for r in rows]
                           for key in ("prompt", "read", "prefilled", "hit", "tier")
                           if any(key in r for r in rows)}
    after_first = [r["prefilled"] for r in rows[1:]]
    doc["prefilled_after_first_step"] = sum(after_first)
    doc["mean_per_step_after_first"] = (round(sum(after_first) / len(after_first), 1)
                                        if after_first else None)
    return doc


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator`` to 3 places; None when either is missing or the
    denominator is 0 (reported as such rather than as infinity)."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)
