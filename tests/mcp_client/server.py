"""An MCP server for caliban's MCP client tests, written with the official Python SDK
(`mcp`'s MCPServer, which mcp 2.x calls what 1.x called FastMCP).

    server.py stdio
    server.py http PORT      Streamable HTTP at /mcp (with an event store, so streams resume)
    server.py https PORT CERT KEY   the same over TLS (uvicorn's), with that identity
    server.py http-json PORT Streamable HTTP answering each POST with one JSON body (no SSE)
    server.py sse PORT       the legacy HTTP+SSE transport at /sse

Tools: echo, slow (sleeps, no progress), ticking (sleeps, reporting progress), crash (the
process exits mid-call), grow (adds a tool and says the list changed), picture (an image
and a resource), hop (closes its own SSE stream mid-call, so the client must resume it),
announce (says the list changed on the standalone GET stream, breaks that stream, and says
it again, so the client must resume the stream to hear it).

Over HTTP the server also leaves marks of what the SDK does not show: `session-deleted`
(the session id a DELETE ended, and the status answered) and `standalone-resumed` (the
Last-Event-ID of a GET that resumed the standalone stream).
"""

import os
import sys
from itertools import count

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.utilities.types import Image
from mcp.server.streamable_http import EventMessage, EventStore

class TestServer(MCPServer):
    """Counts the `tools/list` requests it answers, so a tool can wait for the client to
    list again after it said the list changed."""

    lists = 0

    async def list_tools(self):
        TestServer.lists += 1
        return await super().list_tools()


server = TestServer("caliban-test")

# How long a tool waits for something the client should do (one receive, one timeout).
WAIT_SECONDS = 20


async def until(ready):
    """Waits (at most WAIT_SECONDS) for `ready()`; whether it came true."""
    with anyio.move_on_after(WAIT_SECONDS):
        while not ready():
            await anyio.sleep(0.02)
    return ready()


@server.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    return f"echo: {text}"


def mark(name, text=None):
    """Leaves a file in $MARK_DIR for the test to see (it cannot see inside the server)."""
    directory = os.environ.get("MARK_DIR")
    if directory:
        # Written aside and renamed, so the test never reads half a mark.
        path = os.path.join(directory, name)
        with open(path + ".tmp", "w") as f:
            f.write(name if text is None else text)
        os.replace(path + ".tmp", path)


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


@server.tool()
async def announce(ctx: Context) -> str:
    """Add tools `early` and `later`, each announced with tools/list_changed on the
    standalone GET stream (unrelated to this call); between the two, that stream is closed,
    so the second reaches the client only on the stream it resumes with Last-Event-ID."""
    from mcp.server.streamable_http import GET_STREAM_KEY
    from mcp.types import ToolListChangedNotification

    session_id = ctx.request_context.request.headers.get("mcp-session-id")
    transport = server.session_manager._server_instances.get(session_id)
    if transport is None:
        return "no session"
    if not await until(lambda: GET_STREAM_KEY in transport._request_streams):
        return "the client opened no standalone stream"

    def early() -> str:
        """Added by announce."""
        return "early ran"

    def later() -> str:
        """Added by announce, after the stream broke."""
        return "later ran"

    listed = TestServer.lists
    server.add_tool(early, name="early")
    await ctx.session.send_notification(ToolListChangedNotification())
    if not await until(lambda: TestServer.lists > listed):
        return "the client did not list again after the first notification"
    await ctx.close_standalone_sse_stream()
    listed = TestServer.lists
    server.add_tool(later, name="later")
    await ctx.session.send_notification(ToolListChangedNotification())
    if not await until(lambda: TestServer.lists > listed):
        return "the client did not list again after the stream broke"
    return "announced"


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


EVENTS = MemoryEventStore()


class Marks:
    """ASGI middleware leaving marks of a session's DELETE and of a resumed standalone
    stream (see the module's docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from mcp.server.streamable_http import GET_STREAM_KEY

        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if scope["method"] == "DELETE":
            answered = {}

            async def watch(message):
                if message["type"] == "http.response.start":
                    answered["status"] = message["status"]
                await send(message)

            await self.app(scope, receive, watch)
            mark("session-deleted", f"{headers.get('mcp-session-id')} {answered.get('status')}")
            return
        resumed = headers.get("last-event-id")
        if scope["method"] == "GET" and resumed is not None:
            if any(e == resumed and s == GET_STREAM_KEY for (e, s, _) in EVENTS.events):
                mark("standalone-resumed", resumed)
        await self.app(scope, receive, send)


def serve_http(port, tls=None, json_response=False):
    import uvicorn

    app = server.streamable_http_app(
        event_store=EVENTS, retry_interval=100, json_response=json_response
    )
    ssl = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
    config = uvicorn.Config(Marks(app), host="127.0.0.1", port=port, log_level="warning", **ssl)
    anyio.run(uvicorn.Server(config).serve)


def main():
    mode = sys.argv[1]
    if mode == "stdio":
        server.run("stdio")
    elif mode == "http":
        serve_http(int(sys.argv[2]))
    elif mode == "http-json":
        serve_http(int(sys.argv[2]), json_response=True)
    elif mode == "https":
        serve_http(int(sys.argv[2]), (sys.argv[3], sys.argv[4]))
    elif mode == "sse":
        anyio.run(lambda: server.run_sse_async(port=int(sys.argv[2])))
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
