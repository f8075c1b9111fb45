"""One request, before it is routed: parsed and validated, counted, bounded.

    schema.py         the OpenAI request bodies kvgate accepts (pydantic): the one validator
    rules.py          its rules for the fields kvgate reads, in kvgate's words
    parsed.py         `ParsedRequest`: the body parsed, with what kvgate reads of it
    front.py          parse, identify, normalize and count: on the loop or in a worker
    tokens.py         counting a prompt's tokens
    chat_template.py  what a chat template adds around the messages
    calibration.py    from counted text to vLLM's prompt_tokens, fitted online
    catalog.py        models, their limits, and the worst-case bound
    info.py           what kvgate records of a request as it goes (the access log's line)
"""
