"""Entry point of the frozen `runmyai` executable (the desktop app)."""

from runmyai.__main__ import main

if __name__ == "__main__":
    raise SystemExit(main())
