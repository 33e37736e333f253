"""The chat templates' renderer child (`tokenwing __render_worker`): its loop, apart from the parent's side in
render_worker.py, which chat.py uses — so the child's use of chat.py runs one way (render_worker.py explains the
budget: the child's address space, time and output)."""

from __future__ import annotations

import json
import pickle
import resource
import signal
import struct
import sys
from collections import OrderedDict
from typing import Any

from tokenwing.errors import BadInputError
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.render_worker import KEEP_TEMPLATES, MEMORY_LIMIT, read_exact, write_message


def run_worker() -> int:
    """The child's loop: a request (pickled by the parent: plain values only) in, a JSON reply out."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the terminal's Ctrl-C is the parent's to handle)
    templates: OrderedDict[tuple[str, str | None, str | None, bool], ChatTemplate] = OrderedDict()
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    while True:
        head = read_exact(fd_in, 8, None)
        if head is None:
            return 0
        body = read_exact(fd_in, struct.unpack("<Q", head)[0], None)
        if body is None:
            return 0
        over = False
        try:
            req = pickle.loads(body)
            key = (req["source"], req["bos"], req["eos"], req["drop_leading_bos"])
            template = templates.pop(key, None) or ChatTemplate(key[0], key[1], key[2], drop_leading_bos=key[3])
            templates[key] = template
            while len(templates) > KEEP_TEMPLATES:
                templates.popitem(last=False)
            prompt = (
                ""  # (a compile request: the template is kept above)
                if req.get("compile")
                else template.render_here(
                    req["messages"], req["add_generation_prompt"], req["tools"], req["documents"], req["variables"]
                )
            )
            reply: dict[str, Any] = {"prompt": prompt}
        except BadInputError as e:
            reply = {"error": str(e)}
        except MemoryError:
            over = True
            reply = {"error": f"the chat template took more than its {MEMORY_LIMIT >> 20} MiB budget", "budget": 1}
        except Exception as e:  # whatever a template did, the parent gets one line
            reply = {"error": f"the chat template failed: {type(e).__name__}"}
        write_message(fd_out, json.dumps(reply).encode())
        if over:
            return 0  # (after a MemoryError, a fresh child is the safe one)
