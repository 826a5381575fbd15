"""An MCP server whose tools answer with pictures, for caliban's tool-result tests, written
with the official Python SDK (`mcp`'s MCPServer, which 1.x called FastMCP). Over stdio.

Tools: shot (a text and a PNG, the SDK's Image helper), mixed (an image resource blob, a PDF
blob, audio, a resource link and a text resource), huge (a PNG too large for the model).
"""

import base64

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.utilities.types import Image
from mcp.types import (
    AudioContent,
    BlobResourceContents,
    EmbeddedResource,
    ResourceLink,
    TextResourceContents,
)

# A 1×1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)

server = MCPServer("caliban-pictures")


@server.tool()
def shot() -> list:
    """A screenshot."""
    return ["a screenshot", Image(data=PNG, format="png")]


@server.tool()
def mixed() -> list:
    """Every kind of content block that is not plain text."""
    blob = base64.b64encode(PNG).decode()
    return [
        EmbeddedResource(
            type="resource",
            resource=BlobResourceContents(uri="file:///chart.png", blob=blob, mimeType="image/png"),
        ),
        EmbeddedResource(
            type="resource",
            resource=BlobResourceContents(uri="file:///report.pdf", blob="JVBERi0=", mimeType="application/pdf"),
        ),
        AudioContent(type="audio", data="UklGRg==", mimeType="audio/wav"),
        ResourceLink(type="resource_link", uri="file:///big.csv", name="big.csv"),
        EmbeddedResource(
            type="resource",
            resource=TextResourceContents(uri="file:///notes.txt", text="resource body", mimeType="text/plain"),
        ),
    ]


@server.tool()
def huge() -> list:
    """A PNG of 2.5 MB, over the model's cap once in base64."""
    return ["too big", Image(data=PNG + bytes(2_500_000), format="png")]


if __name__ == "__main__":
    server.run("stdio")
