"""Entry point of the frozen `tokenwing` executable (the engine)."""

from tokenwing.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
