"""A small MCP server for the app's tests, on the official SDK: run as `python mcp_server.py [--http PORT]
[--gate FILE]`.

Tools: add (a + b), echo, crash (the process exits in the middle of the call), hang (answers only once the file
given by --gate exists: the test decides when, or never, so nothing races the clock). A prompt (review) and
two resources (a text note, a binary blob)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

parser = argparse.ArgumentParser()
parser.add_argument("--http", type=int, default=0, help="serve streamable HTTP on this port (0: stdio)")
parser.add_argument("--gate", default="", help="hang answers once this file exists")
parser.add_argument("--started", default="", help="a file written when a call of hang has begun")
opts = parser.parse_args()

server = MCPServer("test-tools")


@server.tool(description="Adds two integers.")
def add(a: int, b: int) -> str:
    return f"{a} + {b} = {a + b}"


@server.tool(description="Returns its text.")
def echo(text: str) -> str:
    return text


@server.tool(description="Exits the server in the middle of the call.")
def crash() -> str:
    print("test server: crashing on purpose", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool(description="Answers once the gate file exists.")
async def hang() -> str:
    if opts.started:
        Path(opts.started).write_text("started")
    while not (opts.gate and Path(opts.gate).exists()):
        await asyncio.sleep(0.02)
    return "released"


@server.prompt(description="Asks for a review of some code.")
def review(code: str) -> str:
    return f"Please review this code:\n{code}"


@server.resource("note://readme", description="A short note.", mime_type="text/plain")
def readme() -> str:
    return "The launch code is 4711."


@server.resource("blob://bytes", mime_type="application/octet-stream")
def blob() -> bytes:
    return b"\x00\x01"


if __name__ == "__main__":
    if opts.http:
        server.run("streamable-http", host="127.0.0.1", port=opts.http)
    else:
        server.run()
