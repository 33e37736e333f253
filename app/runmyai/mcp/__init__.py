"""MCP servers for the chat (Qt-free): their configuration, the connections, the approval of each tool call."""
