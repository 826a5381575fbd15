#!/usr/bin/env python3
"""Checks src/surface/openapi.json, the document `caliban http serve` serves at GET /openapi.json.

Usage (from anywhere; needs the packages in tests/requirements-openapi.txt):

  openapi_check.py [--spec PATH]
      Validate the document as OpenAPI 3.1 (openapi-spec-validator), plus house rules: every
      response body has a schema, every 2xx response has an example, every operation documents
      401 unless it is open to every peer (`security: []`).
  openapi_check.py [--spec PATH] --examples
      The above, then validate every `example` and `examples[*].value` in the document against
      the schema beside it (a streaming media type's example is split into items and each is
      validated against its `x-item-schema`).
  openapi_check.py [--spec PATH] --response ROUTE_KEY STATUS FILE [--media-type TYPE]
                   [--stream-complete]
      The above (without examples), then validate a captured response body in FILE against the
      schema the document gives for that operation and status. ROUTE_KEY is "METHOD PATH", with
      PATH either the template (`GET /runs/{id}/events`) or a concrete path
      (`GET /runs/run-1/events`; a query string is ignored). TYPE picks the media type when the
      response has several; without it a body that parses as one JSON document is
      application/json, one starting with an SSE field is text/event-stream, and anything else
      is application/x-ndjson. Streams are checked item by item, and their cursors must never
      go backwards (and in SSE an event, and only an event, has an `id:`, equal to its cursor). With --stream-complete the
      stream must also start with a status item and end with its only terminal status.

Exit status: 0 valid, 1 invalid (the first line of output says why), 2 usage error.
"""

import argparse
import json
import re
import sys
from pathlib import Path
from urllib.parse import quote

try:
    import jsonschema
    from jsonschema import Draft202012Validator
    import referencing.exceptions
    from openapi_spec_validator import OpenAPIV31SpecValidator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012
except ImportError as err:  # pragma: no cover - environment problem, not a check failure
    print(f"openapi_check: missing dependency ({err}); pip install -r tests/requirements-openapi.txt",
          file=sys.stderr)
    sys.exit(2)

DEFAULT_SPEC = Path(__file__).resolve().parent.parent / "src" / "surface" / "openapi.json"
DOC_URI = "urn:caliban:openapi"
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
SEQUENTIAL = ("application/x-ndjson", "text/event-stream")


class CheckFailed(Exception):
    pass


def pointer(*parts):
    """A JSON pointer fragment for the given path parts, URI-escaped."""
    escaped = (str(p).replace("~", "~0").replace("/", "~1") for p in parts)
    return "#/" + "/".join(quote(p, safe="~") for p in escaped)


class Doc:
    def __init__(self, path, data=None):
        """The document at `path`, or `data` already parsed (`path` then only names it)."""
        self.path = Path(path)
        if data is not None:
            self.data = data
        else:
            try:
                self.data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                raise CheckFailed(f"{self.path}: cannot read the document: {err}") from err
        resource = Resource.from_contents(self.data, default_specification=DRAFT202012)
        self.registry = Registry().with_resource(DOC_URI, resource)

    def validator_at(self, *parts):
        """A Draft 2020-12 validator for the schema at this location in the document, with
        `#/components/...` references resolved against the document."""
        return Draft202012Validator({"$ref": DOC_URI + pointer(*parts)}, registry=self.registry)

    def operations(self):
        for path, item in self.data.get("paths", {}).items():
            for method in METHODS:
                if method in item:
                    yield method, path, item[method]

    def deref(self, node):
        """Follows a local `$ref` (to a response, say) to its target and returns (target, parts)."""
        parts = None
        while isinstance(node, dict) and "$ref" in node:
            target = node["$ref"]
            if not target.startswith("#/"):
                raise CheckFailed(f"only local $ref is supported, found {target}")
            parts = [p.replace("~1", "/").replace("~0", "~") for p in target[2:].split("/")]
            node = self.data
            for p in parts:
                node = node[p]
        return node, parts


def validate_document(doc):
    try:
        errors = list(OpenAPIV31SpecValidator(doc.data).iter_errors())
    except Exception as err:  # the validator raises on some faults, e.g. a dangling $ref
        what = f"$ref {err.ref} points nowhere" if hasattr(err, "ref") else short(str(err))
        raise CheckFailed(f"{doc.path}: not a valid OpenAPI 3.1 document: "
                          f"{type(err).__name__}: {what}") from err
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in getattr(first, "absolute_path", []) or [])
        raise CheckFailed(f"{doc.path}: not a valid OpenAPI 3.1 document ({len(errors)} error(s)); "
                          f"first at /{where}: {first.message if hasattr(first, 'message') else first}")
    if doc.data.get("openapi") != "3.1.0":
        raise CheckFailed(f"{doc.path}: `openapi` is {doc.data.get('openapi')!r}, expected '3.1.0'")

    problems = []
    count = 0
    for method, path, op in doc.operations():
        count += 1
        key = f"{method.upper()} {path}"
        responses = op.get("responses", {})
        # `security: []` marks the one operation open to every peer (`/healthz`).
        if "401" not in responses and op.get("security") != []:
            problems.append(f"{key}: no 401 response")
        if "401" in responses and op.get("security") == []:
            problems.append(f"{key}: open to every peer but documents a 401")
        for status, resp in responses.items():
            resp, _ = doc.deref(resp)
            for media, content in resp.get("content", {}).items():
                if "schema" not in content:
                    problems.append(f"{key} {status} {media}: no schema")
                if media in SEQUENTIAL and "x-item-schema" not in content:
                    problems.append(f"{key} {status} {media}: streaming media type without x-item-schema")
                if status.startswith("2") and "example" not in content and "examples" not in content:
                    problems.append(f"{key} {status} {media}: no example")
    if problems:
        raise CheckFailed(f"{doc.path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return count


def stream_items(text, media):
    """Splits a streaming body into (item, sse_id) pairs; raises CheckFailed on framing errors."""
    items = []
    if media == "application/x-ndjson":
        if text and not text.endswith("\n"):
            raise CheckFailed("NDJSON body does not end with a newline")
        for n, line in enumerate(text.split("\n")[:-1] if text else [], 1):
            if not line.strip():
                raise CheckFailed(f"NDJSON line {n} is blank")
            try:
                items.append((json.loads(line), None))
            except ValueError as err:
                raise CheckFailed(f"NDJSON line {n} is not JSON: {err}") from err
        return items
    # text/event-stream, per the WHATWG parsing rules (comments and unknown fields ignored).
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if text and not text.endswith("\n\n"):
        raise CheckFailed("SSE body does not end with a blank line (the last event is unterminated)")
    for n, block in enumerate(b for b in text.split("\n\n") if b.strip()):
        data, sse_id = [], None
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data":
                data.append(value)
            elif field == "id":
                sse_id = value
        if not data:
            continue  # a comment-only keepalive or a bare id
        payload = "\n".join(data)
        try:
            items.append((json.loads(payload), sse_id))
        except ValueError as err:
            raise CheckFailed(f"SSE event {n + 1}'s data is not JSON: {err}") from err
    return items


def short(text, limit=400):
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def first_error(validator, instance, limit=400):
    err = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if err is None:
        return None
    where = "/".join(str(p) for p in err.absolute_path)
    message = err.message if len(err.message) <= limit else err.message[:limit] + "..."
    return f"at /{where}: {message}"


def describe(parts):
    """A readable location: `paths["/runs"]/post/responses/200/...`."""
    if len(parts) >= 2 and parts[0] == "paths":
        return f'paths["{parts[1]}"]/' + "/".join(parts[2:])
    return "/".join(parts)


def check_body(doc, parts, content, media, body, label):
    """Validates one body (already decoded for JSON media types) against the schema of `content`,
    whose location in the document is `parts`."""
    if media in SEQUENTIAL:
        if not isinstance(body, str):
            raise CheckFailed(f"{label}: a {media} body must be text")
        items = stream_items(body, media)
        if not items:
            raise CheckFailed(f"{label}: the stream has no items")
        item_validator = doc.validator_at(*parts, "x-item-schema")
        last_cursor = None
        for n, (item, sse_id) in enumerate(items, 1):
            problem = first_error(item_validator, item)
            if problem:
                raise CheckFailed(f"{label}: item {n} {problem}")
            cursor = item.get("cursor")
            if last_cursor is not None and cursor < last_cursor:
                raise CheckFailed(f"{label}: item {n}'s cursor {cursor} goes back from {last_cursor}")
            if sse_id is not None and sse_id != str(cursor):
                raise CheckFailed(f"{label}: item {n}'s SSE id {sse_id!r} is not its cursor {cursor}")
            if media == "text/event-stream" and ("event" in item) != (sse_id is not None):
                what = "an event without" if "event" in item else "a status or permission line with"
                raise CheckFailed(f"{label}: item {n} is {what} an SSE id (ids name events only)")
            last_cursor = cursor
        return len(items)
    problem = first_error(doc.validator_at(*parts, "schema"), body)
    if problem:
        raise CheckFailed(f"{label}: {problem}")
    return 1


def check_examples(doc):
    checked = 0

    def visit(node, parts):
        nonlocal checked
        if isinstance(node, dict):
            # A media type object or a parameter: a schema with examples beside it.
            if "schema" in node and ("example" in node or "examples" in node):
                samples = [("example", node["example"])] if "example" in node else []
                for name, ex in (node.get("examples") or {}).items():
                    ex, _ = doc.deref(ex)
                    if "value" in ex:
                        samples.append((f"examples/{name}", ex["value"]))
                is_media = len(parts) >= 2 and parts[-2] == "content"
                media = parts[-1].split(";")[0].strip() if is_media else None
                for label, value in samples:
                    where = f"example {describe(parts)}/{label}"
                    # A streaming example is the whole body: a string (its schema) whose items
                    # must each match the item schema.
                    problem = first_error(doc.validator_at(*parts, "schema"), value)
                    if problem:
                        raise CheckFailed(f"{where}: {problem}")
                    if media in SEQUENTIAL:
                        check_body(doc, parts, node, media, value, where)
                    checked += 1
            for key, child in node.items():
                if key not in ("example", "examples", "schema", "x-item-schema"):
                    visit(child, parts + [key])
        elif isinstance(node, list):
            for i, child in enumerate(node):
                visit(child, parts + [str(i)])

    visit(doc.data.get("paths", {}), ["paths"])
    visit(doc.data.get("components", {}), ["components"])
    return checked


def find_operation(doc, route_key):
    method, _, path = route_key.strip().partition(" ")
    method, path = method.lower(), path.strip().split("?", 1)[0]
    if method not in METHODS or not path.startswith("/"):
        raise CheckFailed(f"bad ROUTE_KEY {route_key!r}: expected 'METHOD /path'")
    paths = doc.data.get("paths", {})
    candidates = [path] if path in paths else [
        template for template in paths
        if re.fullmatch("".join("[^/]+" if seg.startswith("{") else re.escape(seg)
                                for seg in re.split(r"(\{[^}/]+\})", template)), path)
    ]
    for template in candidates:
        if method in paths[template]:
            return template, method
    raise CheckFailed(f"{route_key}: no such operation in the document")


def check_response(doc, route_key, status, file, media_type, stream_complete=False):
    template, method = find_operation(doc, route_key)
    label = f"{method.upper()} {template} {status}"
    responses = doc.data["paths"][template][method]["responses"]
    key = next((k for k in (status, f"{status[0]}XX", "default") if k in responses), None)
    if key is None:
        raise CheckFailed(f"{label}: status not documented for this operation")
    resp, ref_parts = doc.deref(responses[key])
    parts = ref_parts or ["paths", template, method, "responses", key]
    content = resp.get("content", {})
    try:
        raw = Path(file).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CheckFailed(f"{label}: cannot read {file}: {err}") from err
    if not content:
        if raw:
            raise CheckFailed(f"{label}: the document says no body, but {file} has {len(raw)} bytes")
        return f"{label}: empty body, as documented"

    by_base = {m.split(";")[0].strip(): m for m in content}
    if media_type:
        base = media_type.split(";")[0].strip()
        if base not in by_base:
            raise CheckFailed(f"{label}: media type {base} not documented (have {', '.join(by_base)})")
    elif len(by_base) == 1:
        base = next(iter(by_base))
    else:
        try:
            json.loads(raw)
            base = "application/json"
        except ValueError:
            base = "text/event-stream" if re.match(r"(data|id|event|retry)?:", raw.lstrip("\r\n")) else "application/x-ndjson"
        if base not in by_base:
            raise CheckFailed(f"{label}: body looks like {base}, which is not documented (have {', '.join(by_base)})")
    media = by_base[base]
    parts = parts + ["content", media]

    if base == "application/json" or base.endswith("+json"):
        try:
            body = json.loads(raw)
        except ValueError as err:
            raise CheckFailed(f"{label}: {file} is not JSON: {err}") from err
    else:
        body = raw
    n = check_body(doc, parts, content[media], base, body, label)
    if stream_complete:
        if base not in SEQUENTIAL:
            raise CheckFailed(f"{label}: --stream-complete given, but the body is {base}, not a stream")
        items = [item for item, _ in stream_items(body, base)]
        if "status" not in items[0]:
            raise CheckFailed(f"{label}: the stream's first item is not a status")
        last = items[-1].get("status", {}).get("state")
        if last not in ("done", "failed"):
            raise CheckFailed(f"{label}: the stream's last item is not a terminal status")
        terminal = [i for i, item in enumerate(items, 1)
                    if item.get("status", {}).get("state") in ("done", "failed")]
        if terminal != [len(items)]:
            raise CheckFailed(f"{label}: item {terminal[0]} is a terminal status, but the stream goes on")
    what = f"{n} stream items validate" if base in SEQUENTIAL else "body validates"
    return f"{label} ({base}): {what}"


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Validate caliban's OpenAPI document, its examples, or a captured response.")
    parser.add_argument("--spec", default=str(DEFAULT_SPEC), help="the document (default: %(default)s)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--examples", action="store_true", help="also validate every example")
    mode.add_argument("--response", nargs=3, metavar=("ROUTE_KEY", "STATUS", "FILE"),
                      help="validate a captured response body against the document")
    parser.add_argument("--media-type", help="with --response: the body's media type")
    parser.add_argument("--stream-complete", action="store_true",
                        help="with --response: the stream must start with a status and end with "
                             "its only terminal status")
    args = parser.parse_args(argv)
    if (args.media_type or args.stream_complete) and not args.response:
        parser.error("--media-type and --stream-complete need --response")
    if args.response and not re.fullmatch(r"[1-5]\d\d", args.response[1]):
        parser.error(f"STATUS must be a 3-digit HTTP status, not {args.response[1]!r}")

    try:
        doc = Doc(args.spec)
        ops = validate_document(doc)
        if args.response:
            route_key, status, file = args.response
            result = check_response(doc, route_key, status, file, args.media_type, args.stream_complete)
            print(f"ok: {result}")
        elif args.examples:
            n = check_examples(doc)
            print(f"ok: {doc.path.name} is valid OpenAPI 3.1.0 ({ops} operations) and all {n} examples validate")
        else:
            print(f"ok: {doc.path.name} is valid OpenAPI 3.1.0 ({ops} operations)")
    except CheckFailed as err:
        print(f"FAIL: {err}")
        return 1
    except referencing.exceptions.Unresolvable as err:
        what = getattr(err, "ref", None) or short(str(err))
        print(f"FAIL: unresolvable $ref in {args.spec}: {what}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
