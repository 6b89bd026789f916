"""The structured-output cases compared with xgrammar (tools/grammar_xgrammar.py) and
run by tests/integration/test_structured_outputs.py: 50+ JSON Schemas, regular
expressions, choice lists and EBNF grammars, each as {"kind", "text", "compact"}."""
import json

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "boolean"},
                                      "c": {"type": "null"}}, "required": ["a"]},
    {"type": "object", "properties": {"x": {"type": "string", "maxLength": 5}}, "required": ["x"]},
    {"type": "object", "properties": {"x": {"type": "string", "minLength": 2, "maxLength": 4}},
     "required": ["x"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["n"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -50, "maximum": 50}},
     "required": ["n"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10}}, "required": ["n"]},
    {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}}, "required": ["n"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["tags"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "array", "items": {"type": "number"}},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2},
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"enum": ["a", 1, None, True]},
    {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    {"oneOf": [{"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]},
               {"type": "array", "items": {"type": "integer"}}]},
    {"type": ["string", "null"]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"]},
    {"definitions": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/definitions/node"}, {"type": "null"}]}},
        "required": ["v", "next"]}}, "$ref": "#/definitions/node"},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},
    {"type": "object", "properties": {"t": {"type": "string", "format": "time"}}, "required": ["t"]},
    {"type": "object", "properties": {"dt": {"type": "string", "format": "date-time"}}, "required": ["dt"]},
    {"type": "object", "properties": {"u": {"type": "string", "format": "uuid"}}, "required": ["u"]},
    {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}}, "required": ["ip"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"},
                                      "c": {"type": "string"}}, "required": ["b"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {"type": "integer"}},
     "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string"}}, "required": ["id", "name"]},
        "roles": {"type": "array", "items": {"enum": ["admin", "user"]}}}, "required": ["user", "roles"]},
    {"type": "object", "properties": {"p": {"type": "array", "prefixItems": [{"type": "string"},
                                                                             {"type": "integer"}],
                                            "items": False}}, "required": ["p"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0}}, "required": ["x"]},
    {"type": "object", "properties": {"e": {"type": "integer", "exclusiveMinimum": 0,
                                            "exclusiveMaximum": 10}}, "required": ["e"]},
    {"type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number"},
                                      "in_stock": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["name", "price", "in_stock", "tags"]},
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 1}}, "required": ["s"]},
    {"type": "object", "properties": {"q": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
     "required": ["q"]},
]

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]+@[a-z]+\.(com|org)",
    r"\d+(\.\d+)?",
    r"[A-Z][a-z]{2,8}",
    r"(ab)*c",
    r"\w+ \w+",
    r"0x[0-9a-fA-F]{1,8}",
    r"[^,]{1,10},[^,]{1,10}",
    r"(true|false)",
    r"\d{4}-\d{2}-\d{2}",
    r"a.c",
    r"(\+|-)?[0-9]+",
    r"[a-z]{1,3}(,[a-z]{1,3}){0,3}",
    r"héllo|wörld",
]

CHOICES = [
    ["positive", "negative", "neutral"],
    ["A", "B", "C", "D"],
    ["yes", "no"],
    ["red apple", "green apple", "banana"],
    ["日本", "中国", "한국"],
]

GRAMMARS = [
    'root ::= "hello" " " name\nname ::= [a-z]+',
    'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"',
    'root ::= item ("," item){0,3}\nitem ::= "x" | "y" | "z"',
    'root ::= "SELECT " cols " FROM " [a-z]+\ncols ::= [a-z]+ (", " [a-z]+)*',
    'root ::= [^\\n]{1,20} "\\n"',
]


def cases():
    out = []
    for s in SCHEMAS:
        out.append({"kind": "json_schema", "text": json.dumps(s), "compact": False})
    for s in SCHEMAS[:10]:
        out.append({"kind": "json_schema", "text": json.dumps(s), "compact": True})
    for r in REGEXES:
        out.append({"kind": "regex", "text": r, "compact": False})
    for c in CHOICES:
        out.append({"kind": "choice", "text": json.dumps(c, ensure_ascii=False), "compact": False})
    for g in GRAMMARS:
        out.append({"kind": "grammar", "text": g, "compact": False})
    out.append({"kind": "json_object", "text": "", "compact": False})
    return out
