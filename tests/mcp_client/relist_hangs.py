"""A stdio MCP server (Python standard library only) that answers its first `tools/list`
and never another: its `change` tool says the list changed, and the re-list hangs. For
the test of caliban's re-list deadline; the official SDKs cannot be made to hang a list.

Tools: `change` (sends notifications/tools/list_changed, then answers) and `echo`.
"""

import json
import sys

TOOLS = [
    {"name": "change", "description": "Say the tool list changed.",
     "inputSchema": {"type": "object"}},
    {"name": "echo", "description": "Echo the text back.",
     "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}},
]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main():
    listed = False
    for line in sys.stdin:
        message = json.loads(line)
        method, rid = message.get("method"), message.get("id")
        if rid is None:
            continue
        if method == "initialize":
            send({"jsonrpc": "2.0", "id": rid, "result": {
                "protocolVersion": "2025-11-25",
                "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": "relist-hangs", "version": "1"}}})
        elif method == "tools/list":
            if not listed:
                listed = True
                send({"jsonrpc": "2.0", "id": rid, "result": {"tools": TOOLS}})
            # Every later list is never answered.
        elif method == "tools/call":
            name = message["params"]["name"]
            if name == "change":
                send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
                text = "changed"
            else:
                text = "echo: " + message["params"].get("arguments", {}).get("text", "")
            send({"jsonrpc": "2.0", "id": rid,
                  "result": {"content": [{"type": "text", "text": text}]}})
        else:
            send({"jsonrpc": "2.0", "id": rid,
                  "error": {"code": -32601, "message": "method not found"}})


if __name__ == "__main__":
    main()
