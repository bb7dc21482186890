"""Tools the tool-calling tests offer, in OpenAI's request shape."""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: it takes none
# what openai.pydantic_function_tool makes of a model with a nested one: the parameters refer to their own $defs
ADOPT = {
    "type": "function",
    "function": {
        "name": "adopt",
        "parameters": {
            "$defs": {
                "Pet": {
                    "properties": {"name": {"type": "string"}, "kind": {"enum": ["cat", "dog"]}},
                    "required": ["name", "kind"],
                    "type": "object",
                    "additionalProperties": False,
                }
            },
            "properties": {"pet": {"$ref": "#/$defs/Pet"}},
            "required": ["pet"],
            "type": "object",
            "additionalProperties": False,
        },
    },
}
