"""Qt-free chat state: conversations persisted in SQLite."""
