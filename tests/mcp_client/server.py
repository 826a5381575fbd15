"""An MCP server for caliban's MCP client tests, written with the official Python SDK
(`mcp`'s MCPServer, which mcp 2.x calls what 1.x called FastMCP).

    server.py stdio
    server.py http PORT      Streamable HTTP at /mcp (with an event store, so streams resume)
    server.py sse PORT       the legacy HTTP+SSE transport at /sse

Tools: echo, slow (sleeps, no progress), ticking (sleeps, reporting progress), crash (the
process exits mid-call), grow (adds a tool and says the list changed), picture (an image
and a resource), hop (closes its own SSE stream mid-call, so the client must resume it).
"""

import os
import sys
from itertools import count

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.utilities.types import Image
from mcp.server.streamable_http import EventMessage, EventStore

server = MCPServer("caliban-test")


@server.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    return f"echo: {text}"


def mark(name):
    """Leaves a file in $MARK_DIR for the test to see (it cannot see inside the server)."""
    directory = os.environ.get("MARK_DIR")
    if directory:
        with open(os.path.join(directory, name), "w") as f:
            f.write(name)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep for a while without reporting progress."""
    mark("slow-started")
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        # The SDK cancels the handler when the client sends notifications/cancelled.
        mark("slow-cancelled")
        raise
    return "slept"


@server.tool()
async def ticking(seconds: float, ctx: Context) -> str:
    """Sleep for a while, reporting progress every 0.2 s."""
    steps = int(seconds / 0.2)
    for i in range(steps):
        await ctx.report_progress(i + 1, steps)
        await anyio.sleep(0.2)
    return f"ticked {steps} times"


@server.tool()
def crash() -> str:
    """Exit the process in the middle of the call."""
    sys.stdout.flush()
    os._exit(3)


@server.tool()
async def grow(ctx: Context) -> str:
    """Add a tool named `late` and tell the client the tool list changed."""

    def late() -> str:
        """A tool added at run time."""
        return "late tool ran"

    server.add_tool(late, name="late")
    # Related to this request, so over HTTP it travels on this call's stream, before the
    # result (unrelated, it would take the standalone GET stream, and race the result).
    from mcp.types import ToolListChangedNotification

    await ctx.session.send_notification(
        ToolListChangedNotification(), related_request_id=ctx.request_id
    )
    return "grown"


@server.tool()
def picture() -> list:
    """An image and an embedded resource."""
    from mcp.types import EmbeddedResource, TextResourceContents

    return [
        Image(data=b"\x89PNG\r\n\x1a\n", format="png"),
        EmbeddedResource(
            type="resource",
            resource=TextResourceContents(uri="file:///notes.txt", text="resource body", mimeType="text/plain"),
        ),
    ]


@server.tool()
async def hop(ctx: Context) -> str:
    """Close this request's event stream mid-call; the answer comes on the resumed stream."""
    await ctx.report_progress(1, 2)
    await ctx.close_sse_stream()
    await anyio.sleep(0.5)
    return "hopped"


class MemoryEventStore(EventStore):
    """Every event kept in memory, so a client's Last-Event-ID can resume any stream."""

    def __init__(self):
        self.events = []
        self.ids = count(1)

    async def store_event(self, stream_id, message):
        event_id = str(next(self.ids))
        self.events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(self, last_event_id, send_callback):
        stream = next((s for (e, s, _) in self.events if e == last_event_id), None)
        if stream is None:
            return None
        after = False
        for event_id, stream_id, message in self.events:
            if after and stream_id == stream and message is not None:
                await send_callback(EventMessage(message, event_id))
            if event_id == last_event_id:
                after = True
        return stream


def main():
    mode = sys.argv[1]
    if mode == "stdio":
        server.run("stdio")
    elif mode == "http":
        port = int(sys.argv[2])
        anyio.run(
            lambda: server.run_streamable_http_async(
                port=port, event_store=MemoryEventStore(), retry_interval=100
            )
        )
    elif mode == "sse":
        anyio.run(lambda: server.run_sse_async(port=int(sys.argv[2])))
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
