"""A long, realistic system prompt of a chosen size, built deterministically."""

from __future__ import annotations

_PRODUCTS = ["Atlas Notebook", "Borealis Router", "Cinder Camera", "Delta Drive", "Echo Speaker",
             "Fjord Tablet", "Glacier Watch", "Harbor Dock", "Iris Monitor", "Juniper Keyboard"]
_RULES = [
    "Greet the customer by name when it is known, and never guess a name.",
    "Confirm the order number before discussing any order-specific detail.",
    "Refunds within thirty days need no manager approval; later ones always do.",
    "Never promise a delivery date that the logistics system has not confirmed.",
    "Offer the troubleshooting checklist before suggesting a replacement unit.",
    "Escalate any report of overheating, smoke or swelling batteries immediately.",
    "Keep answers short: three sentences unless the customer asks for more detail.",
    "Do not share internal ticket notes, employee names or supplier information.",
    "When unsure, say so plainly and offer to connect the customer with a specialist.",
    "Summarise the agreed next steps at the end of every conversation.",
]


def build_system_prompt(target_words: int = 1500) -> str:
    """About ``target_words`` words (SmolLM2 tokenizes this at ~1.3 tokens per word)."""
    parts = ["You are Aria, the customer support assistant of Northwind Devices. "
             "Follow the handbook below exactly.\n"]
    words = len(parts[0].split())
    section = 0
    while words < target_words:
        product = _PRODUCTS[section % len(_PRODUCTS)]
        section += 1
        lines = [f"\n## Section {section}: {product}\n",
                 f"The {product} is covered by a {1 + section % 3}-year warranty and ships "
                 f"with firmware {section}.{section % 7}.{section % 5}. Known issue "
                 f"{100 + section}: after an update the {product} may need a restart.\n"]
        for i, rule in enumerate(_RULES[: 3 + section % 5]):
            lines.append(f"{section}.{i + 1}. For the {product}: {rule}\n")
        text = "".join(lines)
        parts.append(text)
        words += len(text.split())
    return "".join(parts)


USER_MESSAGES = [
    "My Atlas Notebook gets very hot while charging. What should I do?",
    "Can I still return a Fjord Tablet I bought five weeks ago?",
    "When will my Harbor Dock order arrive? The number is 44721.",
    "How do I update the firmware on my Glacier Watch?",
    "Is the Delta Drive covered by warranty if I dropped it?",
]
