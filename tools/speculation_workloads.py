"""The prompts of ``tools/bench_speculation.py``: chats whose answers copy their context
(an agent's output), and free prose that copies nothing.

Each workload is a list of prompts: a chat (OpenAI-style messages) and the start of the
answer (what a tool-call grammar or a client's prefill fixes, often ""); the benchmark
renders the chat with the model's own chat template, appends that start and sends every
arm the same tokens.

* ``code_edit``: a Python file and an edit to make; the answer repeats the file.
* ``json_echo``: an order as JSON and a field to change; the answer repeats the order.
* ``tool_loop``: three steps of an agent whose tool call's arguments quote the tool
  output it was just given (a file read, then written back with one line changed); the
  call's opening, up to its ``content`` argument, is the answer's given start.
* ``prose``: stories and explanations that copy nothing of their prompt.
"""

from __future__ import annotations

import json
from typing import Any

Chat = list[dict[str, str]]
Prompt = tuple[Chat, str]  # the chat, and the start of its answer

CODE = '''import csv
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def load_items(path):
    items = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            items.append(Item(row["name"], float(row["price"]), int(row["quantity"])))
    return items


def compute_total(items):
    total = 0.0
    for item in items:
        total += item.price * item.quantity
    return total


def cheapest(items):
    return min(items, key=lambda item: item.price)


if __name__ == "__main__":
    items = load_items("items.csv")
    print("total:", compute_total(items))
    print("cheapest:", cheapest(items).name)
'''

ORDER: dict[str, Any] = {
    "order_id": "A-10293", "status": "pending", "customer": {
        "name": "Ada Lovelace", "email": "ada@example.com",
        "address": {"street": "12 St James's Square", "city": "London", "postcode": "SW1Y 4JH"}},
    "items": [{"sku": "KB-201", "title": "Mechanical keyboard", "qty": 1, "price": 89.5},
              {"sku": "MS-330", "title": "Wireless mouse", "qty": 2, "price": 24.0},
              {"sku": "CB-012", "title": "USB-C cable", "qty": 3, "price": 7.25}],
    "currency": "GBP", "notes": "Leave at the front desk."}

NOTES = ("Meeting notes, 3 March\n- Ship the billing export by Friday\n- Ask Sam about the "
         "invoice numbering\n- Move the standup to 9:30\n- Review the onboarding checklist\n"
         "- Book the room for the quarterly review\n")

TOOL_SYSTEM = ("You are an agent that edits files with tools. To call a tool, answer with "
               "one JSON object only: {\"tool\": NAME, \"arguments\": {...}}. Tools: "
               "read_file(path), write_file(path, content).")

PROSE = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Explain to a child why the sky is blue and why sunsets are red.",
         "Describe a busy market in a small town on a Saturday morning.",
         "Write a letter from a traveller to a friend about a long train journey.")


def code_edit() -> list[Prompt]:
    return [([{"role": "system", "content": "You are a careful coding assistant."},
             {"role": "user", "content": f"Here is a Python file:\n```python\n{CODE}```\n"
                                         f"{edit} Answer with the whole new file in one "
                                         "python code block and nothing else."}], "")
            for edit in ("Rename the function compute_total to sum_prices everywhere.",
                         "Add a docstring to the function cheapest.")]


def json_echo() -> list[Prompt]:
    text = json.dumps(ORDER, indent=2)
    return [([{"role": "system", "content": "You answer with JSON only."},
             {"role": "user", "content": f"Here is an order:\n{text}\n{change} Answer with "
                                         "the whole updated order as JSON."}], "")
            for change in ('Set "status" to "shipped".',
                           'Change the quantity of the wireless mouse to 1.')]


def tool_loop() -> list[Prompt]:
    """Each step: the file read (its content as the tool's JSON gives it), then the model
    writes it back with a change."""
    prompts = []
    notes = NOTES
    for change in ("Change Friday to Thursday.", "Change 9:30 to 10:00.",
                   "Remove the line about the room."):
        read = json.dumps({"tool": "read_file", "arguments": {"path": "notes.txt"}})
        result = json.dumps({"path": "notes.txt", "content": notes})
        prompts.append(([
            {"role": "system", "content": TOOL_SYSTEM},
            {"role": "user", "content": f"In notes.txt: {change}"},
            {"role": "assistant", "content": read},
            {"role": "user", "content": f"Tool result: {result}\nNow call write_file with "
                                        "the whole new content."}],
            '{"tool": "write_file", "arguments": {"path": "notes.txt", "content": "'))
        notes = notes.replace("Friday", "Thursday") if "Friday" in change else notes
    return prompts


def prose() -> list[Prompt]:
    return [([{"role": "user", "content": text}], "") for text in PROSE]


WORKLOADS = {"code_edit": code_edit, "json_echo": json_echo, "tool_loop": tool_loop,
             "prose": prose}
COPY_HEAVY = ("code_edit", "json_echo", "tool_loop")
