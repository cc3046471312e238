"""The chat front end shared by every API the gateway speaks: a model's chat template
rendered with tools and the messages agents send (:mod:`.templates`, :mod:`.messages`),
the tool-call and reasoning syntax of each template family (:mod:`.formats`), grammars
that constrain the output to it (:mod:`.grammars`), the prompt of one request
(:mod:`.prompt`), and the output read back into content, reasoning and tool calls while it
streams (:mod:`.parsing`).

Pure Python, no llama.cpp: the gateway renders and parses, the runtime only sees a prompt
text, its save boundary and a grammar.
"""
