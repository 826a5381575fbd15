#!/usr/bin/env python3
"""A schema-driven property test of `caliban http serve` against the document it serves.

Usage (needs the packages in tests/requirements-openapi.txt; tests/openapi.rs runs it):

  openapi_props.py --base http://127.0.0.1:PORT --run RUN_ID [--seed N] [--cases N]

It fetches GET /openapi.json from the server, then for every operation with inputs (query
and header parameters, a JSON request body) generates requests from the document: values
the schemas allow, and values they refuse (a missing required field, a wrong type, `null`
where it is not allowed, a string below `minLength` or outside `pattern`, an integer
outside `minimum`/`maximum`, a value outside an `enum`, a body that is not an object). Each
generated value is classified by `jsonschema` against the document's own schema, never by
the generator's intent, so a generator slip cannot pass for a server fault. The requests go
to the server (loopback only) and every answer must agree with the document:

- its status is one the operation documents, and its body validates against the schema
  the document gives for that status and media type;
- a request the schemas allow is not refused as malformed (no 400, 415 or 422);
- a request they refuse is refused (400 or 422).

A string schema that lists `examples` holds meaning a schema cannot state (a rule pattern,
a directory inside the workspace): its allowed values are drawn from those examples, and
only its `minLength`/`pattern`/type are probed with other values. `RUN_ID` names a
finished, non-interactive run for the `{id}` routes. The random choices come from one
seeded generator, so a run is reproducible; the number of requests is bounded by --cases.

Exit status: 0 and a line starting `ok:` when everything agrees; 1 and one `FAIL:` line per
disagreement (up to 40) otherwise; 2 for a usage or setup error.
"""

import argparse
import http.client
import json
import random
import sys
from pathlib import Path
from urllib.parse import quote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openapi_check  # noqa: E402  (the document checker: Doc, check_body)

MALFORMED = {400, 415, 422}
REFUSED = {400, 422}
U64_MAX = 2**64 - 1
MAX_REPORTED = 40
TIMEOUT_S = 15
# Characters for free strings: printable ASCII and a few wider ones.
ALPHABET = "abcXYZ019 _-./:*()[]{}\"'\\é€😀"


class Skip(Exception):
    """No value of the wanted kind can be made for this schema."""


class Gen:
    def __init__(self, doc, rng):
        self.doc = doc
        self.rng = rng

    def resolve(self, schema):
        while isinstance(schema, dict) and "$ref" in schema:
            node = self.doc.data
            for part in schema["$ref"][2:].split("/"):
                node = node[part.replace("~1", "/").replace("~0", "~")]
            schema = node
        return schema

    def types(self, schema):
        t = schema.get("type")
        if isinstance(t, list):
            return t
        if t:
            return [t]
        if "const" in schema:
            return [json_type(schema["const"])]
        if "enum" in schema:
            return sorted({json_type(v) for v in schema["enum"]})
        if "properties" in schema or "required" in schema:
            return ["object"]
        return []

    # ---- values a schema allows --------------------------------------------------------

    def valid(self, schema, depth=0):
        schema = self.resolve(schema)
        if depth > 6:
            raise Skip()
        for key in ("anyOf", "oneOf"):
            if key in schema and "type" not in schema and "properties" not in schema:
                return self.valid(self.rng.choice(schema[key]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return self.rng.choice(schema["enum"])
        kinds = self.types(schema)
        if not kinds:
            return self.rng.choice([1, "x", True, None, [], {}])
        kind = self.rng.choice(kinds)
        if kind == "null":
            return None
        if kind == "boolean":
            return self.rng.choice([True, False])
        if kind == "integer":
            return self.integer(schema)
        if kind == "number":
            return self.rng.choice([0, 1.5, -2.25])
        if kind == "string":
            return self.string(schema)
        if kind == "array":
            items = schema.get("items", {})
            return [self.valid(items, depth + 1) for _ in range(self.rng.randint(0, 3))]
        if kind == "object":
            return self.object(schema, depth)
        raise Skip()

    def integer(self, schema):
        lo = schema.get("minimum")
        hi = schema.get("maximum")
        # Without a bound, probe far past every machine integer: a server that refuses
        # those has a bound the document does not state.
        lo_probe = lo if lo is not None else -(10**30)
        hi_probe = hi if hi is not None else 10**30
        picks = [lo_probe, hi_probe, lo_probe + 1, hi_probe - 1]
        small_hi = min(hi_probe, lo_probe + 50)
        picks.append(self.rng.randint(lo_probe, max(lo_probe, small_hi)))
        picks.append(self.rng.randint(lo_probe, hi_probe))
        return self.rng.choice(picks)

    def string(self, schema):
        if "examples" in schema:
            return self.rng.choice(schema["examples"])
        low = schema.get("minLength", 0)
        high = min(schema.get("maxLength", low + 12), low + 12)
        n = self.rng.choice([low, high, self.rng.randint(low, high)])
        return "".join(self.rng.choice(ALPHABET) for _ in range(n))

    def object(self, schema, depth):
        props = schema.get("properties", {})
        required = schema.get("required", [])
        out = {}
        for name, sub in props.items():
            if name in required or self.rng.random() < 0.5:
                out[name] = self.valid(sub, depth + 1)
        for name in required:
            if name not in out:
                out[name] = self.rng.choice([1, "x"])
        return out

    # ---- values a schema refuses -------------------------------------------------------

    def invalid(self, schema, depth=0):
        """Candidate values, most of them refused by `schema` (the caller checks which)."""
        schema = self.resolve(schema)
        out = [None, True, 7, -1, 1.5, "x", "", " ", [], {}, [None], {"x": 1}]
        kinds = self.types(schema)
        if "integer" in kinds:
            lo, hi = schema.get("minimum"), schema.get("maximum")
            if lo is not None:
                out.append(lo - 1)
            if hi is not None:
                out.append(hi + 1)
            out += [2**64, -(2**63) - 1, 10**30]
        if "enum" in schema:
            out.append("not-a-member")
        if "array" in kinds and depth < 3:
            items = schema.get("items", {})
            out += [[bad] for bad in self.invalid(items, depth + 1)[:6]]
        if "object" in kinds and depth < 3:
            props = schema.get("properties", {})
            try:
                base = self.valid(schema, depth)
            except Skip:
                base = {}
            if not isinstance(base, dict):
                base = {}
            for name in schema.get("required", []):
                missing = dict(base)
                missing.pop(name, None)
                out.append(missing)
            for name, sub in props.items():
                for bad in self.rng.sample(self.invalid(sub, depth + 1), 4):
                    changed = dict(base)
                    changed[name] = bad
                    out.append(changed)
        return out


def json_type(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def param_text(value):
    """How a parameter value goes into a query string or header."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


class Client:
    def __init__(self, base):
        parts = urlsplit(base)
        if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("openapi_props: --base must be a loopback address")
        self.host, self.port = parts.hostname, parts.port

    def send(self, method, path, headers, body):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.getheader("content-type") or "", data
        finally:
            conn.close()


class Checker:
    def __init__(self, doc, client, run_id):
        self.doc = doc
        self.client = client
        self.run_id = run_id
        self.problems = []
        self.count = {"valid": 0, "invalid": 0}
        self.statuses = {}

    def validate_answer(self, template, method, status, content_type, data):
        """A problem with an answer, judged by the document alone, or None."""
        op = self.doc.data["paths"][template][method]
        responses = op["responses"]
        key = next((k for k in (str(status), f"{str(status)[0]}XX", "default") if k in responses), None)
        if key is None:
            return f"status {status} is not documented (documented: {', '.join(responses)})"
        resp, ref_parts = self.doc.deref(responses[key])
        parts = ref_parts or ["paths", template, method, "responses", key]
        content = resp.get("content", {})
        if not content:
            return None if not data else f"status {status} documents no body, got {len(data)} bytes"
        base = content_type.split(";")[0].strip().lower()
        media = next((m for m in content if m.split(";")[0].strip().lower() == base), None)
        if media is None:
            return f"status {status}: media type {base!r} is not documented (have {', '.join(content)})"
        try:
            text = data.decode("utf-8")
            body = json.loads(text) if base == "application/json" else text
        except (UnicodeDecodeError, ValueError) as err:
            return f"status {status}: the {base} body does not decode: {err}"
        try:
            openapi_check.check_body(self.doc, parts + ["content", media], content[media], base, body, "body")
        except openapi_check.CheckFailed as err:
            return f"status {status}: {err}"
        return None

    def check(self, template, method, path, headers, body, valid, what, refused=REFUSED):
        self.count["valid" if valid else "invalid"] += 1
        try:
            status, content_type, data = self.client.send(method.upper(), path, headers, body)
        except (OSError, http.client.HTTPException) as err:
            self.problems.append(f"{method.upper()} {path} ({what}): no answer: {err}")
            return
        self.statuses[status] = self.statuses.get(status, 0) + 1
        label = f"{method.upper()} {path} ({what}) -> {status} {data[:160]!r}"
        problem = self.validate_answer(template, method, status, content_type, data)
        if problem:
            self.problems.append(f"{label}: {problem}")
        elif valid and status in MALFORMED:
            self.problems.append(f"{label}: the document allows this request, the server refuses it")
        elif not valid and status not in refused:
            self.problems.append(f"{label}: the document refuses this request, the server does not")


def classify(validator, value):
    return next(iter(validator.iter_errors(value)), None) is None


def run(doc, client, run_id, rng, cases):
    gen = Gen(doc, rng)
    checker = Checker(doc, client, run_id)
    for method, template, op in sorted(doc.operations(), key=lambda o: (o[1], o[0])):
        item = doc.data["paths"][template]
        params = [gen.resolve(p) for p in item.get("parameters", []) + op.get("parameters", [])]
        # `{id}` is the run the caller made; other path values are not generated.
        path = template.replace("{id}", run_id)
        query_params = [p for p in params if p["in"] in ("query", "header")]
        body_schema = None
        body = op.get("requestBody", {}).get("content", {}).get("application/json")
        if body is not None:
            body_schema = body["schema"]
        if not query_params and body_schema is None:
            continue
        param_validators = {
            p["name"]: doc.validator_at(*param_location(doc, template, method, p), "schema")
            for p in query_params
        }
        body_validator = None
        if body_schema is not None:
            body_validator = doc.validator_at("paths", template, method, "requestBody", "content",
                                              "application/json", "schema")

        def send(values, body_value, valid, what):
            query = []
            headers = {"host": f"127.0.0.1:{client.port}"}
            for p in query_params:
                if p["name"] not in values:
                    continue
                text = param_text(values[p["name"]])
                if p["in"] == "query":
                    query.append(f"{quote(p['name'])}={quote(text, safe='')}")
                else:
                    # Header values are bytes on the wire: keep them ASCII.
                    headers[p["name"]] = text.encode("ascii", "replace").decode()
            target = path + ("?" + "&".join(query) if query else "")
            data = None
            if body_schema is not None:
                headers["content-type"] = "application/json"
                data = json.dumps(body_value).encode()
            checker.check(template, method, target, headers, data, valid, what)

        def valid_params():
            values = {}
            for p in query_params:
                if p.get("required") or rng.random() < 0.6:
                    values[p["name"]] = gen.valid(p["schema"])
            return values

        def valid_body():
            for _ in range(50):
                try:
                    value = gen.valid(body_schema)
                except Skip:
                    continue
                if classify(body_validator, value):
                    return value
            raise Skip()

        if body_schema is not None:
            # A body the document's one media type does not cover, and one that is not JSON.
            host = {"host": f"127.0.0.1:{client.port}"}
            checker.check(template, method, path, {**host, "content-type": "text/plain"}, b"{}",
                          False, "content-type text/plain", refused={415})
            checker.check(template, method, path, {**host, "content-type": "application/json"},
                          b"{nope", False, "a body that is not JSON", refused={400})

        for _ in range(cases):
            # A request the document allows.
            try:
                values = valid_params()
                if not all(classify(param_validators[k], v) for k, v in values.items()):
                    continue
                body_value = valid_body() if body_schema is not None else None
            except Skip:
                continue
            send(values, body_value, True, "allowed")
            # The same with one part the document refuses.
            targets = [("param", p) for p in query_params] + ([("body", None)] if body_schema is not None else [])
            kind, p = rng.choice(targets)
            if kind == "param":
                bad = [v for v in gen.invalid(p["schema"]) if not classify(param_validators[p["name"]], v)
                       and isinstance(v, (str, int, float, bool))]
                if not bad:
                    continue
                refused = dict(values)
                refused[p["name"]] = rng.choice(bad)
                # A header or query value is text: one that reads as an allowed value is not
                # a refused one.
                if classify(param_validators[p["name"]], coerce(param_text(refused[p["name"]]), p)):
                    continue
                send(refused, body_value, False, f"{p['name']}={param_text(refused[p['name']])!r}")
            else:
                bad = [v for v in gen.invalid(body_schema) if not classify(body_validator, v)]
                if bad:
                    value = rng.choice(bad)
                    send(values, value, False, f"body {json.dumps(value)[:80]}")
    return checker


def coerce(text, param):
    """The typed value a server reading `text` for this parameter could see."""
    kinds = param["schema"].get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "integer" in kinds:
        try:
            return int(text)
        except ValueError:
            return text
    return text


def param_location(doc, template, method, param):
    """Where a parameter object sits in the document (its own `$ref` target if it has one)."""
    item = doc.data["paths"][template]
    for where, params in (([template], item.get("parameters", [])),
                          ([template, method], item.get(method, {}).get("parameters", []))):
        for i, p in enumerate(params):
            target, ref_parts = doc.deref(p)
            if (target.get("name"), target.get("in")) == (param["name"], param["in"]):
                return ref_parts or ["paths", *where, "parameters", str(i)]
    raise SystemExit(f"openapi_props: cannot locate parameter {param['name']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the server, e.g. http://127.0.0.1:8730")
    parser.add_argument("--run", required=True, help="a finished, non-interactive run id")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--cases", type=int, default=20, help="requests of each kind per operation")
    args = parser.parse_args(argv)

    client = Client(args.base)
    status, _, data = client.send("GET", "/openapi.json", {"host": f"127.0.0.1:{client.port}"}, None)
    if status != 200:
        print(f"openapi_props: GET /openapi.json answered {status}", file=sys.stderr)
        return 2
    try:
        doc = openapi_check.Doc("GET /openapi.json", json.loads(data))
        openapi_check.validate_document(doc)
    except openapi_check.CheckFailed as err:
        print(f"FAIL: the served document: {err}")
        return 1

    checker = run(doc, client, args.run, random.Random(args.seed), args.cases)
    if checker.problems:
        for problem in checker.problems[:MAX_REPORTED]:
            print(f"FAIL: {problem}")
        if len(checker.problems) > MAX_REPORTED:
            print(f"FAIL: … and {len(checker.problems) - MAX_REPORTED} more")
        return 1
    statuses = ", ".join(f"{s}×{n}" for s, n in sorted(checker.statuses.items()))
    print(f"ok: {checker.count['valid']} allowed and {checker.count['invalid']} refused requests "
          f"agree with the document (seed {args.seed}; statuses {statuses})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
