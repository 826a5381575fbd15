#!/usr/bin/env python3
"""Writes fuzz/seeds/<target>/ from the string literals in each parser's unit tests, with
the knob bytes each target reads first (see src/fuzzing.rs), plus a few hand-made session
files. Run from the repository root: python3 fuzz/make_seeds.py. Idempotent: a seed is
named by the hash of its bytes, and regression inputs already in the directories are kept."""

import hashlib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = os.path.join(ROOT, "fuzz", "seeds")
MAX_SEED = 4096
CHAR = re.compile(r"'(\\u\{[0-9a-f]+\}|\\x..|\\.|[^\\'])'")
RAW = re.compile(r'b?r(#*)"')

def unescape(body):
    out = bytearray()
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode()
            i += 1
            continue
        nxt = body[i + 1]
        i += 2
        if nxt == "\n":
            while i < len(body) and body[i] in " \t\n":
                i += 1
        elif nxt == "x":
            out.append(int(body[i : i + 2], 16))
            i += 2
        elif nxt == "u":
            end = body.index("}", i)
            out += chr(int(body[i + 1 : end], 16)).encode()
            i = end + 1
        else:
            out += {"n": b"\n", "r": b"\r", "t": b"\t", "0": b"\0"}.get(nxt, nxt.encode())
    return bytes(out)


def literals(path):
    """String and byte-string literals after `mod tests`, read with a small scanner that
    steps over comments and char literals so a `'"'` does not start a string."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    tests = text[text.index("#[cfg(test)]\nmod tests") :]
    found = []
    i = 0
    while i < len(tests):
        if tests.startswith("//", i):
            i = tests.index("\n", i)
            continue
        char = CHAR.match(tests, i)
        if char:
            i = char.end()
            continue
        raw = RAW.match(tests, i)
        if raw and (i == 0 or not (tests[i - 1].isalnum() or tests[i - 1] == "_")):
            close = '"' + raw.group(1)
            end = tests.index(close, raw.end())
            value = tests[raw.end() : end].encode()
            i = end + len(close)
        elif tests.startswith('"', i) or tests.startswith('b"', i):
            start = i + (2 if tests[i] == "b" else 1)
            end = start
            while tests[end] != '"':
                end += 2 if tests[end] == "\\" else 1
            value = unescape(tests[start:end])
            i = end + 1
        else:
            i += 1
            continue
        if value and len(value) <= MAX_SEED and value not in found:
            found.append(value)
    return found


def write(target, data):
    directory = os.path.join(SEEDS, target)
    os.makedirs(directory, exist_ok=True)
    name = hashlib.sha1(data).hexdigest()[:16]
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)


def session_files():
    header = b'{"kind":"header","v":1,"run_id":"run-1","created_ms":1,"prompt":"fix it"}\n'
    event = lambda n, text: (
        b'{"kind":"event","cursor":%d,"event":{"type":"AssistantTextDelta","text":"%s"}}\n'
        % (n, text)
    )
    turn_end = (
        b'{"kind":"event","cursor":2,"event":{"type":"TurnEnd","assistant_message":'
        b'{"role":"assistant","content":[{"type":"text","text":"hi"}]},"tool_results":[]}}\n'
    )
    status = b'{"kind":"status","cursor":0,"status":{"state":"running"}}\n'
    permission = (
        b'{"kind":"permission","cursor":1,"request":{"tool_use_id":"t1",'
        b'"tool_name":"Bash","input":{"command":"ls"}}}\n'
    )
    answered = b'{"kind":"permission","cursor":1,"request":null}\n'
    user = b'{"kind":"input","cursor":1,"input":{"type":"user_message","text":"go on"}}\n'
    end = b'{"kind":"input","cursor":3,"input":{"type":"end_input"}}\n'
    unknown = b'{"kind":"bookmark","cursor":5,"note":"from the future"}\n'
    # An event line in another key order, as another writer might produce it.
    reordered = b'{"event":{"type":"Oversized","bytes":9},"cursor":3,"kind":"event"}\n'
    done = b'{"kind":"status","cursor":4,"status":{"state":"done"}}\n'
    full = (
        header + status + event(0, b"h\\u00e9llo") + permission + user + answered
        + event(1, b"x") + turn_end + end + unknown + reordered + done
    )
    return [
        full,
        full[:-7],
        header + event(0, b"a") + b"garbage\n" + event(1, b"b"),
        header + event(0, b"a") + event(2, b"gap"),
        header.replace(b'"v":1', b'"v":2') + event(0, b"a"),
        b"\n" + unknown + header + event(0, b"\\n"),
        header + b"\n\n" + event(0, b"a") + b'{"kind":"event","cursor":1,"event":{}',
    ]


def main():
    zeros = lambda n: bytes(n)
    for lit in literals("src/http/head.rs"):
        write("http_head", zeros(8) + lit)
    for i, lit in enumerate(literals("src/http/body.rs")):
        # Chunked with no cap; every fourth also as Content-Length 5 and read-until-close.
        write("http_body", bytes([0, 0, 0, 255]) + zeros(8) + lit)
        if i % 4 == 0:
            write("http_body", bytes([5, 5, 0, 255]) + zeros(8) + lit)
            write("http_body", bytes([6, 0, 0, 255]) + zeros(8) + lit)
    for lit in literals("src/http/sse.rs"):
        write("sse", zeros(4) + lit)
    for lit in literals("src/jsonrpc.rs"):
        write("jsonrpc", lit)
    for path in ["src/permissions/pattern.rs", "src/permissions/mod.rs"]:
        for i, lit in enumerate(literals(path)):
            if b"\n" not in lit:
                knob = bytes([i % 3, 0, 0, i % 8])
                write("permission_pattern", knob + lit + b"\n*\n\n" + lit)
    for lit in literals("src/permissions/shell.rs"):
        write("shell_split", zeros(2) + lit)
    for i, data in enumerate(session_files()):
        write("session_file", bytes([0, 128, 0, 2, 8]) + data)


if __name__ == "__main__":
    main()
